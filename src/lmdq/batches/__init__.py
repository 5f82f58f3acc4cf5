"""Batches: the ledger that creates, stages, commits, cancels and purges a batch, and submit's headroom check."""
