"""Results: the store (exactly-once results in Redis), the sink (shards + per-batch index), blobs, the export
schema; their Redis commands and Lua live in ``store`` and ``sink``, beside their rules."""
