"""The batch ledger against a real redis-server: exactly which keys each step writes, and that
rollback, cancel and idempotency leave Redis as the rules say."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from lmdq.batches.records import RUNNING_TTL_S
from lmdq.contract import Batch, BatchStatus, Priority, RequestCounts, ResultStatus
from lmdq.errors import BatchNotFound, RedisRefused, RetryRejected, SubmitRejected
from lmdq.jobs.queue import job_id_for
from lmdq.redis.keys import MODEL_COUNT_PREFIX, BatchField, Keys, model_count_field, queue_name, rq_queue_key
from lmdq.submission.ledger import BatchLedger, Staged, new_batch_id
from tests.conftest import RedisServer, free_port

TTL = 3600


def _keys(client: redis.Redis) -> set[str]:
    return {k.decode() for k in client.keys("*")}


def _batch(n: int, *, batch_size: int = 4, idem: str | None = None, model: str = "sim") -> Batch:
    return Batch(id=new_batch_id(), model=model, status=BatchStatus.validating, priority=Priority.normal,
                 batch_size=batch_size, num_jobs=(n + batch_size - 1) // batch_size,
                 request_counts=RequestCounts(total=n), idempotency_key=idem, created_at=time.time())


def _requests(n: int) -> list[dict[str, Any]]:
    return [{"index": i, "custom_id": f"c{i}", "endpoint": "chat", "prompt": f"p{i}"} for i in range(n)]


def _ledger(client: redis.Redis, prefix: str) -> BatchLedger:
    return BatchLedger(client, keys=Keys(prefix), ttl_s=TTL)


def test_create_stage_commit_write_exactly_the_batch_keys(client: redis.Redis, prefix: str) -> None:
    ledger, k = _ledger(client, prefix), Keys(prefix)
    b = _batch(10, idem="nightly")
    qkey = rq_queue_key(queue_name("sim", "normal", prefix))
    before = _keys(client)

    assert ledger.bind_key("nightly", b.id) is None
    ledger.create(b)
    assert _keys(client) - before == {k.idempotency("nightly"), k.batch(b.id), k.batches()}
    jobs = {f"rq:job:{job_id_for(b.id, n)}" for n in range(3)}

    staged = ledger.stage(b, _requests(10))
    assert staged == Staged(jobs=3, requests=10)
    assert _keys(client) - before == {k.idempotency("nightly"), k.batch(b.id), k.batches(), k.batch_jobs(b.id), *jobs}
    assert client.llen(qkey) == 0  # staged jobs are invisible
    assert ledger.get(b.id).status is BatchStatus.validating and not ledger.committed(b.id)

    assert ledger.commit(b, staged) == 3
    assert _keys(client) - before - {"rq:queues"} == {
        k.idempotency("nightly"), k.batch(b.id), k.batches(), k.batch_jobs(b.id), qkey, *jobs,
        k.wake("sim"),  # the model's wake-up token (one per model, not per batch: lmdq.jobs.wakeup)
    }
    assert client.lrange(qkey, 0, -1) == [job_id_for(b.id, n).encode() for n in range(3)]
    assert client.sismember("rq:queues", qkey)
    got = ledger.get(b.id)
    assert got.status is BatchStatus.queued and got.queued_at is not None and ledger.committed(b.id)
    for key in (k.batch(b.id), k.batch_jobs(b.id), k.idempotency("nightly"), *jobs):
        # running: the keys are bounded but not on the retention clock yet (that starts at the batch's end)
        assert TTL < client.ttl(key) <= RUNNING_TTL_S, key


def test_commit_is_fenced_so_a_resent_commit_never_pushes_twice(client: redis.Redis, prefix: str) -> None:
    ledger = _ledger(client, prefix)
    b = _batch(8)
    ledger.create(b)
    staged = ledger.stage(b, _requests(8))
    assert ledger.commit(b, staged) == 2
    assert ledger.commit(b, staged) == 0
    assert client.llen(rq_queue_key(queue_name("sim", "normal", prefix))) == 2


def test_commit_refuses_a_batch_whose_staged_requests_do_not_add_up(client: redis.Redis, prefix: str) -> None:
    ledger = _ledger(client, prefix)
    b = _batch(10)
    ledger.create(b)
    staged = ledger.stage(b, _requests(7))  # the source ended early (a truncated file)
    with pytest.raises(SubmitRejected, match="staged 7 requests in 2 jobs, its record counts 10 in 3"):
        ledger.commit(b, staged)
    assert client.llen(rq_queue_key(queue_name("sim", "normal", prefix))) == 0
    assert ledger.get(b.id).status is BatchStatus.validating


def test_stage_stops_at_the_recorded_total(client: redis.Redis, prefix: str) -> None:
    ledger = _ledger(client, prefix)
    b = _batch(4, batch_size=2)
    ledger.create(b)
    pulled = []

    def source() -> Iterator[dict[str, Any]]:
        for r in _requests(100):
            pulled.append(r["index"])
            yield r

    with pytest.raises(SubmitRejected, match="more requests than the 4"):
        ledger.stage(b, source())
    assert len(pulled) <= 6  # stopped at once, not after reading the whole source


def test_rollback_removes_everything_including_unlisted_job_hashes(client: redis.Redis, prefix: str) -> None:
    ledger, k = _ledger(client, prefix), Keys(prefix)
    before = _keys(client)
    b = _batch(12, idem="k1")
    assert ledger.bind_key("k1", b.id) is None
    ledger.create(b)
    ledger.stage(b, _requests(12))
    client.ltrim(k.batch_jobs(b.id), 0, 0)  # as if a pipeline was cut before the list pushes landed
    assert client.exists(f"rq:job:{job_id_for(b.id, 2)}")
    ledger.rollback(b)
    assert not _keys(client) - before  # nothing left (other tests' TTL'd keys may expire meanwhile)
    assert client.zscore(k.batches(), b.id) is None
    with pytest.raises(BatchNotFound):
        ledger.get(b.id)


def test_rollback_leaves_a_committed_batch_and_another_batchs_key_alone(client: redis.Redis, prefix: str) -> None:
    ledger, k = _ledger(client, prefix), Keys(prefix)
    b = _batch(4, idem="shared")
    ledger.create(b)
    ledger.commit(b, ledger.stage(b, _requests(4)))
    client.set(k.idempotency("shared"), "batch_someoneelse")
    ledger.rollback(b)  # committed: workers may hold its jobs
    assert ledger.get(b.id).status is BatchStatus.queued
    c = _batch(4, idem="shared")
    ledger.create(c)
    ledger.rollback(c)
    assert client.get(k.idempotency("shared")) == b"batch_someoneelse"  # bound to another batch: kept


def test_enqueue_rolls_back_when_the_source_fails_midway(client: redis.Redis, prefix: str) -> None:
    ledger = _ledger(client, prefix)
    before = _keys(client)
    b = _batch(40, idem="midway")
    assert ledger.bind_key("midway", b.id) is None

    def source() -> Iterator[dict[str, Any]]:
        yield from _requests(30)
        raise SubmitRejected("the source broke")

    with pytest.raises(SubmitRejected, match="the source broke"):
        ledger.enqueue(b, source(), chunk_jobs=2)  # several chunks really reached Redis first
    assert not _keys(client) - before  # nothing left (other tests' TTL'd keys may expire meanwhile)


def test_enqueue_all_or_nothing_success(client: redis.Redis, prefix: str) -> None:
    ledger = _ledger(client, prefix)
    seen: list[int] = []
    got = ledger.enqueue(_batch(9, batch_size=2), _requests(9), progress=seen.append, chunk_jobs=2)
    assert got.status is BatchStatus.queued and got.num_jobs == 5
    assert seen == [2, 4, 5]
    assert client.llen(rq_queue_key(queue_name("sim", "normal", prefix))) == 5


def test_idempotency_binding(client: redis.Redis, prefix: str) -> None:
    ledger = _ledger(client, prefix)
    assert ledger.bound_batch("once") is None
    assert ledger.bind_key("once", "batch_a") is None
    assert ledger.bind_key("once", "batch_b") == "batch_a"  # SET NX: the first binding wins
    ledger.release_key("once", "batch_b")  # not bound to batch_b: nothing happens
    assert ledger.bind_key("once", "batch_c") == "batch_a"
    ledger.release_key("once", "batch_a")
    assert ledger.bind_key("once", "batch_d") is None
    b = _batch(2, idem="nightly")
    assert ledger.bind_key("nightly", b.id) is None
    ledger.enqueue(b, _requests(2))
    bound = ledger.bound_batch("nightly")
    assert bound is not None and bound.id == b.id and bound.status is BatchStatus.queued


def test_known_models(client: redis.Redis, prefix: str) -> None:
    ledger = _ledger(client, prefix)
    assert ledger.known_models() == set()
    client.hset(Keys(prefix).models(), mapping={"llama-8b": 1, b"\xffbad": 2})
    assert ledger.known_models(("configured",)) == {"llama-8b", "\ufffdbad", "configured"}


def test_cancel_takes_queued_jobs_off_and_writes_cancelled_results(client: redis.Redis, prefix: str) -> None:
    ledger, k = _ledger(client, prefix), Keys(prefix)
    other = ledger.enqueue(_batch(3), _requests(3))
    b = ledger.enqueue(_batch(10), _requests(10))
    qkey = rq_queue_key(queue_name("sim", "normal", prefix))
    got = ledger.cancel(b.id)
    assert got.status is BatchStatus.cancelled and got.cancelled_at is not None and got.cancelling_at is not None
    assert got.request_counts.cancelled == 10 and got.request_counts.done == 10
    assert client.sismember(k.cancelled(), b.id)
    assert client.lrange(qkey, 0, -1) == [job_id_for(other.id, 0).encode()]  # other batches untouched
    assert client.hget(f"rq:job:{job_id_for(b.id, 0)}", "status") == b"canceled"
    assert ledger.cancel(b.id).status is BatchStatus.cancelled  # terminal: a no-op
    assert ledger.indices_with(got, {ResultStatus.cancelled}) == list(range(10))
    assert ledger.indices_with(got, {ResultStatus.failed}) == []


def test_cancel_refuses_a_forged_job_without_miscounting(client: redis.Redis, prefix: str) -> None:
    """A job pushed with the batch's id prefix but another batch's payload is refused, not counted."""
    ledger = _ledger(client, prefix)
    victim = _batch(4)
    b = ledger.enqueue(victim, _requests(4))
    forger = _batch(4)
    ledger.create(forger)
    ledger.stage(forger, _requests(4))
    forged_id = f"{b.id}-999999"
    client.copy(f"rq:job:{job_id_for(forger.id, 0)}", f"rq:job:{forged_id}")
    client.rpush(rq_queue_key(queue_name("sim", "normal", prefix)), forged_id, f"{b.id}-888888")  # 2nd: no hash
    got = ledger.cancel(b.id)
    assert got.request_counts.cancelled == 4 and got.status is BatchStatus.cancelled
    assert client.hget(f"rq:job:{forged_id}", "status") == b"failed"


def test_source_requests_read_back_from_job_payloads(client: redis.Redis, prefix: str) -> None:
    ledger = _ledger(client, prefix)
    b = ledger.enqueue(_batch(10, batch_size=3), _requests(10))
    got = list(ledger.source_requests(b, [1, 4, 9]))
    assert [(r.index, r.custom_id, r.prompt) for r in got] == [(1, "c1", "p1"), (4, "c4", "p4"), (9, "c9", "p9")]


def test_source_requests_read_jobs_within_the_job_size_cap(client: redis.Redis, prefix: str) -> None:
    """Retry reads its source jobs like a worker does: within LMDQ_MAX_JOB_BYTES, never RQ's unbounded
    fetch (a job hash is untrusted input); a job over the cap is a clear RetryRejected, not a decompression."""
    b = _ledger(client, prefix).enqueue(_batch(10, batch_size=5), _requests(10))
    small = BatchLedger(client, keys=Keys(prefix), ttl_s=TTL, max_job_bytes=64)
    with pytest.raises(RetryRejected, match=r"not a readable lmdq job: .*LMDQ_MAX_JOB_BYTES"):
        list(small.source_requests(b, [1]))
    assert [r.index for r in _ledger(client, prefix).source_requests(b, [1, 7])] == [1, 7]


def test_batch_fields_are_the_batch_hash(client: redis.Redis, prefix: str) -> None:
    """Every field of a stored batch hash is a declared BatchField (and the declared set is complete)."""
    ledger = _ledger(client, prefix)
    b = ledger.enqueue(_batch(2, batch_size=1), _requests(2))
    ledger.cancel(b.id)
    stored = {f.decode() for f in client.hkeys(Keys(prefix).batch(b.id))}
    declared = {f.value for f in BatchField}
    # the per-model result counters (#24) are the one family of fields built from a name: each is
    # model_count_field(<a model of the batch>, <a RequestCounts counter>), nothing else
    per_model = {f for f in stored if f.startswith(MODEL_COUNT_PREFIX)}
    counters = set(RequestCounts.model_fields)
    assert per_model <= {model_count_field(b.model, c) for c in counters}, per_model
    assert stored - per_model <= declared
    assert {"meta", "status", "total", "queued_at", "cancelling_at", "cancelled_at"} <= stored


# ---- refused writes (a real server out of memory / a real read-only replica) -----------------------


@pytest.fixture()
def tight_redis() -> Iterator[redis.Redis]:
    """A server with ~256 KB of room above what it uses now, refusing writes past it (noeviction)."""
    srv = RedisServer().start()
    try:
        c = redis.Redis.from_url(srv.url)
        c.config_set("maxmemory-policy", "noeviction")
        c.config_set("maxmemory", int(c.info("memory")["used_memory"]) + 256 * 1024)
        yield c
    finally:
        srv.cleanup()


def test_out_of_memory_midway_rolls_back_and_says_so(tight_redis: redis.Redis) -> None:
    import os

    ledger = BatchLedger(tight_redis, keys=Keys("oom"), ttl_s=TTL)
    before = _keys(tight_redis)
    b = _batch(2000, batch_size=2, idem="oom-key")
    assert ledger.bind_key("oom-key", b.id) is None
    reqs = [{**r, "prompt": os.urandom(400).hex()} for r in _requests(2000)]  # incompressible: ~800 KB
    staged: list[int] = []
    with pytest.raises(RedisRefused, match=r"out of memory \(maxmemory\)") as e:
        ledger.enqueue(b, reqs, progress=staged.append, chunk_jobs=8)
    assert staged, "the refusal came mid-staging, after some jobs reached Redis"
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)
    assert _keys(tight_redis) == before - {Keys("oom").idempotency("oom-key")}  # key released too


def test_read_only_replica_is_one_refusal() -> None:
    srv = RedisServer().start()
    try:
        c = redis.Redis.from_url(srv.url)
        c.replicaof("127.0.0.1", free_port())  # a replica (of a primary that is not there): read-only
        ledger = BatchLedger(c, keys=Keys("ro"), ttl_s=TTL)
        with pytest.raises(RedisRefused, match=f"127.0.0.1:{srv.port} is a read-only replica"):
            ledger.enqueue(_batch(2), _requests(2))
        with pytest.raises(RedisRefused, match="read-only replica"):
            ledger.bind_key("k", "batch_x")
        assert c.dbsize() == 0
    finally:
        srv.cleanup()


def test_cancel_refused_midway_leaves_the_jobs_queued_then_finishes() -> None:
    """Out of memory while writing the cancelled results: the jobs stay on the queue (a worker, or the
    next cancel, finishes them); taking them off first would lose those requests for good."""
    srv = RedisServer().start()
    try:
        c = redis.Redis.from_url(srv.url)
        ledger = BatchLedger(c, keys=Keys("cx"), ttl_s=TTL)
        b = ledger.enqueue(_batch(3000, batch_size=10), _requests(3000))
        qkey = rq_queue_key(queue_name("sim", "normal", "cx"))
        c.config_set("maxmemory-policy", "noeviction")
        c.config_set("maxmemory", int(c.info("memory")["used_memory"]) + 64 * 1024)  # ~3000 results won't fit
        with pytest.raises(RedisRefused, match="out of memory .* the cancel did not finish; run it again"):
            ledger.cancel(b.id)
        assert c.llen(qkey) == 300  # every job still queued
        partly = ledger.get(b.id)
        assert partly.status is BatchStatus.cancelling and 0 < partly.request_counts.cancelled < 3000
        c.config_set("maxmemory", 0)
        done = ledger.cancel(b.id)
        assert done.status is BatchStatus.cancelled and done.request_counts.cancelled == 3000
        assert c.llen(qkey) == 0
    finally:
        srv.cleanup()


def test_refusal_wording_is_matched_however_it_arrives(client: redis.Redis) -> None:
    """redis-py raises OOM/READONLY as their own classes for plain commands but as a plain ResponseError
    from inside a script or pipeline; MISCONF (a failed snapshot) has no class at all."""
    from lmdq.submission.ledger import redis_refusal

    misconf = redis.ResponseError("Command # 1 (HSET x) of pipeline caused error: MISCONF Redis is configured to "
                                  "save RDB snapshots, but it's currently unable to persist to disk.")
    got = redis_refusal(misconf, client)
    assert got is not None and "cannot save its snapshot (MISCONF); nothing was enqueued" in str(got)
    in_script = redis.ResponseError("Error running script (call to f_1): @user_script:2: -READONLY You can't write "
                                    "against a read only replica.")
    assert "is a read-only replica" in str(redis_refusal(in_script, client))
    assert redis_refusal(redis.ResponseError("WRONGTYPE Operation against a key"), client) is None
    assert redis_refusal(redis.ConnectionError("gone"), client) is None


def test_a_commit_whose_reply_was_lost_is_kept_not_rolled_back(client: redis.Redis, prefix: str) -> None:
    """The connection drops after the commit ran on the server: the batch is live (a worker may hold its
    jobs), so enqueue reports it queued instead of deleting it under the worker."""
    ledger = _ledger(client, prefix)
    real = ledger._commit

    def commit_then_lose_reply(**kw: Any) -> Any:
        real(**kw)
        raise redis.ConnectionError("connection reset after the command ran")

    ledger._commit = commit_then_lose_reply  # type: ignore[assignment]
    got = ledger.enqueue(_batch(6, batch_size=3), _requests(6))
    assert got.status is BatchStatus.queued and ledger.committed(got.id)
    assert client.llen(rq_queue_key(queue_name("sim", "normal", prefix))) == 2
    assert client.exists(f"rq:job:{job_id_for(got.id, 1)}")
