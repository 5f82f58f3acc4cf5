"""The store of RQ's view of lmdq's jobs: the job hash (written by RQ's ``Job``, plus lmdq's plain
fields), RQ's status and registries (Started/Finished/FailedJobRegistry, executions), and what a worker
reads with them before a job starts.

Why a module of its own: lmdq keeps RQ's records so ``rq info`` and rq-dashboard show lmdq's work, but
when a job is staged, started, ended or refused is the jobs' rule (:mod:`lmdq.jobs.queue`); the
commands (RQ's own, on pipelines handed to it, and lmdq's) are here, in the jobs' store
(tests/test_redis_boundary.py). Each step is the pipeline it was before the
move: one round trip per job start, end or re-queue. Replies are handed back raw (untrusted).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import redis
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

from lmdq.redis.keys import BatchField, Keys
from lmdq.redis.scripts import LuaScript

__all__ = ["RQRecords"]


class RQRecords:
    """RQ's records of one key prefix's jobs (thread-safe: redis-py clients are)."""

    def __init__(self, client: redis.Redis, *, keys: Keys, serializer: JSONSerializer, ttl_s: int) -> None:
        self.client = client
        self.keys = keys
        self.serializer = serializer
        #: how long RQ keeps a finished or failed job's registry entry
        self.ttl_s = ttl_s
        self._drop_orphan = DROP_ORPHAN.bind(client)

    # ---- staging (the ledger's pipeline) ------------------------------------------------------
    def stage(self, job: Job, fields: Mapping[str, str], *, batch_id: str, ttl_s: int, pipe: Any) -> None:
        """Queue the job hash on ``pipe`` (RQ's fields and lmdq's plain ``fields``), its TTL, and its id on
        the batch's job list; the caller sends the pipeline."""
        # RQ's fields (what ``job.save`` writes) and lmdq's in ONE HSET: a command less per job (issue 49)
        pipe.hset(job.key, mapping={**job.to_dict(), **fields})
        pipe.expire(job.key, ttl_s)
        pipe.rpush(self.keys.batch_jobs(batch_id), job.id)

    # ---- a job starts ---------------------------------------------------------------------------
    def begin(self, job: Job | None, job_id: str, *, batch_id: str, indices: Sequence[int], job_no: int | None,
              worker: str, ttl_s: int) -> tuple[list[Any], Execution | None]:
        """ONE round trip: the server's TIME, the batch's status and deadline, the results of ``indices``,
        (with ``job_no``) whether the job is in the shard index, and RQ's started records. The raw
        replies in that order, and the execution RQ recorded (None without a job)."""
        with self.client.pipeline() as p:
            p.time()
            p.hmget(self.keys.batch(batch_id), [BatchField.status.value, BatchField.expires_at.value])
            p.hmget(self.keys.results(batch_id), list(indices))
            if job_no is not None:
                p.hexists(self.keys.shards(batch_id), str(job_no))
            execution = self.started(job, job_id, worker, ttl_s, pipe=p)
            got = p.execute()
        return list(got), execution

    def started(self, job: Job | None, job_id: str, worker: str, ttl_s: int, pipe: Any | None = None
                ) -> Execution | None:
        """RQ's status and StartedJobRegistry entry for a claimed job (None without a job). With ``pipe``
        the commands join it (the caller sends it); without, one pipeline of their own."""
        if job is None:
            return None
        if pipe is not None:
            job.prepare_for_execution(worker, pipe)
            execution = Execution.create(job, ttl_s, pipe, worker_name=worker)
            self._orphan_guard(job_id, pipe)
            return execution
        with self.client.pipeline() as p:
            job.prepare_for_execution(worker, p)
            execution = Execution.create(job, ttl_s, p, worker_name=worker)
            self._orphan_guard(job_id, p)
            p.execute()
        return execution

    def _orphan_guard(self, job_id: str, pipe: Any) -> None:
        """Queue ``DROP_ORPHAN`` for ``job_id`` on ``pipe`` (after RQ's writes to the job hash): a job
        whose batch is gone loses the hash RQ's writes would otherwise bring back without a TTL."""
        batch_id = job_id.rsplit("-", 1)[0]
        self._drop_orphan(keys=[Job.key_for(job_id), self.keys.batch(batch_id)], client=pipe)

    def beat(self, running: Iterable[tuple[Execution, Job]], ttl_s: int) -> None:
        """Renew RQ's executions of running jobs, one pipeline (RQ's display records only)."""
        with self.client.pipeline() as p:
            for execution, job in running:
                execution.heartbeat(job.started_job_registry, ttl_s, p)
            p.execute()

    # ---- a job ends -----------------------------------------------------------------------------
    def ended(self, job: Job, execution: Execution | None, *, failed: str | None, ended_at: str) -> None:
        """RQ's records of a job that ended (status, Finished/FailedJobRegistry, ``ended_at``), one pipeline."""
        with self.client.pipeline() as p:
            self._ended(p, job, execution, failed=failed, ended_at=ended_at)
            p.execute()

    def ended_after(self, first: Callable[[Any], None], job: Job, execution: Execution | None, *,
                    failed: str | None, ended_at: str) -> tuple[Any, bool]:
        """``first`` (one call it queues: the lease's release) and then RQ's end records of ``job``, in ONE
        MULTI: one round trip per job end, not two (issue 49). Returns ``first``'s reply (raised if it is an
        error) and whether every end record was written (False: one was refused, e.g. under maxmemory; the
        caller writes them again with :meth:`ended`, on its own retry, since ``first`` must not run twice)."""
        with self.client.pipeline() as p:
            first(p)
            self._ended(p, job, execution, failed=failed, ended_at=ended_at)
            got = p.execute(raise_on_error=False)
        if isinstance(got[0], Exception):
            raise got[0]
        return got[0], not any(isinstance(x, Exception) for x in got[1:])

    def _ended(self, p: Any, job: Job, execution: Execution | None, *, failed: str | None, ended_at: str) -> None:
        """:meth:`ended`'s commands, queued on ``p``."""
        if execution is not None:
            execution.delete(job, p)
        if failed:
            job.set_status(JobStatus.FAILED, pipeline=p)
            FailedJobRegistry(job.origin, connection=self.client, serializer=self.serializer).add(
                job, ttl=self.ttl_s, exc_string=failed, pipeline=p
            )
        else:
            job.set_status(JobStatus.FINISHED, pipeline=p)
            FinishedJobRegistry(job.origin, connection=self.client, serializer=self.serializer).add(
                job, self.ttl_s, p
            )
        p.hset(job.key, "ended_at", ended_at)
        self._orphan_guard(job.id, p)

    def requeued(self, job: Job) -> None:
        """RQ's view of a re-queued job back to 'queued', its stale StartedJobRegistry entries dropped."""
        with self.client.pipeline() as p:
            job.set_status(JobStatus.QUEUED, pipeline=p)
            StartedJobRegistry(job.origin, connection=self.client).remove_executions(job, pipeline=p)
            self._orphan_guard(job.id, p)
            p.execute()

    def failed_unread(self, job_id: str, origin: str, fields: Mapping[str, Any], *, ttl_s: int,
                      until: int) -> None:
        """Record a job as failed WITHOUT reading or re-saving it (a refused, maybe foreign, job): plain
        ``fields``, its TTL and a FailedJobRegistry entry of queue ``origin`` scored ``until``, one pipeline."""
        key = Job.key_for(job_id)
        registry = FailedJobRegistry(origin, connection=self.client, serializer=self.serializer)
        mapping: dict[Any, Any] = dict(fields)  # redis-py's key type is invariant
        with self.client.pipeline() as p:
            p.hset(key, mapping=mapping)
            p.expire(key, ttl_s)
            p.zadd(registry.key, {job_id: until})
            p.execute()

    def forget(self, job_id: str) -> None:
        """Delete the job hash (its payload: the prompts)."""
        self.client.delete(Job.key_for(job_id))


# ==== Lua: this module's scripts (composed and run by lmdq.redis.scripts.LuaScript) ====

# KEYS: job hash, its batch's record.  Run last in the MULTI of every RQ bookkeeping write a worker makes
# for a job (started, ended, re-queued): RQ's HSETs re-create a job hash that ``purge`` deleted, with no
# TTL; with the batch gone, the re-created hash goes too.
DROP_ORPHAN = LuaScript("drop_orphan", """
if redis.call('EXISTS', KEYS[2]) == 0 then return redis.call('DEL', KEYS[1]) end
return 0
""")
