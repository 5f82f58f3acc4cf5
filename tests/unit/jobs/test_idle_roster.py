"""lmdq.jobs.idle_roster: who else is idle, and how many jobs are visible (real redis-server)."""

from __future__ import annotations

import redis

from lmdq.jobs.idle_roster import IdleRoster
from lmdq.redis.keys import Keys, rq_queue_key


def _roster(client: redis.Redis, prefix: str, name: str, ttl_s: float = 60.0) -> IdleRoster:
    return IdleRoster(client, keys=Keys(prefix), model="m", name=name, ttl_s=ttl_s)


def test_look_counts_others_not_self_and_visible_jobs(client: redis.Redis, prefix: str) -> None:
    a, b, c = (_roster(client, prefix, n) for n in "abc")
    q1, q2 = f"{prefix}:m:high", f"{prefix}:m:normal"
    client.rpush(rq_queue_key(q1), "j1", "j2")
    client.rpush(rq_queue_key(q2), "j3")
    assert a.look([q1, q2]) == (0, 3)
    a.enter(0.0)
    b.enter(0.0)
    assert a.look([q1, q2]) == (1, 3)  # a does not count itself
    assert c.look([q1]) == (2, 2)
    b.leave()
    assert c.look([]) == (1, 0)
    assert b.entered_at is None


def test_enter_is_rewritten_only_after_a_third_of_the_ttl(client: redis.Redis, prefix: str) -> None:
    a = _roster(client, prefix, "a", ttl_s=30.0)
    a.enter(100.0)
    client.zrem(a.key, "a")  # the entry vanishes (as after a Redis restart)
    a.enter(109.0)  # within ttl/3: no write
    assert client.zscore(a.key, "a") is None
    a.enter(110.0)  # a third of the TTL later: written again
    assert client.zscore(a.key, "a") is not None
    assert 0 < client.ttl(a.key) <= 30


def test_expired_entry_stops_counting(client: redis.Redis, prefix: str) -> None:
    a, b = _roster(client, prefix, "a"), _roster(client, prefix, "b")
    t = client.time()
    client.zadd(a.key, {"dead": t[0] - 5})  # an entry whose expiry (server clock) has passed
    assert b.look([]) == (0, 0)


def test_ttl_has_a_floor_and_leave_without_enter_is_a_no_op(client: redis.Redis, prefix: str) -> None:
    a = _roster(client, prefix, "a", ttl_s=0.0)
    assert a.ttl_s == 1.0
    client.zadd(a.key, {"a": 1e12})
    a.leave()  # never entered through this object: nothing is removed
    assert client.zscore(a.key, "a") == 1e12
