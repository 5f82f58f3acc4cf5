"""The store of the sink's retry schedule: jobs whose shard write failed, retried by every worker's
sweeper. A zset (``<batch id>:<job no>`` -> next try, Redis server time) and a hash (member -> the
job's request ranges and tries), one pair per key prefix, fleet-wide.

Why a module of its own: what an entry holds, how it is validated and the backoff are the results'
rules (:mod:`lmdq.results.sink`, :mod:`lmdq.results.worker_sink`); the script calls and their Lua are here,
in the results' store (tests/test_redis_boundary.py). Every change is one
script call (``PENDING_ADD`` / ``PENDING_CLAIM`` / ``PENDING_DROP``), so two sweepers never interleave.
"""

from __future__ import annotations

from typing import Any

import redis

from lmdq.redis.keys import Keys
from lmdq.redis.scripts import Fragment, LuaScript
from lmdq.results.records import OOM_GUARD

__all__ = ["add", "claim_due", "count", "drop"]


def add(client: redis.Redis, keys: Keys, *, member: str, data: str, delay_s: float, batch_id: str,
        job_no: int) -> None:
    """Schedule ``member`` ``delay_s`` from now (replacing an earlier schedule), unless its job is sealed
    by now (the script checks the batch's shard index)."""
    z, h = keys.sink_pending()
    PENDING_ADD(keys=[z, h, keys.shards(batch_id)], args=[member, data, f"{delay_s:.3f}", job_no],
                        client=client)


def claim_due(client: redis.Redis, keys: Keys, *, limit: int, lease_s: float, ahead_s: float) -> list[Any]:
    """Up to ``limit`` entries due within ``ahead_s``, each pushed ``lease_s`` ahead, in one script call:
    the raw flat reply ``[member, data, member, data, ...]`` (untrusted)."""
    z, h = keys.sink_pending()
    return list(PENDING_CLAIM(keys=[z, h], args=[limit, f"{lease_s:.3f}", f"{ahead_s:.3f}"],
                                      client=client))


def drop(client: redis.Redis, keys: Keys, member: str) -> None:
    """Take ``member`` off the schedule (one script call)."""
    z, h = keys.sink_pending()
    PENDING_DROP(keys=[z, h], args=[member], client=client)


def count(client: redis.Redis, keys: Keys) -> int:
    """Entries on the schedule, fleet-wide."""
    return int(client.zcard(keys.sink_pending()[0]))


# ==== Lua: this module's scripts (composed and run by lmdq.redis.scripts.LuaScript) ====

SERVER_NOW = Fragment("server_now",
                      "local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1000000\n")

# KEYS: schedule zset, data hash, the batch's shard index. ARGV: member, data JSON, delay_s, job_no.
# 0 (and the entry removed): the job is sealed already (another flush landed meanwhile).
PENDING_ADD = LuaScript("pending_add", """
if redis.call('HEXISTS', KEYS[3], ARGV[4]) == 1 then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
""", uses=(SERVER_NOW, OOM_GUARD,))

# KEYS: schedule zset, data hash. ARGV: max entries, lease_s, ahead_s (also take entries due that much
# later). Returns member, data, member, data, ...
PENDING_CLAIM = LuaScript("pending_claim", """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now + tonumber(ARGV[3]), 'LIMIT', 0, tonumber(ARGV[1]))
local out = {}
for _, m in ipairs(due) do
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), m)
  out[#out + 1] = m
  out[#out + 1] = redis.call('HGET', KEYS[2], m) or ''
end
return out
""", uses=(SERVER_NOW, OOM_GUARD,))

# KEYS: schedule zset, data hash. ARGV: member. (A script, not MULTI: Redis 6 refuses a MULTI under OOM.)
PENDING_DROP = LuaScript("pending_drop", """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
""", uses=(OOM_GUARD,))
