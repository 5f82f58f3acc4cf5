"""Results: the store (exactly-once results in Redis), the sink (shards + per-batch index), blobs, the export schema."""
