"""Plain reads of lmdq's Redis records for callers outside the object that owns them: a batch's status
field (the worker answering a job it cannot decode), a job hash field within a size cap (decode_job),
how many jobs a model's workers hold (the fleet bench waits for a cancelled batch to leave them).

Why here and not at the caller: Redis commands live only in a concept's store modules
(tests/test_redis_boundary.py); what a caller does with the answer (untrusted: every caller validates
it) stays with the caller. The two capped reads that are scripts sit beside the code that runs them:
``READ_JOB`` in :mod:`lmdq.jobs.data`, ``READ_BATCH`` in :mod:`lmdq.jobs.decode`.
"""

from __future__ import annotations

import redis
from rq.job import Job

from lmdq.redis.keys import BatchField, Keys

__all__ = ["batch_status", "capped_job_field", "inflight_count"]


def batch_status(client: redis.Redis, keys: Keys, batch_id: str) -> bytes | None:
    """The raw ``status`` field of the batch record (None: no record)."""
    raw = client.hget(keys.batch(batch_id), BatchField.status.value)
    return raw if isinstance(raw, bytes) or raw is None else str(raw).encode()


def capped_job_field(client: redis.Redis, job_id: str, field: str, cap: int) -> tuple[int, bytes | None]:
    """``(size, value)`` of one field of RQ's job hash: the value only when ``size <= cap`` (None when
    the field is missing or too large), so an untrusted hash never hands over more than ``cap`` bytes."""
    key = Job.key_for(job_id)
    size = int(client.hstrlen(key, field))
    if size > cap:
        return size, None
    raw = client.hget(key, field)
    return size, raw if isinstance(raw, bytes) or raw is None else str(raw).encode()


def inflight_count(client: redis.Redis, keys: Keys, model: str) -> int:
    """How many jobs workers of ``model`` hold now (the length of :meth:`Keys.inflight`)."""
    return int(client.llen(keys.inflight(model)))
