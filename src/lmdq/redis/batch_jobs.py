"""The Redis half of a batch's jobs as the ledger moves them: staged writes, the job list
(``Keys.batch_jobs``), the commit that makes them visible, the rollback of what a failed submit staged,
and what ``cancel``, ``purge`` and ``retry`` read of them (on a queue, under a live lease, which fields).

Why a module of its own: when jobs may be staged, committed, rolled back, cancelled or purged is the
ledger's rule (:mod:`lmdq.submission.ledger`); the commands are here, because lmdq speaks Redis only under
:mod:`lmdq.redis` (tests/test_redis_boundary.py). A job hash itself is written by
:class:`lmdq.jobs.queue.JobQueue` into the pipeline :meth:`BatchJobs.writes` hands out, so a submit's
staging still goes to Redis in few round trips. Replies are handed back raw or as plain numbers; the
callers check them (untrusted).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from rq.job import Job, JobStatus

from lmdq.redis import scripts
from lmdq.redis.keys import Keys
from lmdq.redis.replies import reply_text

__all__ = ["RQ_QUEUES", "BatchJobs", "JobWrites"]

RQ_QUEUES = "rq:queues"
"""RQ's set of known queue keys (what ``rq info`` lists); RQ owns the name."""

_COMMIT_CHUNK = 4000
"""Job ids the commit script reads and pushes per step (one LRANGE/RPUSH each, inside the script)."""

_DELETE_CHUNK = 1000
"""Keys per DEL: a rollback of a million jobs never builds one huge command."""

_LEASE_CHUNK = 500
"""Job ids per ZMSCORE round trip when counting live leases."""


def _raw(value: Any) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return str(value).encode()


def _score(value: Any) -> float | None:
    return None if value is None else float(value)


class JobWrites:
    """One submit's staged writes: a pipeline that :meth:`lmdq.jobs.queue.JobQueue.stage` queues job hashes
    on, sent by :meth:`flush` (every chunk of jobs, and at the end)."""

    def __init__(self, pipe: redis.client.Pipeline) -> None:
        #: the pipeline to hand to ``JobQueue.stage(pipe=...)``; only this object sends it
        self.pipe = pipe

    def flush(self) -> None:
        """Send what is queued (one round trip). A refused write raises here, as redis-py raises it."""
        self.pipe.execute()


class BatchJobs:
    """The jobs of the batches of one key prefix (thread-safe: redis-py clients are)."""

    def __init__(self, client: redis.Redis, *, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._commit = scripts.COMMIT.bind(client)
        self._commit_upto = scripts.COMMIT_UPTO.bind(client)
        self._find_prefix = scripts.FIND_PREFIX.bind(client)
        self._remove_prefix = scripts.REMOVE_PREFIX.bind(client)

    # ---- staging and commit -------------------------------------------------------------------
    @contextmanager
    def writes(self) -> Iterator[JobWrites]:
        """A pipeline for staging (no MULTI: a submit of a million jobs must not hold the server), reset
        when the block ends, whatever was left unsent."""
        with self.client.pipeline(transaction=False) as p:
            yield JobWrites(p)

    def _commit_keys(self, batch_id: str, queue_key: str, wakes: Sequence[str]) -> list[str]:
        # KEYS of COMMIT / COMMIT_UPTO: no queue key ('' pushes each job onto its own model's queue) needs a
        # placeholder key in its slot, RQ's queue set (never written as a list)
        return [self.keys.batch_jobs(batch_id), queue_key or RQ_QUEUES, RQ_QUEUES, self.keys.batch(batch_id),
                *wakes]

    def commit(self, *, batch_id: str, queue_key: str, wakes: Sequence[str], now: float, ttl_s: int) -> int:
        """Every staged job of the batch onto its queue (``queue_key``, or '' for each job's own model's
        queue), the record ``queued``, every key of the batch at ``ttl_s``, one token on each of ``wakes``:
        one script, fenced on ``queued_at``. Returns the jobs made visible, -1 when it had run already."""
        return int(self._commit(keys=self._commit_keys(batch_id, queue_key, wakes),
                                args=[queue_key, _COMMIT_CHUNK, now, ttl_s]))

    def commit_upto(self, *, batch_id: str, queue_key: str, wakes: Sequence[str], jobs: int, requests: int,
                    now: float, ttl_s: int, last: bool, token: str = "") -> int:
        """Progressive staging: the staged jobs up to ``jobs`` (``requests`` requests) become visible, as
        :meth:`commit` does for all of them, only while the staging lease holds ``token`` ('': unfenced).
        Returns the jobs made visible, -1 when they were already, -2 when the batch is no longer live
        (cancelled while it was being staged), -3 when the lease is not ``token``'s."""
        keys = self._commit_keys(batch_id, queue_key, wakes)
        keys.insert(4, self.keys.staging_lease(batch_id))
        return int(self._commit_upto(keys=keys,
                                     args=[queue_key, jobs, requests, now, ttl_s, "1" if last else "0", token]))

    # ---- the job list -------------------------------------------------------------------------
    def job_ids(self, batch_id: str, start: int = 0) -> list[str]:
        """The batch's job list from position ``start`` on, in job order (decoded with replacement)."""
        return [reply_text(j) for j in self.client.lrange(self.keys.batch_jobs(batch_id), start, -1)]

    # ---- rollback and abandon -----------------------------------------------------------------
    def staged(self, batch_id: str, candidates: Sequence[str]) -> tuple[list[str], bool]:
        """Which of ``candidates`` (keys a submit may have written) exist, and whether the batch is listed:
        one read-only round trip, so a rollback against a read-only replica writes nothing."""
        with self.client.pipeline(transaction=False) as p:
            for key in candidates:
                p.exists(key)
            p.zscore(self.keys.batches(), batch_id)
            *exists, listed_at = p.execute()
        return [key for key, n in zip(candidates, exists) if n], listed_at is not None

    def unstage(self, batch_id: str, present: Sequence[str]) -> None:
        """Delete ``present`` (what :meth:`staged` found) and the batch's listing entry, in one round trip."""
        with self.client.pipeline(transaction=False) as p:
            for start in range(0, len(present), _DELETE_CHUNK):
                p.delete(*present[start : start + _DELETE_CHUNK])
            p.zrem(self.keys.batches(), batch_id)
            p.execute()

    def drop_unqueued(self, batch_id: str, job_ids: Sequence[str], *, keep: int) -> None:
        """Delete the job hashes of ``job_ids`` and cut the job list to its first ``keep`` entries (the jobs
        a part-staged batch made visible), in one round trip."""
        job_keys = [Job.key_for(j) for j in job_ids]
        with self.client.pipeline(transaction=False) as p:
            for start in range(0, len(job_keys), _DELETE_CHUNK):
                p.delete(*job_keys[start : start + _DELETE_CHUNK])
            p.ltrim(self.keys.batch_jobs(batch_id), 0, keep - 1)
            p.execute()

    # ---- queues and leases (cancel, purge, in_flight) ------------------------------------------
    def queued(self, queue_key: str, id_prefix: str) -> list[str]:
        """Ids on the queue list ``queue_key`` that start with ``id_prefix`` (a read-only script)."""
        return [reply_text(j) for j in self._find_prefix(keys=[queue_key], args=[id_prefix])]

    def dequeue(self, queue_key: str, id_prefix: str) -> list[str]:
        """Take every id starting with ``id_prefix`` off the queue list ``queue_key`` (one pass over the
        list, in a script); returns the ids taken."""
        return [reply_text(j) for j in self._remove_prefix(keys=[queue_key], args=[id_prefix])]

    def mark_canceled(self, job_id: str) -> None:
        """RQ's status of the job hash: ``canceled`` (what ``rq info`` shows for a job cancel took off)."""
        self.client.hset(Job.key_for(job_id), "status", JobStatus.CANCELED.value)

    def lease_deadlines(self, job_ids: Sequence[str]) -> list[float | None]:
        """Each job's lease deadline (server clock; None: not leased), a round trip per chunk of ids."""
        out: list[float | None] = []
        for start in range(0, len(job_ids), _LEASE_CHUNK):
            out += map(_score, self.client.zmscore(self.keys.leases(), list(job_ids[start : start + _LEASE_CHUNK])))
        return out

    def leases_and_fields(self, job_ids: Sequence[str],
                          fields: Sequence[str]) -> list[tuple[float | None, list[bytes | None]]]:
        """For each job: its lease deadline (None: not leased) and ``fields`` of its job hash (raw, None:
        missing), in one round trip."""
        if not job_ids:
            return []
        with self.client.pipeline(transaction=False) as p:
            p.zmscore(self.keys.leases(), list(job_ids))
            for jid in job_ids:
                p.hmget(Job.key_for(jid), list(fields))
            leases, *values = p.execute()
        return [(_score(lease), [_raw(v) for v in vs]) for lease, vs in zip(leases, values)]
