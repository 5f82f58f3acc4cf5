"""``lmdq-api``: an OpenAI-compatible Files + Batches HTTP API over lmdq's queue.

Teams with OpenAI Batch code (``client.files.create`` -> ``client.batches.create`` -> poll
``client.batches.retrieve`` -> ``client.files.content``) point the official SDK's ``base_url`` at this
server and keep their code. Everything behind it is lmdq's own submit / status / results / cancel
(:mod:`lmdq.api.backend`, the one module that calls them); this package only adds what HTTP needs:
uploads on disk, tenants and their keys, OpenAI's object shapes and error bodies.

Installed by the ``lmdq[api]`` extra (FastAPI, uvicorn, python-multipart); the base install never
imports it.
"""
