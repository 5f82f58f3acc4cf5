"""The registries: which workers are alive (their lmdq and RQ worker records, cancellations they poll)
and which models submit accepts; their Redis commands and Lua live in :mod:`lmdq.registry.store`."""

MAX_NOTE = 200
"""An operator's note on a registered model: a reminder, not a document. Declared here, not in
:mod:`lmdq.registry.store`: ``lmdq-producer models add --help`` shows it, and the CLI's start-up
imports no Redis client (issue 49)."""
