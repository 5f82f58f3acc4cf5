"""The store of delivery: the lease table (``Keys.leases`` / ``Keys.lease_owner``, with the run,
attempt and crash counters and the model's in-flight list) and the queues a claim pops from.

Why a module of its own: what a claim, a charge or a lost lease means is the jobs' rule
(:mod:`lmdq.jobs.queue`); the script calls and the lease scripts' Lua are here, in the jobs' store
(tests/test_redis_boundary.py: Redis commands and Lua only in a concept's store modules). Claim,
renewal and release are on the GPU's critical path: each is ONE script call (the claim pops and leases
up to ``n`` jobs in it), timed by the server's clock. Replies are handed back raw (untrusted:
:class:`lmdq.jobs.queue.JobQueue` decodes them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from lmdq.jobs.idle_roster import IDLE_PEERS
from lmdq.redis.keys import Keys, rq_queue_key
from lmdq.redis.scripts import WAKE, Fragment, LuaScript

__all__ = ["JobLeases"]


class JobLeases:
    """Leases of one key prefix (thread-safe: redis-py clients are)."""

    def __init__(self, client: redis.Redis, *, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._claim = CLAIM.bind(client)
        self._heartbeat = HEARTBEAT.bind(client)
        self._release = RELEASE.bind(client)
        self._reap = REAP.bind(client)
        self._move = MOVE_JOB.bind(client)

    def claim(self, queues: Sequence[str], *, model: str, worker: str, lease_s: float, n: int,
              roster: str = "", member: str = "", held: int = 0) -> tuple[int, list[Any]]:
        """Pop up to ``n`` jobs from ``queues`` (RQ queue names, first non-empty first) and lease them to
        ``worker``, in one script call. With ``roster`` (the model's idle roster, :mod:`lmdq.jobs.idle_roster`,
        this worker's entry ``member``, holding ``held`` jobs) ``n`` is first cut to the fair share, in the same
        call. The raw reply: the share it aimed for, and six fields per job (id, queue key, run, charges,
        crashes, killer)."""
        k = self.keys
        res = self._claim(
            keys=[k.leases(), k.lease_owner(), k.runs(), k.attempts(), k.crashes(), k.inflight(model),
                  roster or k.leases(), *(rq_queue_key(q) for q in queues)],
            args=[lease_s, worker, n, held, member if roster else ""],
        )
        res = list(res) if res else [0]
        return int(res[0]), res[1:]

    def renew(self, job_ids: Sequence[str], *, worker: str, lease_s: float) -> list[Any]:
        """Extend the leases ``worker`` still owns among ``job_ids`` (one script call); the raw ids it
        owns no more."""
        return list(self._heartbeat(keys=[self.keys.leases(), self.keys.lease_owner()],
                                    args=[lease_s, worker, *job_ids]))

    def drop(self, job_id: str, *, worker: str, mode: str, charge: str, killer: int | str,
             pipe: Any | None = None) -> bool:
        """Drop ``worker``'s lease, fenced (one script call; ``mode`` 'requeue' puts the job back at the
        front of its queue and counts ``charge``). False: the lease was not ``worker``'s any more. With
        ``pipe`` the call joins that pipeline (its 0/1 comes from the pipeline's ``execute``) and this returns True."""
        k = self.keys
        got = self._release(keys=[k.leases(), k.lease_owner(), k.runs(), k.attempts(), k.crashes()],
                            args=[job_id, worker, mode, charge, killer], client=pipe)
        return True if pipe is not None else bool(got)

    def reap_expired(self, limit: int) -> list[Any]:
        """Re-queue up to ``limit`` jobs whose lease ran out (one script call); the raw flat reply
        ``[job id, dead worker, ...]``."""
        return list(self._reap(keys=[self.keys.leases(), self.keys.lease_owner()], args=[limit]))

    def move(self, job_id: str, *, worker: str, queue: str, model: str) -> bool:
        """Put a held job on RQ queue ``queue`` (of ``model``, whose workers are woken) and drop ``worker``'s
        lease, in one script call. False: the lease was lost."""
        return bool(self._move(keys=[self.keys.leases(), self.keys.lease_owner(), rq_queue_key(queue),
                                     self.keys.wake(model)], args=[job_id, worker]))

    def clock(self) -> tuple[Any, Any, Any, Any]:
        """The lease clock's inputs, one round trip: the server's TIME (seconds, microseconds) and the last
        reading and offset the lease scripts keep in ``<leases>:clock`` (raw; None when absent)."""
        with self.client.pipeline(transaction=False) as p:
            p.time()
            p.hmget(self.keys.lease_clock(), ["raw", "offset"])
            (sec, usec), (last, offset) = p.execute()
        return sec, usec, last, offset

    def waiting(self, queues: Sequence[str]) -> int:
        """Jobs waiting on ``queues`` (RQ queue names), one pipelined round trip."""
        with self.client.pipeline(transaction=False) as p:
            for q in queues:
                p.llen(rq_queue_key(q))
            return int(sum(p.execute()))


# ==== Lua: the lease scripts: claim, extend, release and reap jobs atomically, on the Redis server's clock ====
#
# A worker claims a job with one script that pops it from the highest-priority non-empty queue AND
# records its lease and owner in the same step (nothing is lost between the two); it extends the
# leases it still owns; it releases a job (done, or back to the FRONT of its queue, with what that
# costs the job counted in the same step); any worker re-queues leases that expired (their holder
# died). Re-queueing also leaves a wake-up token for the model's idle workers (:data:`WAKE`; the
# claim script is unchanged). Owner entries are ``worker<TAB>queue<TAB>inflight list``, so release
# and reap know where a job goes back to. :class:`lmdq.jobs.queue.JobQueue` calls them.

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
LEASE_CLOCK = Fragment("lease_clock", """
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
""")

# The fenced first step of RELEASE and of MOVE_JOB: only the lease holder (KEYS: leases, owners;
# ARGV[1] job id, ARGV[2] worker) gets past it; it drops the lease, the owner entry and the inflight mark.
DROP_OWN_LEASE = Fragment("drop_own_lease", """
local o = redis.call('HGET', KEYS[2], ARGV[1])
if not o then return 0 end
local w, q, inflight = string.match(o, '^([^\\t]*)\\t([^\\t]*)\\t([^\\t]*)$')
if w ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('LREM', inflight, 1, ARGV[1])
""")

# KEYS: leases, owners, runs, charges, crashes, inflight list, idle roster (or any key: unused without a
# member), queue1..n.  ARGV: ttl, worker, max jobs, jobs the worker holds, its roster member ('' for none).
# Returns the share it aimed for, then per job: id, queue, run number, charged attempts so far, engine crashes
# so far, killer index. With a member, the max is first cut to the FAIR SHARE while other workers of the model
# are idle: lmdq.worker.admission.fair_share's rule (tests/test_fair_share.py runs both on the same cases),
# over the idle roster's count (IDLE_PEERS, lmdq.jobs.idle_roster), in this call: issue 49, that look was a
# round trip and a script call of its own before every claim.
CLAIM = LuaScript("claim", """
local out = {}
local want = tonumber(ARGV[3])
if ARGV[5] ~= '' and want > 0 then
  local idle = lmdq_idle_peers(KEYS[7], ARGV[5])
  if idle > 0 then
    local visible, held = 0, tonumber(ARGV[4])
    for i = 8, #KEYS do visible = visible + redis.call('LLEN', KEYS[i]) end
    local target = math.ceil((visible + held) / (idle + 1))
    want = math.max(0, math.min(want, target - held))
  end
end
table.insert(out, want)
for i = 8, #KEYS do
  while #out < 1 + 6 * want do
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
return out
""", uses=(LEASE_CLOCK, IDLE_PEERS))

# KEYS: leases, owners.  ARGV: ttl, worker, ids...  (:data:`_NOW`'s first write keeps it going under
# maxmemory: see above.)
HEARTBEAT = LuaScript("heartbeat", """
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
""", uses=(LEASE_CLOCK,))

# KEYS: leases, owners, runs, charges, crashes.
# ARGV: job id, worker, mode ('done' | 'requeue'), charge ('' | 'charge' | 'crash'), killer index or ''.
# 'done' also drops the job's counters (they are only needed while it can still run again); 'requeue'
# wakes an idle worker of the job's model.
RELEASE = LuaScript("release", """if ARGV[3] == 'requeue' then
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
""", uses=(WAKE, DROP_OWN_LEASE,))

# KEYS: leases, owners.  ARGV: limit.  Each re-queued job wakes an idle worker of its model.
REAP = LuaScript("reap", """
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
""", uses=(LEASE_CLOCK, WAKE,))

# KEYS: leases, owners, the right queue, its model's wake list.  ARGV: job id, worker.
# Fenced like RELEASE: only the lease holder moves the job; the lease goes and the job is pushed to the
# FRONT of the queue of the model its batch names, in one step (nothing between "off" and "on").
MOVE_JOB = LuaScript("move_job", """redis.call('LPUSH', KEYS[3], ARGV[1])
lmdq_wake(KEYS[4])
return 1
""", uses=(WAKE, DROP_OWN_LEASE,))
