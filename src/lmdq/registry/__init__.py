"""The registries: which workers are alive (their lmdq and RQ worker records, cancellations they poll)
and which models submit accepts; their Redis commands and Lua live in :mod:`lmdq.registry.store`."""
