"""Batches: the batch record and its TTL rules, a batch's jobs as the ledger moves them, idempotency keys,
and submit's headroom check; their Redis commands and Lua are this package's store (``records``,
``batch_jobs``, ``idempotency``)."""
