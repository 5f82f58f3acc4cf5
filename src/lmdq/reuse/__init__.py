"""Never pay twice: content-addressed reuse of completed results across batches (issue 47).

A request's :mod:`identity <lmdq.reuse.identity>` hashes everything that decides its output: the served
weights' :mod:`fingerprint <lmdq.reuse.fingerprint>` and the engine's settings (published by the worker),
the request's input and its generation parameters with the seed. The :mod:`index <lmdq.reuse.store>`
maps an identity to where a completed result lives (a sink shard line, or a compact copy of it while
only Redis held it), with its own TTL and purge by model. The worker answers a request whose identity is
indexed from the stored result, so the engine never sees it (``worker/reuse.py``).
"""
