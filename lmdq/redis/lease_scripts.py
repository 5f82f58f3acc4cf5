"""The lease scripts: claim, extend, release and reap jobs atomically, on the Redis server's clock.

A worker claims a job with one script that pops it from the highest-priority non-empty queue AND
records its lease and owner in the same step (nothing is lost between the two); it extends the
leases it still owns; it releases a job (done, or back to the FRONT of its queue, with what that
costs the job counted in the same step); any worker re-queues leases that expired (their holder
died). Re-queueing also leaves a wake-up token for the model's idle workers (:mod:`lmdq.redis.wakeup`;
the claim script is unchanged). Owner entries are ``worker<TAB>queue<TAB>inflight list``, so release
and reap know where a job goes back to. :class:`lmdq.jobs.queue.JobQueue` registers and calls them.
"""

from __future__ import annotations

from lmdq.redis.wakeup import WAKE_LUA

__all__ = ["CLAIM", "HEARTBEAT", "REAP", "RELEASE"]

# Lease times are the Redis server's clock (TIME), never a worker's: a worker whose clock runs behind
# or ahead must not lease for too short a time nor reap live leases. (TIME before writes needs
# script effects replication, the default since Redis 5.)
#
# And that clock never runs backwards: a step back of the Redis host's clock (NTP correcting a clock
# that ran ahead, a failover to a replica whose clock is behind) would otherwise leave every lease
# stamped before it that much further in the future, so a dead worker's jobs would wait out the
# step (an hour back: an hour unreaped). The lease clock is TIME plus an offset that grows by every
# step back seen: ``<leases>:clock`` keeps the last TIME read and the offset, so lease time only
# ever advances by elapsed server time. (A step forward is not undone: it expires leases early,
# which re-runs work, never loses it.) The key is derived from the leases key, beside it.
#
# Its first write is a ZREM of a member that never exists: under maxmemory + noeviction Redis refuses
# a script only at its FIRST write when that command may grow memory (HSET, ZADD), and a ZREM cannot,
# so the clock (and the heartbeat's lease extensions after it) go through when Redis is full: a worker
# holding finished results through an out-of-memory episode keeps its leases instead of having its
# jobs reaped and re-run.
_NOW = """
redis.call('ZREM', KEYS[1], '\\0lmdq-oom-guard')
local now
do
  local t = redis.call('TIME')
  local raw = tonumber(t[1]) + tonumber(t[2]) / 1000000
  local clock = KEYS[1] .. ':clock'
  local seen = redis.call('HMGET', clock, 'raw', 'offset')
  local last, offset = tonumber(seen[1]), tonumber(seen[2]) or 0
  if last and raw < last then offset = offset + (last - raw) end
  redis.call('HSET', clock, 'raw', raw, 'offset', offset)
  now = raw + offset
end
"""

# KEYS: leases, owners, runs, charges, crashes, inflight list, queue1..n.  ARGV: ttl, worker, max jobs
# Returns per job: id, queue, run number, charged attempts so far, engine crashes so far, killer index.
CLAIM = _NOW + """
local out = {}
local want = tonumber(ARGV[3])
for i = 7, #KEYS do
  while #out < 6 * want do
    local id = redis.call('LPOP', KEYS[i])
    if not id then break end
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), id)
    redis.call('HSET', KEYS[2], id, ARGV[2] .. '\\t' .. KEYS[i] .. '\\t' .. KEYS[6])
    local run = redis.call('HINCRBY', KEYS[3], id, 1)
    redis.call('RPUSH', KEYS[6], id)
    table.insert(out, id); table.insert(out, KEYS[i]); table.insert(out, run)
    table.insert(out, redis.call('HGET', KEYS[4], id) or '0')
    table.insert(out, redis.call('HGET', KEYS[5], id) or '0')
    table.insert(out, redis.call('HGET', KEYS[5], id .. ':killer') or '')
  end
end
if #out == 0 then return false end
return out
"""

# KEYS: leases, owners.  ARGV: ttl, worker, ids...  (:data:`_NOW`'s first write keeps it going under
# maxmemory: see above.)
HEARTBEAT = _NOW + """
local lost = {}
for i = 3, #ARGV do
  local o = redis.call('HGET', KEYS[2], ARGV[i])
  if o and string.sub(o, 1, string.len(ARGV[2]) + 1) == ARGV[2] .. '\\t' then
    redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i])
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""

# KEYS: leases, owners, runs, charges, crashes.
# ARGV: job id, worker, mode ('done' | 'requeue'), charge ('' | 'charge' | 'crash'), killer index or ''.
# 'done' also drops the job's counters (they are only needed while it can still run again); 'requeue'
# wakes an idle worker of the job's model.
# The fenced first step of RELEASE and of jobs.py's move: only the lease holder (KEYS: leases, owners;
# ARGV[1] job id, ARGV[2] worker) gets past it; it drops the lease, the owner entry and the inflight mark.
DROP_OWN_LEASE = """
local o = redis.call('HGET', KEYS[2], ARGV[1])
if not o then return 0 end
local w, q, inflight = string.match(o, '^([^\\t]*)\\t([^\\t]*)\\t([^\\t]*)$')
if w ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('LREM', inflight, 1, ARGV[1])
"""

RELEASE = WAKE_LUA + DROP_OWN_LEASE + """if ARGV[3] == 'requeue' then
  if ARGV[4] == 'charge' then redis.call('HINCRBY', KEYS[4], ARGV[1], 1) end
  if ARGV[4] == 'crash' then
    redis.call('HINCRBY', KEYS[5], ARGV[1], 1)
    if ARGV[5] ~= '' then redis.call('HSET', KEYS[5], ARGV[1] .. ':killer', ARGV[5]) end
  end
  redis.call('LPUSH', q, ARGV[1])
  lmdq_wake(lmdq_wake_key(inflight))
else
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('HDEL', KEYS[4], ARGV[1])
  redis.call('HDEL', KEYS[5], ARGV[1], ARGV[1] .. ':killer')
end
return 1
"""

# KEYS: leases, owners.  ARGV: limit.  Each re-queued job wakes an idle worker of its model.
REAP = _NOW + WAKE_LUA + """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local out = {}
for _, id in ipairs(ids) do
  local o = redis.call('HGET', KEYS[2], id)
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
  if o then
    local w, q, inflight = string.match(o, '^([^\\t]*)\\t([^\\t]*)\\t([^\\t]*)$')
    redis.call('LREM', inflight, 1, id)
    redis.call('LPUSH', q, id)
    lmdq_wake(lmdq_wake_key(inflight))
    table.insert(out, id)
    table.insert(out, w)
  end
end
return out
"""
