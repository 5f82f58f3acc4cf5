"""Plain reads of lmdq's Redis records for callers outside the object that owns them: a batch's status
field (the worker answering a job it cannot decode), a job hash field within a size cap (decode_job),
how many jobs a model's workers hold (the fleet bench waits for a cancelled batch to leave them).

Why here and not at the caller: Redis commands live only in a concept's store modules
(tests/test_redis_boundary.py); the two capped reads that are scripts (``READ_JOB``, ``READ_BATCH``: a
job hash and a batch record, for :mod:`lmdq.jobs.data` and :mod:`lmdq.jobs.decode`) are here too. What
a caller does with the answer (untrusted: every caller validates it) stays with the caller.
"""

from __future__ import annotations

import redis
from rq.job import Job

from lmdq.redis.keys import BatchField, Keys
from lmdq.redis.scripts import LuaScript

__all__ = ["batch_status", "capped_job_field", "inflight_count"]


def batch_status(client: redis.Redis, keys: Keys, batch_id: str) -> bytes | None:
    """The raw ``status`` field of the batch record (None: no record)."""
    raw = client.hget(keys.batch(batch_id), BatchField.status.value)
    return raw if isinstance(raw, bytes) or raw is None else str(raw).encode()


def capped_job_field(client: redis.Redis, job_id: str, field: str, cap: int) -> tuple[int, bytes | None]:
    """``(size, value)`` of one field of RQ's job hash: the value only when ``size <= cap`` (None when
    the field is missing or too large), so an untrusted hash never hands over more than ``cap`` bytes."""
    key = Job.key_for(job_id)
    size = int(client.hstrlen(key, field))
    if size > cap:
        return size, None
    raw = client.hget(key, field)
    return size, raw if isinstance(raw, bytes) or raw is None else str(raw).encode()


def inflight_count(client: redis.Redis, keys: Keys, model: str) -> int:
    """How many jobs workers of ``model`` hold now (the length of :meth:`Keys.inflight`)."""
    return int(client.llen(keys.inflight(model)))


# ==== Lua: this module's scripts (composed and run by lmdq.redis.scripts.LuaScript) ====

# KEYS: job hash.  ARGV: cap for the first field, cap for the others, field names...
# Returns {'missing'} | {'not_hash', type} | {'too_large', field, size} | {'ok', value1, value2, ...}
READ_JOB = LuaScript("read_job", """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return {'missing'} end
if t ~= 'hash' then return {'not_hash', t} end
local fields = {}
for i = 3, #ARGV do
  local cap = tonumber(ARGV[2])
  if i == 3 then cap = tonumber(ARGV[1]) end
  local n = redis.call('HSTRLEN', KEYS[1], ARGV[i])
  if n > cap then return {'too_large', ARGV[i], n} end
  table.insert(fields, ARGV[i])
end
local vals = redis.call('HMGET', KEYS[1], unpack(fields))
local out = {'ok'}
for i = 1, #fields do out[i + 1] = vals[i] end
return out
""")

# KEYS: batch hash.  ARGV: cap on 'meta'.  Returns false | {'too_large', size} | {'ok', meta, total}
READ_BATCH = LuaScript("read_batch", """
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash' then return false end
local n = redis.call('HSTRLEN', KEYS[1], 'meta')
if n > tonumber(ARGV[1]) then return {'too_large', n} end
local v = redis.call('HMGET', KEYS[1], 'meta', 'total')
return {'ok', v[1], v[2]}
""")
