"""The producer service: ``lmdq-producer``, the command line that submits batches and reads them back.

Why a folder of its own: the design card keeps ``producer/`` and ``worker/`` as the two services. What
they run on is the core library in ``src/lmdq/``; the submission library itself (formats, submit,
prefix groups, cancel, retry, follow) is the core's ``lmdq.submission``, shared with the Python client
and the HTTP API. This package is only its command line: it imports the core, never the worker."""
