"""Which workers of a model are idle now, so a small batch is shared instead of taken by one.

A worker claims as many jobs as its engine has room for, which on a large batch is what keeps the
GPU busy. On a small one (the issue's 16 prompts in 4 jobs, capacity 32) the first worker woken took
every job while a second idle worker got nothing, so a second GPU did not make it faster. The claim
path therefore asks, in one read-only round trip, how many OTHER workers of the model are idle and
how many jobs are visible, and takes at most its fair share while others are idle
(:func:`lmdq.worker.admission.fair_share`); a large batch's share is larger than any claim, so its
throughput is unchanged.

A worker enters the roster (a sorted set, :meth:`lmdq.redis.keys.Keys.idle`) just before it sleeps with
nothing held, and leaves it as soon as a claim brings it work. Entries carry an expiry on the Redis
server's clock, renewed while the worker stays idle, so a worker killed while idle stops counting
after ``ttl_s`` without anyone cleaning up; until then the others still progress (a share is never
less than one job for a worker that holds none).
"""

from __future__ import annotations

import redis

from lmdq.redis.keys import Keys
from lmdq.redis.scripts import Fragment, LuaScript

__all__ = ["IDLE_PEERS", "IdleRoster"]


class IdleRoster:
    """One worker's view of its model's idle workers (thread-safe: redis-py clients are)."""

    def __init__(self, client: redis.Redis, *, keys: Keys, model: str, name: str, ttl_s: float) -> None:
        self.client = client
        self.key = keys.idle(model)
        self.name = name
        self.ttl_s = max(1.0, ttl_s)
        self._enter = IDLE_ENTER.bind(client)
        #: when (monotonic, this process) the entry was last written; None: not in the roster
        self.entered_at: float | None = None

    def enter(self, now: float) -> None:
        """This worker is idle (about to sleep holding nothing). Written again only once a third of
        its TTL has passed, so a worker that stays idle costs one command per ``ttl_s / 3``."""
        if self.entered_at is not None and now - self.entered_at < self.ttl_s / 3:
            return
        self._enter(keys=[self.key], args=[self.name, self.ttl_s])
        self.entered_at = now

    def leave(self) -> None:
        """This worker has work (or is stopping): it no longer counts as idle."""
        if self.entered_at is None:
            return
        self.entered_at = None
        self.client.zrem(self.key, self.name)


# ==== Lua: this module's scripts (composed and run by lmdq.redis.scripts.LuaScript) ====

# KEYS: roster.  ARGV: worker, ttl.  The key itself expires with its youngest entry's TTL.
IDLE_ENTER = LuaScript("idle_enter", """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2])))
return 1
""")

IDLE_PEERS = Fragment("idle_peers", """
local function lmdq_idle_peers(roster, member)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  local idle = redis.call('ZCOUNT', roster, '(' .. now, '+inf')
  if tonumber(redis.call('ZSCORE', roster, member) or '0') > now then idle = idle - 1 end
  return idle
end
""")
"""Lua: ``lmdq_idle_peers(roster, member)``: the workers in ``roster`` whose entry has not expired on the
server's clock, ``member`` itself not counted. The one reading of the roster: the claim script's fair share
(:data:`lmdq.jobs.leases.CLAIM`) uses it."""
