"""The Redis half of delivery: the lease table (``Keys.leases`` / ``Keys.lease_owner``, with the run,
attempt and crash counters and the model's in-flight list) and the queues a claim pops from.

Why a module of its own: what a claim, a charge or a lost lease means is the jobs' rule
(:mod:`lmdq.jobs.queue`); the script calls are here, because lmdq speaks Redis only under
:mod:`lmdq.redis` (tests/test_redis_boundary.py). Claim, renewal and release are on the GPU's critical
path: each is ONE script call (the claim pops and leases up to ``n`` jobs in it), timed by the server's
clock. Replies are handed back raw (untrusted: :class:`lmdq.jobs.queue.JobQueue` decodes them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from lmdq.redis import scripts
from lmdq.redis.keys import Keys, rq_queue_key

__all__ = ["JobLeases"]


class JobLeases:
    """Leases of one key prefix (thread-safe: redis-py clients are)."""

    def __init__(self, client: redis.Redis, *, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._claim = scripts.CLAIM.bind(client)
        self._heartbeat = scripts.HEARTBEAT.bind(client)
        self._release = scripts.RELEASE.bind(client)
        self._reap = scripts.REAP.bind(client)
        self._move = scripts.MOVE_JOB.bind(client)

    def claim(self, queues: Sequence[str], *, model: str, worker: str, lease_s: float, n: int) -> list[Any]:
        """Pop up to ``n`` jobs from ``queues`` (RQ queue names, first non-empty first) and lease them to
        ``worker``, in one script call. The raw flat reply: six fields per job (id, queue key, run,
        charges, crashes, killer)."""
        k = self.keys
        res = self._claim(
            keys=[k.leases(), k.lease_owner(), k.runs(), k.attempts(), k.crashes(), k.inflight(model),
                  *(rq_queue_key(q) for q in queues)],
            args=[lease_s, worker, n],
        )
        return list(res) if res else []

    def renew(self, job_ids: Sequence[str], *, worker: str, lease_s: float) -> list[Any]:
        """Extend the leases ``worker`` still owns among ``job_ids`` (one script call); the raw ids it
        owns no more."""
        return list(self._heartbeat(keys=[self.keys.leases(), self.keys.lease_owner()],
                                    args=[lease_s, worker, *job_ids]))

    def drop(self, job_id: str, *, worker: str, mode: str, charge: str, killer: int | str) -> bool:
        """Drop ``worker``'s lease, fenced (one script call; ``mode`` 'requeue' puts the job back at the
        front of its queue and counts ``charge``). False: the lease was not ``worker``'s any more."""
        k = self.keys
        return bool(self._release(keys=[k.leases(), k.lease_owner(), k.runs(), k.attempts(), k.crashes()],
                                  args=[job_id, worker, mode, charge, killer]))

    def reap_expired(self, limit: int) -> list[Any]:
        """Re-queue up to ``limit`` jobs whose lease ran out (one script call); the raw flat reply
        ``[job id, dead worker, ...]``."""
        return list(self._reap(keys=[self.keys.leases(), self.keys.lease_owner()], args=[limit]))

    def move(self, job_id: str, *, worker: str, queue: str, model: str) -> bool:
        """Put a held job on RQ queue ``queue`` (of ``model``, whose workers are woken) and drop ``worker``'s
        lease, in one script call. False: the lease was lost."""
        return bool(self._move(keys=[self.keys.leases(), self.keys.lease_owner(), rq_queue_key(queue),
                                     self.keys.wake(model)], args=[job_id, worker]))

    def clock(self) -> tuple[Any, Any, Any, Any]:
        """The lease clock's inputs, one round trip: the server's TIME (seconds, microseconds) and the last
        reading and offset the lease scripts keep in ``<leases>:clock`` (raw; None when absent)."""
        with self.client.pipeline(transaction=False) as p:
            p.time()
            p.hmget(self.keys.lease_clock(), ["raw", "offset"])
            (sec, usec), (last, offset) = p.execute()
        return sec, usec, last, offset

    def waiting(self, queues: Sequence[str]) -> int:
        """Jobs waiting on ``queues`` (RQ queue names), one pipelined round trip."""
        with self.client.pipeline(transaction=False) as p:
            for q in queues:
                p.llen(rq_queue_key(q))
            return int(sum(p.execute()))
