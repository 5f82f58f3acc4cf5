"""lmdq.jobs.leases: claim, renewal, release, reap, move and the lease clock, on a real redis-server."""

from __future__ import annotations

import redis

from lmdq.jobs.leases import JobLeases
from lmdq.redis.keys import Keys, queue_name, rq_queue_key


def _setup(client: redis.Redis, prefix: str) -> tuple[JobLeases, list[str]]:
    qs = [queue_name("m", p, prefix) for p in ("high", "normal", "low")]
    client.rpush(rq_queue_key(qs[1]), "j1", "j2")
    client.rpush(rq_queue_key(qs[0]), "urgent")
    return JobLeases(client, keys=Keys(prefix)), qs


def test_claim_pops_in_priority_order_and_leases_in_one_call(client: redis.Redis, prefix: str) -> None:
    leases, qs = _setup(client, prefix)
    assert leases.waiting(qs) == 3
    share, raw = leases.claim(qs, model="m", worker="w1", lease_s=30, n=2)  # no roster: the share is n
    assert share == 2 and len(raw) == 12 and raw[0::6] == [b"urgent", b"j1"]
    assert raw[1] == rq_queue_key(qs[0]).encode() and int(raw[2]) == 1  # first run
    k = Keys(prefix)
    assert client.zscore(k.leases(), "j1") is not None
    assert client.lrange(k.inflight("m"), 0, -1) == [b"urgent", b"j1"]
    assert leases.waiting(qs) == 1
    assert leases.claim([queue_name("x", "normal", prefix)], model="x", worker="w1", lease_s=30, n=5) == (5, [])


def test_renew_and_drop_are_fenced_on_the_owner(client: redis.Redis, prefix: str) -> None:
    leases, qs = _setup(client, prefix)
    leases.claim(qs, model="m", worker="w1", lease_s=30, n=1)
    assert leases.renew(["urgent"], worker="w1", lease_s=30) == []
    assert leases.renew(["urgent", "nope"], worker="w2", lease_s=30) == [b"urgent", b"nope"]
    assert not leases.drop("urgent", worker="w2", mode="done", charge="", killer="")
    assert leases.drop("urgent", worker="w1", mode="requeue", charge="charge", killer="")
    assert client.lindex(rq_queue_key(qs[0]), 0) == b"urgent"  # back at the front
    assert int(client.hget(Keys(prefix).attempts(), "urgent") or 0) == 1  # the charge counted


def test_reap_requeues_an_expired_lease_and_move_hands_a_job_over(client: redis.Redis, prefix: str) -> None:
    leases, qs = _setup(client, prefix)
    leases.claim(qs, model="m", worker="dead", lease_s=30, n=2)
    client.zadd(Keys(prefix).leases(), {"urgent": 0})  # expired, without waiting for it
    assert leases.reap_expired(10) == [b"urgent", b"dead"]
    assert client.lindex(rq_queue_key(qs[0]), 0) == b"urgent"
    other = queue_name("other", "normal", prefix)
    assert leases.move("j1", worker="dead", queue=other, model="other")
    assert client.lrange(rq_queue_key(other), 0, -1) == [b"j1"]
    assert not leases.move("j1", worker="dead", queue=other, model="other")  # no lease any more


def test_clock_reads_the_server_time_and_the_scripts_offset(client: redis.Redis, prefix: str) -> None:
    leases = JobLeases(client, keys=Keys(prefix))
    sec, usec, last, offset = leases.clock()
    assert int(sec) > 1_600_000_000 and 0 <= int(usec) < 1_000_000 and last is None and offset is None
    client.hset(f"{Keys(prefix).leases()}:clock", mapping={"raw": "5", "offset": "2"})
    assert leases.clock()[2:] == (b"5", b"2")
