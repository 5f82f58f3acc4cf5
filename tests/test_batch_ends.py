"""Issue 29: every batch ends. A job no worker can decode (newer format, over a worker's lower
LMDQ_MAX_JOB_BYTES) is answered per request; ``cancel`` and ``retry`` get a stuck batch out; ``purge
--force`` of a running batch leaves no key without a TTL behind its workers.

Real redis-server (tests/conftest.py); real sim workers in this process, in burst mode (each returns once
its queues are empty, so nothing here waits on a clock).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from lmdq.contract import BatchStatus, ResultStatus
from lmdq.jobs.data import FORMAT_FIELD
from lmdq.jobs.queue import JobQueue, job_id_for
from lmdq.redis.keys import Keys, queue_names, rq_queue_key
from lmdq.submission.ledger import BatchLedger
from lmdq.submission.retry import retry_batch
from lmdq.submission.submit import SubmitOptions, submit_file
from tests.helpers import results_of, write_jsonl

MODEL = "sim"


def _rows(n: int, pad: int = 200) -> list[dict[str, Any]]:
    return [{"custom_id": f"r{i}", "prompt": f"question {i} " + "x" * pad} for i in range(n)]


def _submit(client: redis.Redis, prefix: str, path: Path, **opts: Any) -> Any:
    batch, created = submit_file(path, SubmitOptions(model=MODEL, allow_unknown_model=True, prefix_groups=False,
                                                     **opts), client=client, keys=Keys(prefix), ttl_s=3600)
    assert created
    return batch


def _worker(client: redis.Redis, url: str, prefix: str, **settings: Any) -> dict[str, int]:
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    s = WorkerSettings(redis_url=url, key_prefix=prefix, burst=True, health_port=0, heartbeat_ttl_s=10,
                       idle_wait_s=0, **settings)
    w = Worker(engine=SimEngine(model_name=MODEL, step_ms=0), client=client, settings=s)
    assert w.run() == 0
    return w.stats


def _ledger(client: redis.Redis, prefix: str) -> BatchLedger:
    return BatchLedger(client, keys=Keys(prefix), ttl_s=3600)


def test_a_job_over_the_workers_cap_is_answered_per_request(tmp_path: Path, redis_url: str, client: redis.Redis,
                                                            prefix: str) -> None:
    """bd9ca4b: a worker with a lower LMDQ_MAX_JOB_BYTES sent such jobs to RQ's failed registry and the
    batch stayed in_progress for good."""
    f = write_jsonl(tmp_path / "p.jsonl", _rows(12, pad=300_000))
    batch = _submit(client, prefix, f, batch_size=4)
    stats = _worker(client, redis_url, prefix, max_job_bytes=1 << 20)  # every job inflates to more than that
    assert stats["refused"] == 3 and stats["results"] == 0
    b = _ledger(client, prefix).get(batch.id)
    assert b.status is BatchStatus.completed and b.request_counts.failed == 12  # ended: every request answered
    got = results_of(client, prefix, batch.id)
    assert sorted(r.custom_id for r in got) == sorted(f"r{i}" for i in range(12))
    assert {r.error.code for r in got if r.error} == {"undecodable_job"} and len(got) == 12
    assert all("LMDQ_MAX_JOB_BYTES=1,048,576" in (r.error.message if r.error else "") for r in got)
    again, created = retry_batch(client, Keys(prefix), batch.id, ttl_s=3600)  # once workers can read them
    assert created and again.request_counts.total == 12
    _worker(client, redis_url, prefix)
    assert {r.status for r in results_of(client, prefix, again.id)} == {ResultStatus.completed}


def test_a_job_of_a_newer_format_is_refused_by_name_and_answered(tmp_path: Path, redis_url: str,
                                                                 client: redis.Redis, prefix: str) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", _rows(8))
    batch = _submit(client, prefix, f, batch_size=4)
    client.hset(f"rq:job:{job_id_for(batch.id, 1)}", FORMAT_FIELD, "2")  # as a newer lmdq would write it
    stats = _worker(client, redis_url, prefix)
    assert stats["refused"] == 1
    b = _ledger(client, prefix).get(batch.id)
    assert b.status is BatchStatus.completed and (b.request_counts.completed, b.request_counts.failed) == (4, 4)
    failed = [r for r in results_of(client, prefix, batch.id) if r.status is ResultStatus.failed]
    assert sorted(r.index for r in failed) == [4, 5, 6, 7]
    assert all(r.error and r.error.code == "undecodable_job" and "job format '2', newer than this worker's (1)"
               in r.error.message for r in failed), failed[0].error


def test_cancel_ends_a_batch_whose_jobs_no_worker_holds(tmp_path: Path, client: redis.Redis, prefix: str) -> None:
    """bd9ca4b: cancel of a batch whose jobs had been refused (off every queue, in RQ's failed registry)
    stayed ``cancelling`` for good. A dead worker's expired lease, with no worker left to reap it, too."""
    f = write_jsonl(tmp_path / "p.jsonl", _rows(9))
    batch = _submit(client, prefix, f, batch_size=3)
    k = Keys(prefix)
    q = rq_queue_key(queue_names(MODEL, prefix)[1])
    jq = JobQueue(client, keys=k)
    refused = jq.claim_many(queue_names(MODEL, prefix), model=MODEL, worker="w-old", lease_s=30, n=1)[0]
    jq.finish(refused, worker="w-old", failed="refused")  # off the queue, no lease: what a refusal leaves
    dead = jq.claim_many(queue_names(MODEL, prefix), model=MODEL, worker="w-dead", lease_s=30, n=1)[0]
    client.zadd(k.leases(), {dead.job_id: 1})  # its worker died long ago: the lease ran out, nobody reaped it
    assert client.llen(q) == 1
    b = _ledger(client, prefix).cancel(batch.id)
    assert b.status is BatchStatus.cancelled and b.request_counts.cancelled == 9, b.request_counts
    assert client.llen(q) == 0


def test_cancel_leaves_a_live_workers_job_to_it(tmp_path: Path, client: redis.Redis, prefix: str) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", _rows(6))
    batch = _submit(client, prefix, f, batch_size=3)
    jq = JobQueue(client, keys=Keys(prefix))
    jq.claim_many(queue_names(MODEL, prefix), model=MODEL, worker="w-live", lease_s=300, n=1)
    b = _ledger(client, prefix).cancel(batch.id)
    assert b.status is BatchStatus.cancelling and b.request_counts.cancelled == 3  # the live one answers its own


def test_retry_gets_a_stuck_batch_out(tmp_path: Path, redis_url: str, client: redis.Redis, prefix: str) -> None:
    """bd9ca4b: retry refused an in-progress batch, which could never end: no way out."""
    f = write_jsonl(tmp_path / "p.jsonl", _rows(6))
    batch = _submit(client, prefix, f, batch_size=3)
    jq = JobQueue(client, keys=Keys(prefix))
    c = jq.claim_many(queue_names(MODEL, prefix), model=MODEL, worker="w-old", lease_s=30, n=1)[0]
    jq.finish(c, worker="w-old", failed="refused by an older worker")  # refused, never answered
    _worker(client, redis_url, prefix)  # answers the other job: 3 of 6, and the batch never ends
    assert _ledger(client, prefix).get(batch.id).status is BatchStatus.in_progress
    again, created = retry_batch(client, Keys(prefix), batch.id, ttl_s=3600)
    assert created and again.request_counts.total == 3 and again.metadata["retry_of"] == batch.id
    assert _ledger(client, prefix).get(batch.id).status is BatchStatus.cancelled  # the stuck one ended
    _worker(client, redis_url, prefix)
    assert sorted(r.custom_id for r in results_of(client, prefix, again.id)) == ["r0", "r1", "r2"]


def test_retry_still_refuses_a_batch_with_work_in_flight(tmp_path: Path, client: redis.Redis, prefix: str) -> None:
    import pytest

    from lmdq.errors import RetryRejected

    f = write_jsonl(tmp_path / "p.jsonl", _rows(3))
    batch = _submit(client, prefix, f, batch_size=3)
    with pytest.raises(RetryRejected, match="cancel it first: 1 job.s. queued or running"):
        retry_batch(client, Keys(prefix), batch.id, ttl_s=3600)


def test_purge_force_leaves_no_key_without_a_ttl(tmp_path: Path, client: redis.Redis, prefix: str) -> None:
    """bd9ca4b: ``purge --force`` of a running batch left the held jobs' ``rq:job`` keys with no TTL: the
    worker's RQ bookkeeping (started, then ended) wrote them back after the purge."""
    f = write_jsonl(tmp_path / "p.jsonl", _rows(8))
    batch = _submit(client, prefix, f, batch_size=2)
    k = Keys(prefix)
    jq = JobQueue(client, keys=k, job_ttl_s=3600)
    held = jq.claim_many(queue_names(MODEL, prefix), model=MODEL, worker="w", lease_s=30, n=2)
    for c in held:
        c.job = jq.fetch_job(c.job_id)
        jq.begin(c, batch_id=batch.id, indices=[0, 1], worker="w", ttl_s=60)
    _ledger(client, prefix).purge(batch.id, force=True)
    started_after = jq.claim_many(queue_names(MODEL, prefix), model=MODEL, worker="w", lease_s=30, n=1)
    assert not started_after  # its queued jobs went with it
    jq.finish(held[0], worker="w")
    jq.finish(held[1], worker="w", failed="aborted: batch purged")
    jq.record_requeued([held[0].job_id])
    no_ttl = [key for key in client.scan_iter("*") if batch.id.encode() in key and client.ttl(key) == -1]
    assert no_ttl == []


def test_retry_key_reused_for_another_batch_is_refused(tmp_path: Path, redis_url: str, client: redis.Redis,
                                                       prefix: str) -> None:
    import pytest

    from lmdq.errors import IdempotencyConflict

    rows = [{"custom_id": f"r{i}", "prompt": f"q {i} [[sim:error]]" if i == 1 else f"q {i}"} for i in range(3)]
    a = _submit(client, prefix, write_jsonl(tmp_path / "a.jsonl", rows), batch_size=3)
    b = _submit(client, prefix, write_jsonl(tmp_path / "b.jsonl", rows), batch_size=3)
    _worker(client, redis_url, prefix)
    first, created = retry_batch(client, Keys(prefix), a.id, ttl_s=3600, idempotency_key="redo")
    again, created_again = retry_batch(client, Keys(prefix), a.id, ttl_s=3600, idempotency_key="redo")
    assert created and not created_again and again.id == first.id
    with pytest.raises(IdempotencyConflict, match=f"bound to batch {first.id}"):
        retry_batch(client, Keys(prefix), b.id, ttl_s=3600, idempotency_key="redo")
    with pytest.raises(IdempotencyConflict):
        retry_batch(client, Keys(prefix), a.id, ttl_s=3600, idempotency_key="redo", include_cancelled=True)
