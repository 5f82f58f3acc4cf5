"""lmdq.jobs.rq_records: RQ's job hash, status and registries as lmdq keeps them, on a real redis-server."""

from __future__ import annotations

import redis
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

from lmdq.contract import JOB_FUNCTION
from lmdq.jobs.rq_records import RQRecords
from lmdq.redis.keys import BatchField, Keys

SER = JSONSerializer()


def _staged(client: redis.Redis, prefix: str, job_id: str = "b1-000000") -> tuple[RQRecords, Job]:
    k = Keys(prefix)
    client.hset(k.batch("b1"), mapping={BatchField.status.value: "in_progress", BatchField.ttl.value: 600})
    rec = RQRecords(client, keys=k, serializer=SER, ttl_s=600)
    job = Job.create(JOB_FUNCTION, args=[{"batch_id": "b1"}], connection=client, id=job_id, origin="q",
                     status=JobStatus.QUEUED, serializer=SER, timeout=-1)
    with client.pipeline() as p:
        rec.stage(job, {"lmdq_format": "1"}, batch_id="b1", ttl_s=600, pipe=p)
        p.execute()
    return rec, job


def test_stage_writes_the_hash_its_ttl_and_the_job_list(client: redis.Redis, prefix: str) -> None:
    _, job = _staged(client, prefix)
    assert client.hget(job.key, "lmdq_format") == b"1" and client.hget(job.key, "status") == b"queued"
    assert 590 <= client.ttl(job.key) <= 600
    assert client.lrange(Keys(prefix).batch_jobs("b1"), 0, -1) == [b"b1-000000"]


def test_begin_reads_everything_and_records_the_start_in_one_pipeline(client: redis.Redis, prefix: str) -> None:
    rec, job = _staged(client, prefix)
    k = Keys(prefix)
    client.hset(k.results("b1"), "1", "r1")
    client.hset(k.shards("b1"), "0", "entry")
    got, execution = rec.begin(job, job.id, batch_id="b1", indices=[0, 1], job_no=0, worker="w", ttl_s=60)
    (sec, _usec), (status, expires), have, sealed = got[:4]
    assert int(sec) > 0 and status == b"in_progress" and expires is None
    assert have == [None, b"r1"] and sealed == 1
    assert execution is not None and client.hget(job.key, "status") == b"started"
    assert job.id in StartedJobRegistry("q", connection=client).get_job_ids()
    got, execution = rec.begin(None, "b1-000009", batch_id="b1", indices=[0], job_no=None, worker="w", ttl_s=60)
    assert len(got) == 3 and execution is None  # no job: reads only


def test_end_and_requeue_move_rq_s_view(client: redis.Redis, prefix: str) -> None:
    rec, job = _staged(client, prefix)
    execution = rec.started(job, job.id, "w", 60)
    rec.beat([(execution, job)] if execution is not None else [], 120)
    rec.requeued(job)
    assert client.hget(job.key, "status") == b"queued"
    assert job.id not in StartedJobRegistry("q", connection=client).get_job_ids()
    rec.ended(job, None, failed=None, ended_at="2026-01-01T00:00:00.000000Z")
    assert client.hget(job.key, "status") == b"finished" and client.hget(job.key, "ended_at")
    assert job.id in FinishedJobRegistry("q", connection=client).get_job_ids()


def test_ended_after_runs_its_first_call_and_the_end_records_in_one_multi(client: redis.Redis, prefix: str) -> None:
    rec, job = _staged(client, prefix)
    execution = rec.started(job, job.id, "w", 60)
    other = f"{prefix}:first"
    got, recorded = rec.ended_after(lambda p: p.incr(other), job, execution, failed=None,
                                    ended_at="2026-01-01T00:00:00.000000Z")
    assert got == 1 and recorded and client.get(other) == b"1"
    assert client.hget(job.key, "status") == b"finished"
    assert job.id in FinishedJobRegistry("q", connection=client).get_job_ids()
    assert job.id not in StartedJobRegistry("q", connection=client).get_job_ids()
    # a refused end record is reported, not raised (the first call must not run again): a WRONGTYPE here
    client.delete(job.key)
    client.set(job.key, "not a hash")
    got, recorded = rec.ended_after(lambda p: p.incr(other), job, None, failed=None, ended_at="x")
    assert got == 2 and not recorded
    client.delete(job.key)


def test_failed_unread_and_forget(client: redis.Redis, prefix: str) -> None:
    rec, job = _staged(client, prefix)
    rec.failed_unread(job.id, "q", {"status": "failed"}, ttl_s=100, until=2_000_000_000)
    assert client.hget(job.key, "status") == b"failed" and client.ttl(job.key) <= 100
    assert client.zscore(FailedJobRegistry("q", connection=client).key, job.id) == 2_000_000_000
    rec.forget(job.id)
    assert not client.exists(job.key)


def test_a_job_of_a_batch_that_is_gone_is_not_brought_back(client: redis.Redis, prefix: str) -> None:
    rec, job = _staged(client, prefix)
    client.delete(Keys(prefix).batch("b1"))
    rec.started(job, job.id, "w", 60)
    assert not client.exists(job.key)  # the orphan guard drops what RQ's writes would leave without a TTL
