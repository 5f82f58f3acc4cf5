"""Leases, reaping and exactly-once results against a real Redis (no worker process)."""

from __future__ import annotations

import dataclasses
import time

import redis

from lmdq.contract import Batch, BatchStatus, RequestCounts, Result, ResultStatus
from lmdq.jobs.queue import JobQueue
from lmdq.redis.keys import Keys, queue_name, rq_queue_key
from lmdq.results.store import ResultStore
from tests.helpers import commit_staged, stage_jobs


def _batch(store: ResultStore, bid: str, total: int) -> None:
    store.batches.create(Batch(id=bid, model="sim", status=BatchStatus.queued, batch_size=4,
                             request_counts=RequestCounts(total=total), created_at=time.time()))


def _res(bid: str, i: int, status: ResultStatus = ResultStatus.completed, text: str = "x") -> Result:
    return Result(batch_id=bid, custom_id=str(i), index=i, status=status, text=text, model="sim")


def test_final_result_written_once_and_counted_once(client: redis.Redis, prefix: str) -> None:
    store = ResultStore(client, keys=Keys(prefix))
    _batch(store, "b1", 2)
    assert store.write_result(_res("b1", 0, text="first"))
    assert not store.write_result(_res("b1", 0, text="late duplicate"))
    b = store.batches.get("b1")
    assert b.request_counts.completed == 1 and b.status is BatchStatus.queued
    assert store.write_result(_res("b1", 1, ResultStatus.failed))
    b = store.batches.get("b1")
    assert b.request_counts.completed == 1 and b.request_counts.failed == 1
    assert b.status is BatchStatus.completed and b.completed_at is not None
    (_, raw0), _ = list(store.iter_results("b1", 2))
    assert Result.model_validate_json(raw0).text == "first"  # type: ignore[arg-type]


def test_partial_never_shadows_final(client: redis.Redis, prefix: str) -> None:
    store = ResultStore(client, keys=Keys(prefix))
    _batch(store, "b2", 1)
    assert store.write_partial(_res("b2", 0, ResultStatus.in_progress, "par"))
    assert store.partial_count("b2") == 1
    store.write_result(_res("b2", 0, text="final"))
    assert store.partial_count("b2") == 0
    assert not store.write_partial(_res("b2", 0, ResultStatus.in_progress, "late partial"))
    assert Result.model_validate_json(next(store.iter_results("b2", 1))[1]).text == "final"  # type: ignore[arg-type]


def _stage(client: redis.Redis, prefix: str, bid: str, n_jobs: int) -> JobQueue:
    jq = JobQueue(client, keys=Keys(prefix))
    q = queue_name("sim", "normal", prefix)
    stage_jobs(client, jq, bid, q, n_jobs)
    assert client.llen(rq_queue_key(q)) == 0  # staged jobs are invisible until commit
    assert commit_staged(client, Keys(prefix), bid, "sim", n_jobs, n_jobs) == n_jobs
    return jq


def test_claim_is_priority_ordered_and_leased(client: redis.Redis, prefix: str) -> None:
    jq = _stage(client, prefix, "b3", 2)
    hi = queue_name("sim", "high", prefix)
    client.rpush(rq_queue_key(hi), "urgent-job")
    qs = [queue_name("sim", p, prefix) for p in ("high", "normal", "low")]
    c1 = jq.claim(qs, model="sim", worker="w1", lease_s=30)
    c2 = jq.claim(qs, model="sim", worker="w1", lease_s=30)
    assert c1 is not None and c1.job_id == "urgent-job"
    assert c2 is not None and c2.job_id == "b3-000000" and c2.attempt == 1
    k = Keys(prefix)
    assert client.zscore(k.leases(), "b3-000000") is not None
    assert client.lrange(k.inflight("sim"), 0, -1) == [b"urgent-job", b"b3-000000"]


def test_claim_many_takes_several_jobs_in_priority_order_in_one_call(client: redis.Redis, prefix: str) -> None:
    jq = _stage(client, prefix, "b5", 4)
    hi = queue_name("sim", "high", prefix)
    client.rpush(rq_queue_key(hi), "urgent-1", "urgent-2")
    qs = [queue_name("sim", p, prefix) for p in ("high", "normal", "low")]
    got = jq.claim_many(qs, model="sim", worker="w1", lease_s=30, n=3)
    assert [c.job_id for c in got] == ["urgent-1", "urgent-2", "b5-000000"]  # high drained first, then normal
    assert [c.queue_key for c in got] == [rq_queue_key(hi)] * 2 + [rq_queue_key(qs[1])]
    k = Keys(prefix)
    assert all(client.zscore(k.leases(), c.job_id) is not None for c in got)
    assert client.lrange(k.inflight("sim"), 0, -1) == [b"urgent-1", b"urgent-2", b"b5-000000"]
    rest = jq.claim_many(qs, model="sim", worker="w2", lease_s=30, n=10)  # fewer left than asked
    assert [c.job_id for c in rest] == ["b5-000001", "b5-000002", "b5-000003"]
    assert jq.claim_many(qs, model="sim", worker="w2", lease_s=30, n=10) == []
    assert client.hget(k.lease_owner(), "b5-000003").decode().startswith("w2\t")


def test_expired_lease_is_requeued_at_front_and_late_owner_is_fenced(client: redis.Redis, prefix: str) -> None:
    jq = _stage(client, prefix, "b4", 2)
    qs = [queue_name("sim", "normal", prefix)]
    c = jq.claim(qs, model="sim", worker="dead", lease_s=0.2)
    assert c is not None
    time.sleep(0.3)
    assert jq.reap() == [(c.job_id, "dead")]
    assert client.lindex(rq_queue_key(qs[0]), 0) == c.job_id.encode()  # front of the queue
    assert client.llen(Keys(prefix).inflight("sim")) == 0
    c2 = jq.claim(qs, model="sim", worker="alive", lease_s=30)
    assert c2 is not None and c2.job_id == c.job_id and c2.run == 2 and c2.attempt == 1  # a reap charges nothing
    # the presumed-dead worker wakes up: its heartbeat reports the loss, its release is a no-op
    assert jq.heartbeat([c], worker="dead", lease_s=30) == [c.job_id]
    assert not jq.finish(c, worker="dead")
    assert client.zscore(Keys(prefix).leases(), c.job_id) is not None  # still leased to 'alive'
    assert jq.finish(c2, worker="alive")


def test_release_ended_releases_and_records_the_end_in_one_round_trip(client: redis.Redis, prefix: str) -> None:
    """Issue 49: a job that ended is released and recorded in RQ in ONE MULTI; the release stays fenced (a late
    owner's is a no-op that reports it), and RQ's records say what is true of the job either way."""
    from rq.registry import FailedJobRegistry, FinishedJobRegistry

    jq = _stage(client, prefix, "b6", 2)
    qs = [queue_name("sim", "normal", prefix)]
    k = Keys(prefix)
    c = jq.claim(qs, model="sim", worker="w", lease_s=30)
    assert c is not None
    c.job = jq.fetch_job(c.job_id)
    jq.mark_started(c, "w", 60)
    assert jq.release_ended(c, worker="w") == (True, True)
    # the lease is gone and RQ says finished, from one MULTI
    assert client.zscore(k.leases(), c.job_id) is None and client.hget(k.lease_owner(), c.job_id) is None
    assert client.hget(f"rq:job:{c.job_id}", "status") == b"finished" and client.hget(f"rq:job:{c.job_id}", "ended_at")
    assert c.job_id in FinishedJobRegistry(qs[0], connection=client).get_job_ids()
    # a lease that is not this worker's any more: not released (fenced), reported as not owned
    c2 = jq.claim(qs, model="sim", worker="alive", lease_s=30)
    assert c2 is not None
    late = dataclasses.replace(c2, job=jq.fetch_job(c2.job_id))
    assert jq.release_ended(late, worker="dead", failed="boom") == (False, True)
    assert client.hget(k.lease_owner(), c2.job_id).decode().startswith("alive\t")
    assert c2.job_id in FailedJobRegistry(qs[0], connection=client).get_job_ids()


def test_foreign_function_is_refused_by_payload_check(client: redis.Redis, prefix: str) -> None:
    from rq import Queue
    from rq.serializers import JSONSerializer

    q = Queue(queue_name("sim", "normal", prefix), connection=client, serializer=JSONSerializer)
    job = q.enqueue("os.system", "touch /tmp/pwned")
    jq = JobQueue(client, keys=Keys(prefix))
    try:
        jq.payload_of(jq.fetch_job(job.id))
    except ValueError as e:
        assert "os.system" in str(e)
    else:
        raise AssertionError("os.system job was accepted")
