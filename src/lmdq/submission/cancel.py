"""Cancel a batch: pull its queued jobs off the queue, abort what workers hold.

The rules (one Lua pass that takes the batch's jobs off each queue, ``cancelled`` results for
their requests written right here so counts are right even with no worker running, the cancelled
set in-flight work is aborted by) live in :meth:`lmdq.submission.ledger.BatchLedger.cancel`.
"""

from __future__ import annotations

import redis

from lmdq.contract import Batch
from lmdq.redis.keys import Keys
from lmdq.submission.ledger import BatchLedger

__all__ = ["cancel_batch"]


def cancel_batch(client: redis.Redis, keys: Keys, batch_id: str, *, ttl_s: int) -> Batch:
    """Cancel ``batch_id``; returns the batch as it stands afterwards (``cancelled`` when nothing
    was in flight, else ``cancelling`` until its workers finish)."""
    return BatchLedger(client, keys=keys, ttl_s=ttl_s).cancel(batch_id)
