"""Helpers for tests of lmdq and of code built on it: public, documented, and the only place test-only
code lives, so production modules do not bend for tests.

:func:`enqueue_batch` puts a batch of request dicts on the queue exactly as ``lmdq-producer submit``
does (the batch ledger's stage + one atomic commit, :meth:`lmdq.submission.ledger.BatchLedger.enqueue`) but
without a prompt file and its validation: a test that is about workers, jobs or results starts from
jobs in Redis, not from a file. :func:`enqueue_requests` builds the :class:`~lmdq.contract.Batch`
record too::

    from lmdq.testing import enqueue_requests

    batch_id = enqueue_requests(client, Keys(prefix), "sim", [{"prompt": "hi"}], batch_size=1)
    # ... run a worker (lmdq.worker.runner.Worker or `lmdq-worker --burst`), then read the results

Requests are dicts as the file formats yield them (``prompt`` or ``messages``, optional ``params``,
...); ``index`` and ``custom_id`` are filled in when absent. Nothing here is used by lmdq itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis

from lmdq.contract import Batch, BatchStatus, RequestCounts
from lmdq.redis.keys import Keys
from lmdq.submission.ledger import BatchLedger, new_batch_id

__all__ = ["enqueue_batch", "enqueue_requests"]


def enqueue_batch(batch: Batch, requests: Iterable[dict[str, Any]], *, client: redis.Redis, keys: Keys,
                  ttl_s: int = 3600, progress: Callable[[int], None] | None = None, chunk_jobs: int = 256) -> Batch:
    """Create ``batch`` (status validating), stage its jobs, and make them all visible at once; on any
    failure nothing is left behind (the ledger's rollback). ``ttl_s``: a test's batch is kept an hour."""
    return BatchLedger(client, keys=keys, ttl_s=ttl_s).enqueue(batch, requests, progress=progress,
                                                                  chunk_jobs=chunk_jobs)


def enqueue_requests(client: redis.Redis, keys: Keys, model: str, requests: Sequence[dict[str, Any]], *,
                     batch_size: int = 1, ttl_s: int = 3600, **batch_fields: Any) -> str:
    """Enqueue ``requests`` for ``model`` in jobs of ``batch_size``; return the new batch's id.

    ``batch_fields`` are further :class:`~lmdq.contract.Batch` fields (``params``, ``results_url``,
    ``blob_url``, ...)."""
    bid = new_batch_id()
    n = len(requests)
    b = Batch(id=bid, model=model, status=BatchStatus.validating, batch_size=batch_size,
              num_jobs=-(-n // batch_size), request_counts=RequestCounts(total=n), created_at=time.time(),
              **batch_fields)
    reqs = [{"index": i, "custom_id": f"r{i}", **r} for i, r in enumerate(requests)]
    enqueue_batch(b, reqs, client=client, keys=keys, ttl_s=ttl_s)
    return bid
