"""lmdq.jobs.idle_roster: who else is idle (real redis-server). The roster is read by the claim script's fair
share through the IDLE_PEERS fragment (tests/test_fair_share.py runs that end to end); here the fragment is
run alone, in a script of the test's own, so its rules are checked without a claim around them."""

from __future__ import annotations

import redis

from lmdq.jobs.idle_roster import IDLE_PEERS, IdleRoster
from lmdq.redis.keys import Keys

#: KEYS: roster.  ARGV: member.  What the claim script reads: the OTHER idle workers, on the server's clock
#: (sent with EVAL, not registered as a LuaScript: the registry holds the stores' scripts only)
_PEERS = "".join(f.source for f in IDLE_PEERS.closure()) + "\nreturn lmdq_idle_peers(KEYS[1], ARGV[1])\n"


def _roster(client: redis.Redis, prefix: str, name: str, ttl_s: float = 60.0) -> IdleRoster:
    return IdleRoster(client, keys=Keys(prefix), model="m", name=name, ttl_s=ttl_s)


def _peers(client: redis.Redis, roster: IdleRoster, member: str) -> int:
    return int(client.eval(_PEERS, 1, roster.key, member))


def test_peers_count_others_not_self(client: redis.Redis, prefix: str) -> None:
    a, b, c = (_roster(client, prefix, n) for n in "abc")
    assert _peers(client, a, "a") == 0
    a.enter(0.0)
    b.enter(0.0)
    assert _peers(client, a, "a") == 1  # a does not count itself
    assert _peers(client, c, "c") == 2
    b.leave()
    assert _peers(client, c, "c") == 1
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
    client.zadd(a.key, {"live": t[0] + 60})
    assert _peers(client, b, "b") == 1  # "live" only
    client.zadd(a.key, {"b": t[0] - 5})  # b's own expired entry is not subtracted twice
    assert _peers(client, b, "b") == 1


def test_ttl_has_a_floor_and_leave_without_enter_is_a_no_op(client: redis.Redis, prefix: str) -> None:
    a = _roster(client, prefix, "a", ttl_s=0.0)
    assert a.ttl_s == 1.0
    client.zadd(a.key, {"a": 1e12})
    a.leave()  # never entered through this object: nothing is removed
    assert client.zscore(a.key, "a") == 1e12
