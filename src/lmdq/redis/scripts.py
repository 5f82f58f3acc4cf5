"""Every Lua script lmdq runs, in one place, registered one way.

Why one module: a script is where several keys change in one atomic step, so it is where the rules of
a concept are hardest to read; spread over nine modules and glued by string concatenation across them,
no reader could see what one script really sends, and the scripts were run three different ways (one
sent its whole text on every call). Here each script is a :class:`LuaScript` built once at import, its
full text (:attr:`LuaScript.source`) visible in one object, and every call goes the same way:

* EVALSHA with the script's SHA1, and on ``NOSCRIPT`` (a Redis restarted or failed over, whose script
  cache is empty) SCRIPT LOAD and EVALSHA again: redis-py's own :class:`~redis.commands.core.Script`,
  which also loads a pipeline's scripts before the pipeline runs. A script's text crosses the wire once
  per server, not once per call.
* The client (or pipeline) is passed at the call, never held here: ``CLAIM(keys=[...], args=[...],
  client=r)``, or ``CLAIM.bind(r)`` for an object that calls it often with one client.

Shared Lua is composed in ONE way: a :class:`Fragment` is Lua text that a script (or another
fragment) names in ``uses=``; a script's source is its fragments, each once, dependencies first, in
the order named, then its own body. A fragment either defines ``local function lmdq_*`` helpers or is
a prelude that runs first (:data:`LEASE_CLOCK` sets ``now``; :data:`DROP_OWN_LEASE` returns 0 unless
the caller holds the lease). Nothing else concatenates Lua.

This module is the only place in lmdq with Lua text or a script call path
(tests/test_redis_boundary.py fails otherwise). KEYS/ARGV of each script are in the comment above it;
the Python that builds them lives with the concept that owns the keys (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from redis.commands.core import Script
from rq.job import Job

from lmdq.contract import BatchStatus
from lmdq.redis.keys import MODEL_COUNT_PREFIX, BatchField, rq_queue_key

__all__ = ["SCRIPTS", "BoundScript", "Fragment", "LuaScript"]

F = BatchField
_JOB_PREFIX = Job.redis_job_namespace_prefix


class Fragment:
    """Lua shared by several scripts (helpers or a prelude), named in their ``uses=``."""

    def __init__(self, name: str, source: str, *, uses: Sequence[Fragment] = ()) -> None:
        self.name = name
        self.source = source
        self.uses = tuple(uses)

    def closure(self) -> list[Fragment]:
        """This fragment after everything it uses, each once, dependencies first."""
        out: list[Fragment] = []
        for dep in self.uses:
            out.extend(f for f in dep.closure() if f not in out)
        return [*out, self]


SCRIPTS: dict[str, LuaScript] = {}
"""Every script by name (tests load each one on a real server)."""


class LuaScript:
    """One Lua script: its fragments and body composed once, run by EVALSHA with a NOSCRIPT fallback."""

    def __init__(self, name: str, body: str, *, uses: Sequence[Fragment] = ()) -> None:
        parts: list[Fragment] = []
        for frag in uses:
            parts.extend(f for f in frag.closure() if f not in parts)
        self.name = name
        self.fragments = tuple(parts)
        self.source = "".join(f.source for f in parts) + body
        # registered_client None: redis-py's Script then needs bytes (no client encoder to ask) and the
        # client at every call, which is how lmdq calls scripts anyway.
        self._script = Script(None, self.source.encode())  # type: ignore[arg-type]
        if name in SCRIPTS:
            raise ValueError(f"two Lua scripts named {name!r}")
        SCRIPTS[name] = self

    @property
    def sha(self) -> str:
        return str(self._script.sha)

    def __call__(self, keys: Sequence[Any] = (), args: Iterable[Any] = (), *, client: Any) -> Any:
        """Run on ``client`` (a redis-py client or pipeline); a pipeline queues it and loads it before running."""
        return self._script(keys=list(keys), args=list(args), client=client)

    def bind(self, client: Any) -> BoundScript:
        """This script with a default client, called like redis-py's registered scripts."""
        return BoundScript(self, client)


class BoundScript:
    """A :class:`LuaScript` with a default client: ``s(keys=..., args=...)``, or ``client=pipe`` for a pipeline."""

    def __init__(self, script: LuaScript, client: Any) -> None:
        self.script = script
        self.client = client

    def __call__(self, keys: Sequence[Any] = (), args: Iterable[Any] = (), client: Any = None) -> Any:
        return self.script(keys, args, client=self.client if client is None else client)

# ==== Fragments: Lua that several scripts share (named in their uses=) =================================

WAKE_KEY = Fragment("wake_key", """
local function lmdq_wake_key(inflight)
  local wake, n = string.gsub(inflight, ':inflight:([^:]*)$', ':wake:%1')
  if n == 1 then return wake end
  return nil
end
""")
"""Lua: ``lmdq_wake_key(inflight)`` is :meth:`Keys.wake` of the model whose :meth:`Keys.inflight` list is
``inflight`` (nil for a name that is not one). The release and reap scripts know a job's model only by
the in-flight list its owner entry names; a slug holds no ':' (the name rule admits none, and
:func:`model_slug` escapes one), so the anchored pattern cannot match inside the prefix.
(tests/test_idle.py checks it against :meth:`Keys.wake` on a real server.)"""

WAKE = Fragment("wake", """
local function lmdq_wake(key)
  if key and redis.call('LLEN', key) == 0 then redis.call('RPUSH', key, '1') end
end
""", uses=(WAKE_KEY,))
"""Lua: ``lmdq_wake(key)`` leaves one token on the wake list ``key`` (nil: nothing), and
``lmdq_wake(lmdq_wake_key(inflight))`` on the one of the model an in-flight list belongs to (scripts
that queue jobs include it)."""

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

BATCH_ENDED = Fragment("batch_ended", f"""
local function lmdq_batch_ended(batch, fallback)
  local ttl = tonumber(redis.call('HGET', batch, '{F.ttl}') or '') or tonumber(fallback)
  for _, suffix in ipairs({{'', ':results', ':partials', ':shards', ':sealed', ':jobs'}}) do
    redis.call('EXPIRE', batch .. suffix, ttl)
  end
  local jobs = batch .. ':jobs'
  local n = redis.call('LLEN', jobs)
  for s = 0, n - 1, 1000 do
    for _, jid in ipairs(redis.call('LRANGE', jobs, s, s + 999)) do
      redis.call('EXPIRE', '{_JOB_PREFIX}' .. jid, ttl)
    end
  end
  local idem = redis.call('HGET', batch, '{F.idempotency}')
  local id = string.match(batch, ':batch:([^:]+)$')
  if idem and id and redis.call('GET', idem) == id then redis.call('EXPIRE', idem, ttl) end
end
""")
"""Lua: ``lmdq_batch_ended(batch_key, fallback_ttl)`` starts the batch's retention: every key of the batch
(record, results, partials, shard index, sealed bits, job list, job hashes, idempotency key) expires
``ttl`` seconds from now. O(jobs), once per batch (about 1 µs a job)."""

# The TTL a key the workers create takes: what is left of the batch record's own (so every key of a
# batch goes at the same moment: submit's --result-ttl), or ARGV ttl when the record has none.
BATCH_TTL = Fragment("batch_ttl", """
local function batch_ttl(batch, fallback)
  local t = redis.call('TTL', batch)
  if t > 0 then return t end
  return tonumber(fallback)
end
""")

OOM_GUARD = Fragment("oom_guard", "redis.call('HDEL', KEYS[2], '\\0lmdq-oom-guard')\n")
"""A script's first write decides whether Redis, full under ``maxmemory`` + ``noeviction``, runs it: a
command that may grow memory (HSET, ZADD, SETBIT) is refused, one that cannot (HDEL of a field that
never exists) is not, and lets the rest through (the same guard as LEASE_CLOCK's, before the heartbeat). A
seal frees far more than it adds, and the retry schedule is what frees the rest once the sink answers:
both must work in a Redis filled by the very records they are there to move out."""

SERVER_NOW = Fragment("server_now",
                      "local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1000000\n")

# Server time as RQ writes it (rq.utils.utcformat: '%Y-%m-%dT%H:%M:%S.%fZ'), computed in the script
# from TIME so the RQ record and lmdq's share one clock. Days to civil date: H. Hinnant's algorithm.
RQ_CLOCK = Fragment("rq_clock", """
local t = redis.call('TIME')
local sec, usec = tonumber(t[1]), tonumber(t[2])
local now = sec + usec / 1000000
local function utc()
  local days = math.floor(sec / 86400)
  local rem = sec - days * 86400
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return string.format('%04d-%02d-%02dT%02d:%02d:%02d.%06dZ', y, m, d,
    math.floor(rem / 3600), math.floor(rem % 3600 / 60), rem % 60, usec)
end
""")

# ``lmdq_push(qkey, ids, queues)``: push job ids onto queue key ``qkey``, or, when it is '' (a batch over
# several models), each onto its own model's queue, the one its job hash names as ``origin`` (the ledger's
# stage wrote it); every queue used joins RQ's set of queues ``queues``.
PUSH_JOBS = Fragment("push_jobs", f"""
local function lmdq_push(qkey, ids, queues)
  if #ids == 0 then return end
  if qkey ~= '' then
    for s = 1, #ids, 4000 do
      redis.call('RPUSH', qkey, unpack(ids, s, math.min(s + 3999, #ids)))
    end
    redis.call('SADD', queues, qkey)
    return
  end
  for _, id in ipairs(ids) do
    local q = redis.call('HGET', '{Job.redis_job_namespace_prefix}' .. id, 'origin')
    if q then
      local k = '{rq_queue_key("")}' .. q
      redis.call('RPUSH', k, id)
      redis.call('SADD', queues, k)
    end
  end
end
""")

# ==== Leases: claim, extend, release and reap jobs atomically, on the Redis server's clock (lmdq.jobs.queue) ===
#
# A worker claims a job with one script that pops it from the highest-priority non-empty queue AND
# records its lease and owner in the same step (nothing is lost between the two); it extends the
# leases it still owns; it releases a job (done, or back to the FRONT of its queue, with what that
# costs the job counted in the same step); any worker re-queues leases that expired (their holder
# died). Re-queueing also leaves a wake-up token for the model's idle workers (:data:`WAKE`; the
# claim script is unchanged). Owner entries are ``worker<TAB>queue<TAB>inflight list``, so release
# and reap know where a job goes back to. :class:`lmdq.jobs.queue.JobQueue` calls them.

# KEYS: leases, owners, runs, charges, crashes, inflight list, queue1..n.  ARGV: ttl, worker, max jobs
# Returns per job: id, queue, run number, charged attempts so far, engine crashes so far, killer index.
CLAIM = LuaScript("claim", """
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
""", uses=(LEASE_CLOCK,))

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

# ==== Jobs (lmdq.jobs) =================================================================================

# KEYS: leases, owners, the right queue, its model's wake list.  ARGV: job id, worker.
# Fenced like RELEASE: only the lease holder moves the job; the lease goes and the job is pushed to the
# FRONT of the queue of the model its batch names, in one step (nothing between "off" and "on").
MOVE_JOB = LuaScript("move_job", """redis.call('LPUSH', KEYS[3], ARGV[1])
lmdq_wake(KEYS[4])
return 1
""", uses=(WAKE, DROP_OWN_LEASE,))

# KEYS: job hash, its batch's record.  Run last in the MULTI of every RQ bookkeeping write a worker makes
# for a job (started, ended, re-queued): RQ's HSETs re-create a job hash that ``purge`` deleted, with no
# TTL; with the batch gone, the re-created hash goes too.
DROP_ORPHAN = LuaScript("drop_orphan", """
if redis.call('EXISTS', KEYS[2]) == 0 then return redis.call('DEL', KEYS[1]) end
return 0
""")

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

# ==== Wake-ups and the idle roster (lmdq.redis.wakeup, lmdq.redis.idle_roster) =========================

WAKE_NOTIFY = LuaScript("wake_notify", "lmdq_wake(KEYS[1])\nreturn 1\n", uses=(WAKE,))

# KEYS: roster.  ARGV: worker, ttl.  The key itself expires with its youngest entry's TTL.
IDLE_ENTER = LuaScript("idle_enter", """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2])))
return 1
""")

# KEYS: roster, queue1..n.  ARGV: worker.  Read-only: {other idle workers, visible jobs}.
IDLE_LOOK = LuaScript("idle_look", """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local idle = redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
local mine = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or '0')
if mine > now then idle = idle - 1 end
local visible = 0
for i = 2, #KEYS do visible = visible + redis.call('LLEN', KEYS[i]) end
return {idle, visible}
""")

# ==== The batch ledger (lmdq.submission.ledger) ===========================================================

# KEYS: batch jobs list, rq queue list, rq queues set, batch hash, the wake list of each model of the batch.
# ARGV: queue key ('': each job to its own model's queue, see PUSH_JOBS), chunk, now, running ttl.
# Returns the number of jobs made visible, or -1 when the batch was committed already (fence).
# Every key of the batch takes the running TTL here (lmdq.results.store: TTLs count from the batch's end).
COMMIT = LuaScript("commit", f"""
if redis.call('HEXISTS', KEYS[4], '{F.queued_at}') == 1 then return -1 end
local n = redis.call('LLEN', KEYS[1])
local chunk = tonumber(ARGV[2])
for s = 0, n - 1, chunk do
  local ids = redis.call('LRANGE', KEYS[1], s, s + chunk - 1)
  lmdq_push(ARGV[1], ids, KEYS[3])
  for _, id in ipairs(ids) do redis.call('EXPIRE', '{Job.redis_job_namespace_prefix}' .. id, ARGV[4]) end
end
redis.call('EXPIRE', KEYS[4], ARGV[4])
local idem = redis.call('HGET', KEYS[4], '{F.idempotency}')
local bid = string.match(KEYS[4], ':batch:([^:]+)$')
if idem and bid and redis.call('GET', idem) == bid then redis.call('EXPIRE', idem, ARGV[4]) end
if redis.call('HGET', KEYS[4], '{F.status}') == '{BatchStatus.validating.value}' then
  redis.call('HSET', KEYS[4], '{F.status}', '{BatchStatus.queued.value}')
end
redis.call('HSET', KEYS[4], '{F.queued_at}', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
if n > 0 then for i = 5, #KEYS do lmdq_wake(KEYS[i]) end end
return n
""", uses=(WAKE, PUSH_JOBS,))

# Progressive staging: the batch's staged jobs from ``visible_jobs`` up to ARGV[2] become visible.
# KEYS: batch jobs list, rq queue list, rq queues set, batch hash, staging lease, the wake list of each model
# of the batch. ARGV: queue key ('': each job to its own model's queue, see PUSH_JOBS), jobs visible after this
# call, requests visible after this call, now, running ttl, '1' for the last call (every job is visible; the
# lease is deleted), the submit's lease token ('': no lease). Returns the jobs made visible, -1 when they were
# already (a re-sent call), -2 when the batch is no longer live (cancelled while it was being staged: nothing
# more is pushed), -3 when the lease is not the caller's (it lapsed: the batch is another's to end or resume).
# TTLs as COMMIT's: what is visible (job hashes, record, job list, idempotency key) takes the running TTL.
COMMIT_UPTO = LuaScript("commit_upto", f"""
local st = redis.call('HGET', KEYS[4], '{F.status}')
if st ~= '{BatchStatus.validating.value}' and st ~= '{BatchStatus.queued.value}'
   and st ~= '{BatchStatus.in_progress.value}' then return -2 end
if ARGV[7] ~= '' and redis.call('GET', KEYS[5]) ~= ARGV[7] then return -3 end
local have = tonumber(redis.call('HGET', KEYS[4], '{F.visible_jobs}') or '0')
local upto = tonumber(ARGV[2])
if have >= upto then return -1 end
local ids = redis.call('LRANGE', KEYS[1], have, upto - 1)
lmdq_push(ARGV[1], ids, KEYS[3])
for _, id in ipairs(ids) do redis.call('EXPIRE', '{Job.redis_job_namespace_prefix}' .. id, ARGV[5]) end
redis.call('EXPIRE', KEYS[4], ARGV[5])
local idem = redis.call('HGET', KEYS[4], '{F.idempotency}')
local bid = string.match(KEYS[4], ':batch:([^:]+)$')
if idem and bid and redis.call('GET', idem) == bid then redis.call('EXPIRE', idem, ARGV[5]) end
if st == '{BatchStatus.validating.value}' then
  redis.call('HSET', KEYS[4], '{F.status}', '{BatchStatus.queued.value}')
end
if redis.call('HEXISTS', KEYS[4], '{F.queued_at}') == 0 then redis.call('HSET', KEYS[4], '{F.queued_at}', ARGV[4]) end
redis.call('HSET', KEYS[4], '{F.visible_jobs}', upto, '{F.visible_requests}', ARGV[3])
if ARGV[6] == '1' then
  redis.call('HSET', KEYS[4], '{F.staged_at}', ARGV[4])
  if ARGV[7] ~= '' then redis.call('DEL', KEYS[5]) end
end
redis.call('EXPIRE', KEYS[1], ARGV[5])
if #ids > 0 then for i = 6, #KEYS do lmdq_wake(KEYS[i]) end end
return #ids
""", uses=(WAKE, PUSH_JOBS,))

# ==== Progressive staging's lease (lmdq.redis.staging, lmdq.submission.ledger: issue 44) ===================

# KEYS: staging lease. ARGV: token, lease ms. 1: renewed; 0: the lease is not the token's (lapsed, or taken).
STAGING_RENEW = LuaScript("staging_renew", """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
""")

# KEYS: lease, batch hash. ARGV: token, lease ms. A re-run of the same submit takes a lapsed lease over:
# 1 taken; 0 the lease is live (another submit stages it); -2 the batch cannot be resumed (staged, ended, its
# staging ended by a noticer, or no record).
STAGING_ACQUIRE = LuaScript("staging_acquire", f"""
local b = redis.call('HMGET', KEYS[2], '{F.status}', '{F.staged_at}', '{F.staging_failed}', '{F.visible_jobs}')
local live = b[1] == '{BatchStatus.validating.value}' or b[1] == '{BatchStatus.queued.value}'
  or b[1] == '{BatchStatus.in_progress.value}'
if not live or b[2] or b[3] or not b[4] then return -2 end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
""")

# KEYS: lease, batch hash, staging set. ARGV: batch id, reason. Whoever notices a lapsed lease claims the
# batch's end once: 1 claimed (staging_failed set: neither its submit nor a re-run may commit any more);
# 0 the lease is live; -1 its staging had ended already (claimed, or failed in its submit); -2 not part-staged
# (staged, or no progressive record: it leaves the staging set).
STAGING_CLAIM_END = LuaScript("staging_claim_end", f"""
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('HEXISTS', KEYS[2], '{F.staged_at}') == 1 or redis.call('HEXISTS', KEYS[2], '{F.visible_jobs}') == 0
then
  redis.call('SREM', KEYS[3], ARGV[1])
  return -2
end
if redis.call('HSETNX', KEYS[2], '{F.staging_failed}', ARGV[2]) == 0 then return -1 end
return 1
""")

# KEYS: queue list.  ARGV: id prefix.  Returns the removed ids. One pass that rebuilds the list
# without the batch's ids: O(queue length), not O(jobs x queue) as one LREM per job would be.
REMOVE_PREFIX = LuaScript("remove_prefix", """
local ids = redis.call('LRANGE', KEYS[1], 0, -1)
local keep, gone = {}, {}
local p = ARGV[1]
for _, id in ipairs(ids) do
  if string.sub(id, 1, string.len(p)) == p then table.insert(gone, id) else table.insert(keep, id) end
end
if #gone > 0 then
  redis.call('DEL', KEYS[1])
  for s = 1, #keep, 4000 do
    redis.call('RPUSH', KEYS[1], unpack(keep, s, math.min(s + 3999, #keep)))
  end
end
return gone
""")

# KEYS: queue list.  ARGV: id prefix.  Returns the ids on the queue that start with the prefix (read only).
FIND_PREFIX = LuaScript("find_prefix", """
local out = {}
local p = ARGV[1]
for _, id in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  if string.sub(id, 1, string.len(p)) == p then table.insert(out, id) end
end
return out
""")

# KEYS: idempotency key.  ARGV: batch id.  Deletes the key only while it still names this batch.
RELEASE_KEY = LuaScript("release_key", """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
""")

# ==== Results (lmdq.results.store, lmdq.results.sink) ==================================================

# KEYS: results, batch, partials, sealed. ARGV: index, json, counter field, now, ttl, generated tokens, the
# result's model ('' for none: its per-model counter, ``by_model:<model>:<counter>``, is left alone).
# Refused (0): a duplicate (HSETNX), a request whose result is already in a shard (sealed bit: the
# record was trimmed after the shard was written, see lmdq.results.sink), or a batch with no record (purged
# or expired: writing would bring back counters without a TTL).
WRITE_RESULT = LuaScript("write_result", f"""
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
if redis.call('GETBIT', KEYS[4], ARGV[1]) == 1 then return 0 end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
if redis.call('TTL', KEYS[1]) < 0 then redis.call('EXPIRE', KEYS[1], batch_ttl(KEYS[2], ARGV[5])) end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
if ARGV[7] and ARGV[7] ~= '' then
  redis.call('HINCRBY', KEYS[2], '{MODEL_COUNT_PREFIX}' .. ARGV[7] .. ':' .. ARGV[3], 1)
end
if tonumber(ARGV[6] or '0') > 0 then redis.call('HINCRBY', KEYS[2], '{F.output_tokens}', ARGV[6]) end
local b = redis.call('HMGET', KEYS[2], '{F.total}', '{F.completed}', '{F.failed}', '{F.cancelled}', '{F.expired}',
                     '{F.status}')
local done = 0
for i = 2, 5 do done = done + tonumber(b[i] or '0') end
if b[1] and done >= tonumber(b[1]) then
  local st = b[6]
  local final = '{BatchStatus.completed.value}'
  if st == '{BatchStatus.cancelling.value}' or st == '{BatchStatus.cancelled.value}' then
    final = '{BatchStatus.cancelled.value}'
  elseif tonumber(b[5] or '0') > 0 then final = '{BatchStatus.expired.value}' end
  redis.call('HSET', KEYS[2], '{F.status}', final, final .. '_at', ARGV[4])
  lmdq_batch_ended(KEYS[2], ARGV[5])
end
return 1
""", uses=(BATCH_TTL, BATCH_ENDED,))

# KEYS: results, partials, sealed, batch. ARGV: index, json, ttl
WRITE_PARTIAL = LuaScript("write_partial", """
if redis.call('EXISTS', KEYS[4]) == 0 then return 0 end
if redis.call('GETBIT', KEYS[3], ARGV[1]) == 1 then return 0 end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
if redis.call('TTL', KEYS[2]) < 0 then redis.call('EXPIRE', KEYS[2], batch_ttl(KEYS[4], ARGV[3])) end
return 1
""", uses=(BATCH_TTL,))

# KEYS: batch. ARGV: from-status list (comma separated), to-status, timestamp field, now, ttl, to is terminal
TRANSITION = LuaScript("transition", f"""
local st = redis.call('HGET', KEYS[1], '{F.status}')
if not st then return nil end
for s in string.gmatch(ARGV[1], '[^,]+') do
  if s == st then
    redis.call('HSET', KEYS[1], '{F.status}', ARGV[2])
    if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], ARGV[3], ARGV[4]) end
    if ARGV[6] == '1' then lmdq_batch_ended(KEYS[1], ARGV[5]) end
    return ARGV[2]
  end
end
return st
""", uses=(BATCH_ENDED,))

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

# ==== The worker registry (lmdq.redis.registry) ======================================================

# KEYS: models, worker hash, workers set, rq worker hash, rq workers set, rq workers-by-queue sets...
# ARGV: models (comma-separated: the worker's, then its LoRA adapters'), ttl, pid, worker name, rq queues
# (comma-separated), hostname, rq version, python version
WORKER_REGISTER = LuaScript("worker_register", """
local first = nil
for m in string.gmatch(ARGV[1], '[^,]+') do
  redis.call('HSET', KEYS[1], m, now)
  first = first or m
end
redis.call('HSET', KEYS[2], 'model', first, 'served', ARGV[1], 'started_at', now, 'last_heartbeat', now,
  'pid', ARGV[3])
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
redis.call('SADD', KEYS[3], ARGV[4])
local stamp = utc()
redis.call('DEL', KEYS[4])
redis.call('HSET', KEYS[4], 'birth', stamp, 'last_heartbeat', stamp, 'queues', ARGV[5], 'pid', ARGV[3],
  'hostname', ARGV[6], 'ip_address', '', 'version', ARGV[7], 'python_version', ARGV[8], 'state', 'idle',
  'successful_job_count', 0, 'failed_job_count', 0, 'total_working_time', 0)
redis.call('EXPIRE', KEYS[4], tonumber(ARGV[2]))
for i = 5, #KEYS do redis.call('SADD', KEYS[i], KEYS[4]) end
return 1
""", uses=(RQ_CLOCK,))

# KEYS: models, worker hash, rq worker hash.  ARGV: models (comma-separated), ttl, rq state, jobs done, failed
WORKER_BEAT = LuaScript("worker_beat", """
redis.call('HSET', KEYS[2], 'last_heartbeat', now)
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
for m in string.gmatch(ARGV[1], '[^,]+') do redis.call('HSET', KEYS[1], m, now) end
redis.call('HSET', KEYS[3], 'last_heartbeat', utc(), 'state', ARGV[3],
  'successful_job_count', ARGV[4], 'failed_job_count', ARGV[5])
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[2]))
return 1
""", uses=(RQ_CLOCK,))
