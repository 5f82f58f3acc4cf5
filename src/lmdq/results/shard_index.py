"""The store of sealing a job's shard: the batch's shard index (``Keys.shards``: job -> entry), the
job's final records it is built from, and the seal itself (``SEAL_SHARD``: entry in, sealed bits set,
records out, in one script call).

Why a module of its own: when a job may be sealed, what its shard holds and how an entry is decoded are
the results' rules (:mod:`lmdq.results.sink`, :mod:`lmdq.results.shards`); the commands and the seal's Lua are
here, in the results' store (tests/test_redis_boundary.py). Replies are
handed back raw (untrusted: the callers validate them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from lmdq.redis.keys import Keys
from lmdq.redis.scripts import LuaScript
from lmdq.results.records import BATCH_TTL, OOM_GUARD

__all__ = ["index_entry", "job_finals", "seal"]


def index_entry(client: redis.Redis, keys: Keys, batch_id: str, job: str) -> Any:
    """The raw shard-index entry of job number ``job`` (None: the job is not sealed)."""
    return client.hget(keys.shards(batch_id), job)


def job_finals(client: redis.Redis, keys: Keys, batch_id: str, indices: Sequence[int]) -> list[Any]:
    """The final records of ``indices`` in Redis, raw, in that order (None: no final result there)."""
    return list(client.hmget(keys.results(batch_id), list(indices)))


def seal(client: redis.Redis, keys: Keys, batch_id: str, job: str, entry: str, ttl_s: int,
         indices: Sequence[int]) -> int:
    """Seal one job in ONE script call (atomic: a reader finds its records all in Redis or all in its
    shard). Returns 1 when sealed now, 0 when an earlier seal holds the entry, negative when refused
    (the script's comment in :mod:`lmdq.redis.scripts` says when)."""
    bid = batch_id
    return int(SEAL_SHARD(keys=[keys.results(bid), keys.shards(bid), keys.sealed(bid), keys.batch(bid)],
                                  args=[job, entry, ttl_s, *indices], client=client))


# ==== Lua: this module's scripts (composed and run by lmdq.redis.scripts.LuaScript) ====

# KEYS: results, shards index, sealed bitmap, batch.  ARGV: job_no, entry JSON, ttl, index1, index2, ...
# 1: sealed now; 0: sealed already (another flush won); -1: a record is missing (purged/expired batch).
SEAL_SHARD = LuaScript("seal_shard", """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
if redis.call('EXISTS', KEYS[4]) == 0 then return -1 end
for i = 4, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then return -1 end
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
for i = 4, #ARGV do
  redis.call('SETBIT', KEYS[3], ARGV[i], 1)
  redis.call('HDEL', KEYS[1], ARGV[i])
end
local ttl = batch_ttl(KEYS[4], ARGV[3])
for k = 2, 3 do
  if redis.call('TTL', KEYS[k]) < 0 then redis.call('EXPIRE', KEYS[k], ttl) end
end
return 1
""", uses=(BATCH_TTL, OOM_GUARD,))
