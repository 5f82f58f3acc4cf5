"""lmdq.batches.records: the batch hash, its listing and the cancelled set, on a real redis-server."""

from __future__ import annotations

import redis

from lmdq.batches.records import BatchHashes, Deleted
from lmdq.contract import BatchStatus
from lmdq.redis.keys import BatchField, Keys

F = BatchField


def _hashes(client: redis.Redis, prefix: str) -> BatchHashes:
    return BatchHashes(client, keys=Keys(prefix))


def test_write_sets_fields_ttl_and_listing_in_one_step(client: redis.Redis, prefix: str) -> None:
    h = _hashes(client, prefix)
    h.write("b1", {F.status.value: "validating", F.total.value: 4, F.ttl.value: 60}, created_at=10.0, ttl_s=500)
    key = Keys(prefix).batch("b1")
    assert client.hgetall(key) == {b"status": b"validating", b"total": b"4", b"ttl": b"60"}
    assert 490 <= client.ttl(key) <= 500
    assert client.zscore(Keys(prefix).batches(), "b1") == 10.0


def test_reads_are_raw_bytes_and_empty_for_a_missing_record(client: redis.Redis, prefix: str) -> None:
    h = _hashes(client, prefix)
    h.write("b1", {F.status.value: "queued", F.total.value: 2}, created_at=1.0, ttl_s=60)
    assert h.read("b1") == {b"status": b"queued", b"total": b"2"}
    assert h.read("nope") == {}
    assert h.read_many(["b1", "nope"]) == [{b"status": b"queued", b"total": b"2"}, {}]
    assert h.fields("b1", [F.total.value, F.queued_at.value, F.status.value]) == [b"2", None, b"queued"]
    assert h.has_field("b1", F.status.value) and not h.has_field("b1", F.queued_at.value)
    assert not h.has_field("nope", F.status.value)


def test_reads_through_a_decoding_client_still_give_bytes(redis_url: str, prefix: str) -> None:
    text = redis.Redis.from_url(redis_url, decode_responses=True)
    h = BatchHashes(text, keys=Keys(prefix))
    h.write("b1", {F.status.value: "queued"}, created_at=1.0, ttl_s=60)
    assert h.read("b1") == {b"status": b"queued"} and h.fields("b1", [F.status.value]) == [b"queued"]
    assert h.newest_ids(5) == ["b1"]


def test_newest_ids_come_newest_first_and_limited(client: redis.Redis, prefix: str) -> None:
    h = _hashes(client, prefix)
    for n, at in (("a", 3.0), ("b", 1.0), ("c", 2.0)):
        h.write(n, {F.status.value: "queued"}, created_at=at, ttl_s=60)
    assert h.newest_ids(2) == ["a", "c"]
    assert h.newest_ids(10) == ["a", "c", "b"]
    client.zadd(Keys(prefix).batches(), {b"\xff\xfe": 9.0})  # untrusted: bad UTF-8 is replaced, not raised
    assert h.newest_ids(1) == ["\ufffd\ufffd"]


def test_transition_moves_only_from_the_listed_statuses(client: redis.Redis, prefix: str) -> None:
    h = _hashes(client, prefix)
    h.write("b1", {F.status.value: BatchStatus.queued.value}, created_at=1.0, ttl_s=600)
    kw = {"now": 123.5, "ttl_s": 30}
    assert h.transition("b1", ["validating"], "cancelling", stamp="", terminal=False, **kw) == "queued"
    assert h.transition("b1", ["validating", "queued"], "cancelling", stamp=F.cancelling_at.value,
                        terminal=False, **kw) == "cancelling"
    assert h.fields("b1", [F.status.value, F.cancelling_at.value]) == [b"cancelling", b"123.5"]
    assert client.ttl(Keys(prefix).batch("b1")) > 30  # not terminal: the key keeps its TTL
    assert h.transition("b1", ["cancelling"], "cancelled", stamp="", terminal=True, **kw) == "cancelled"
    assert client.ttl(Keys(prefix).batch("b1")) <= 30  # the batch ended: its keys take the batch's ttl
    assert h.transition("nope", ["queued"], "cancelled", stamp="", terminal=True, **kw) is None


def test_mark_cancelled_and_delete(client: redis.Redis, prefix: str) -> None:
    k = Keys(prefix)
    h = _hashes(client, prefix)
    h.write("b1", {F.status.value: "completed"}, created_at=1.0, ttl_s=600)
    h.mark_cancelled("b1")
    assert client.sismember(k.cancelled(), "b1")
    job_ids = [f"b{prefix}-{n}" for n in range(2500)]  # job hashes (rq:job:<id>) are not under the prefix
    for j in job_ids[:3]:
        client.hset(f"rq:job:{j}", "status", "finished")
    client.hset(k.results("b1"), "0", "{}")
    q = f"{prefix}:m:normal"  # RQ's registries are rq:finished:<queue> / rq:failed:<queue>
    client.zadd(f"rq:finished:{q}", {job_ids[0]: 1.0, "other-0": 1.0})
    client.zadd(f"rq:failed:{q}", {job_ids[1]: 1.0})
    got = h.delete_batch("b1", own=[k.batch("b1"), k.results("b1"), k.partials("b1")],
                   job_keys=[f"rq:job:{j}" for j in job_ids], queues=[q], job_ids=job_ids, uncancel=True)
    assert got == Deleted(keys=2, jobs=3)  # record + results exist, partials did not; 3 job hashes of 2500 ids
    assert h.read("b1") == {} and h.newest_ids(5) == [] and not client.sismember(k.cancelled(), "b1")
    assert client.zrange(f"rq:finished:{q}", 0, -1) == [b"other-0"] and not client.exists(f"rq:failed:{q}")


def test_delete_keeps_the_cancelled_member_of_a_running_batch(client: redis.Redis, prefix: str) -> None:
    k = Keys(prefix)
    h = _hashes(client, prefix)
    h.write("b1", {F.status.value: "in_progress"}, created_at=1.0, ttl_s=600)
    h.mark_cancelled("b1")
    got = h.delete_batch("b1", own=[k.batch("b1")], job_keys=[], queues=[], job_ids=[], uncancel=False)
    assert got == Deleted(keys=1, jobs=0)
    assert client.sismember(k.cancelled(), "b1")  # workers still holding its jobs must keep seeing it
