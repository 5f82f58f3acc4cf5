"""lmdq.batches.batch_jobs: a batch's jobs staged, committed, rolled back and read back, on a real redis-server.

Job hashes are written here by hand (tests may speak Redis): this module is the data access under the
ledger, so its tests do not go through the ledger's rules (tests/test_ledger.py does)."""

from __future__ import annotations

import redis

from lmdq.batches.batch_jobs import RQ_QUEUES, BatchJobs
from lmdq.redis.keys import BatchField, Keys, rq_queue_key

F = BatchField


def _jobs(client: redis.Redis, prefix: str) -> tuple[BatchJobs, Keys]:
    keys = Keys(prefix)
    return BatchJobs(client, keys=keys), keys


def _stage(client: redis.Redis, keys: Keys, batch_id: str, n: int, *, origin: str = "", status: str = "validating"
           ) -> list[str]:
    """``n`` job hashes and the job list, as a submit stages them (the record's status too)."""
    ids = [f"{batch_id}-{i}" for i in range(n)]
    client.hset(keys.batch(batch_id), mapping={F.status.value: status})
    for j in ids:
        client.hset(f"rq:job:{j}", mapping={"status": "queued", "origin": origin or "unused"})
    if ids:
        client.rpush(keys.batch_jobs(batch_id), *ids)
    return ids


def test_writes_are_sent_by_flush_only(client: redis.Redis, prefix: str) -> None:
    b1 = f"b{prefix}1"  # job hashes (rq:job:<id>) are not under the prefix
    bj, keys = _jobs(client, prefix)
    with bj.writes() as w:
        w.pipe.rpush(keys.batch_jobs(b1), "b1-0")
        assert client.llen(keys.batch_jobs(b1)) == 0  # queued on the pipeline, not sent
        w.flush()
        assert bj.job_ids(b1) == ["b1-0"]
        w.pipe.rpush(keys.batch_jobs(b1), "b1-1")
    assert bj.job_ids(b1) == ["b1-0"]  # the block ended before a flush: what was left is dropped


def test_commit_pushes_every_job_once_and_wakes_the_models(client: redis.Redis, prefix: str) -> None:
    b1 = f"b{prefix}1"  # job hashes (rq:job:<id>) are not under the prefix
    bj, keys = _jobs(client, prefix)
    ids = _stage(client, keys, b1, 5)
    q = rq_queue_key(f"{prefix}:m:normal")
    wake = keys.wake("m")
    assert bj.commit(batch_id=b1, queue_key=q, wakes=[wake], now=7.0, ttl_s=900) == 5
    assert [x.decode() for x in client.lrange(q, 0, -1)] == ids
    assert client.hget(keys.batch(b1), F.status.value) == b"queued"
    assert client.hget(keys.batch(b1), F.queued_at.value) == b"7.0"
    assert client.sismember(RQ_QUEUES, q) and client.llen(wake) == 1
    assert 890 <= client.ttl(f"rq:job:{ids[0]}") <= 900 and 890 <= client.ttl(keys.batch_jobs(b1)) <= 900
    assert bj.commit(batch_id=b1, queue_key=q, wakes=[wake], now=8.0, ttl_s=900) == -1  # fenced: a re-sent call
    assert client.llen(q) == 5


def test_commit_without_a_queue_key_uses_each_jobs_origin(client: redis.Redis, prefix: str) -> None:
    b1 = f"b{prefix}1"  # job hashes (rq:job:<id>) are not under the prefix
    bj, keys = _jobs(client, prefix)
    origin = f"{prefix}:other:high"
    _stage(client, keys, b1, 2, origin=origin)
    assert bj.commit(batch_id=b1, queue_key="", wakes=[], now=1.0, ttl_s=60) == 2
    assert client.llen(rq_queue_key(origin)) == 2


def test_commit_upto_makes_jobs_visible_in_steps_and_stops_once_cancelled(client: redis.Redis, prefix: str) -> None:
    b1 = f"b{prefix}1"  # job hashes (rq:job:<id>) are not under the prefix
    bj, keys = _jobs(client, prefix)
    ids = _stage(client, keys, b1, 4)
    q = rq_queue_key(f"{prefix}:m:normal")
    kw = {"batch_id": b1, "queue_key": q, "wakes": [], "now": 2.0, "ttl_s": 60}
    assert bj.commit_upto(jobs=1, requests=3, last=False, **kw) == 1
    assert bj.commit_upto(jobs=1, requests=3, last=False, **kw) == -1
    assert client.hmget(keys.batch(b1), [F.visible_jobs.value, F.visible_requests.value, F.staged_at.value]) == [
        b"1", b"3", None]
    assert bj.commit_upto(jobs=3, requests=9, last=False, **kw) == 2
    assert [x.decode() for x in client.lrange(q, 0, -1)] == ids[:3]
    client.hset(keys.batch(b1), F.status.value, "cancelling")
    assert bj.commit_upto(jobs=4, requests=12, last=True, **kw) == -2
    assert client.llen(q) == 3


def test_job_ids_from_a_position(client: redis.Redis, prefix: str) -> None:
    b1 = f"b{prefix}1"  # job hashes (rq:job:<id>) are not under the prefix
    bj, keys = _jobs(client, prefix)
    ids = _stage(client, keys, b1, 3)
    assert bj.job_ids(b1) == ids and bj.job_ids(b1, start=2) == ids[2:] and bj.job_ids("none") == []


def test_staged_reads_and_unstage_deletes_what_exists(client: redis.Redis, prefix: str) -> None:
    b1 = f"b{prefix}1"  # job hashes (rq:job:<id>) are not under the prefix
    b2 = f"b{prefix}2"
    bj, keys = _jobs(client, prefix)
    ids = _stage(client, keys, b1, 2)
    client.zadd(keys.batches(), {b1: 1.0, b2: 2.0})
    candidates = [f"rq:job:{j}" for j in [*ids, f"{b1}-9"]] + [keys.batch_jobs(b1), keys.batch(b1)]
    present, listed = bj.staged(b1, candidates)
    assert present == [f"rq:job:{ids[0]}", f"rq:job:{ids[1]}", keys.batch_jobs(b1), keys.batch(b1)] and listed
    bj.unstage(b1, present)
    assert bj.staged(b1, candidates) == ([], False)
    assert client.zrange(keys.batches(), 0, -1) == [b2.encode()]  # another batch's entry stays


def test_drop_unqueued_keeps_the_visible_part(client: redis.Redis, prefix: str) -> None:
    b1 = f"b{prefix}1"  # job hashes (rq:job:<id>) are not under the prefix
    bj, keys = _jobs(client, prefix)
    ids = _stage(client, keys, b1, 4)
    bj.drop_unqueued(b1, ids[1:], keep=1)
    assert bj.job_ids(b1) == ids[:1]
    assert client.exists(f"rq:job:{ids[0]}") and not any(client.exists(f"rq:job:{j}") for j in ids[1:])


def test_queued_finds_and_dequeue_takes_only_the_batchs_ids(client: redis.Redis, prefix: str) -> None:
    bj, _ = _jobs(client, prefix)
    q = rq_queue_key(f"{prefix}:m:normal")
    client.rpush(q, "b1-0", "b2-0", "b1-1", "b10-0")
    assert bj.queued(q, "b1-") == ["b1-0", "b1-1"]
    assert client.llen(q) == 4  # read only
    assert bj.dequeue(q, "b1-") == ["b1-0", "b1-1"]
    assert [x.decode() for x in client.lrange(q, 0, -1)] == ["b2-0", "b10-0"]
    assert bj.dequeue(q, "b1-") == [] and bj.queued(q, "b3-") == []


def test_mark_canceled_sets_rqs_status(client: redis.Redis, prefix: str) -> None:
    b1 = f"b{prefix}1"  # job hashes (rq:job:<id>) are not under the prefix
    bj, keys = _jobs(client, prefix)
    (jid,) = _stage(client, keys, b1, 1)
    bj.mark_canceled(jid)
    assert client.hget(f"rq:job:{jid}", "status") == b"canceled"


def test_leases_and_fields_read_deadlines_and_job_fields(client: redis.Redis, prefix: str) -> None:
    b1 = f"b{prefix}1"  # job hashes (rq:job:<id>) are not under the prefix
    bj, keys = _jobs(client, prefix)
    ids = _stage(client, keys, b1, 3)
    client.hset(f"rq:job:{ids[0]}", "lmdq_requests", "[[0, \"a\"]]")
    client.zadd(keys.leases(), {ids[0]: 100.5, ids[2]: 50.0})
    assert bj.lease_deadlines(ids) == [100.5, None, 50.0]
    assert bj.lease_deadlines([]) == []
    many = [f"x-{n}" for n in range(1200)] + [ids[0]]  # more than one ZMSCORE round trip
    assert bj.lease_deadlines(many)[-1] == 100.5 and len(bj.lease_deadlines(many)) == 1201
    got = bj.leases_and_fields(ids, ["lmdq_requests", "origin", "absent"])
    assert got == [(100.5, [b'[[0, "a"]]', b"unused", None]), (None, [None, b"unused", None]),
                   (50.0, [None, b"unused", None])]
    assert bj.leases_and_fields([], ["origin"]) == []
