"""The store of a batch's jobs as the ledger moves them: staged writes, the job list
(``Keys.batch_jobs``), the commit that makes them visible, the rollback of what a failed submit staged,
and what ``cancel``, ``purge`` and ``retry`` read of them (on a queue, under a live lease, which fields).

Why a module of its own: when jobs may be staged, committed, rolled back, cancelled or purged is the
ledger's rule (:mod:`lmdq.submission.ledger`); the commands and the commit scripts' Lua are here, in the
batches' store (tests/test_redis_boundary.py). A job hash itself is written by
:class:`lmdq.jobs.queue.JobQueue` into the pipeline :meth:`BatchJobs.writes` hands out, so a submit's
staging still goes to Redis in few round trips. Replies are handed back raw or as plain numbers; the
callers check them (untrusted).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from rq.job import Job, JobStatus

from lmdq.contract import BatchStatus
from lmdq.redis.keys import BatchField, Keys, rq_queue_key
from lmdq.redis.replies import reply_text
from lmdq.redis.scripts import WAKE, Fragment, LuaScript

__all__ = ["RQ_QUEUES", "BatchJobs", "JobWrites"]

RQ_QUEUES = "rq:queues"
"""RQ's set of known queue keys (what ``rq info`` lists); RQ owns the name."""

_COMMIT_CHUNK = 4000
"""Job ids the commit script reads and pushes per step (one LRANGE/RPUSH each, inside the script)."""

_DELETE_CHUNK = 1000
"""Keys per DEL: a rollback of a million jobs never builds one huge command."""

_LEASE_CHUNK = 500
"""Job ids per ZMSCORE round trip when counting live leases."""


def _raw(value: Any) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return str(value).encode()


def _score(value: Any) -> float | None:
    return None if value is None else float(value)


class JobWrites:
    """One submit's staged writes: a pipeline that :meth:`lmdq.jobs.queue.JobQueue.stage` queues job hashes
    on, sent by :meth:`flush` (every chunk of jobs, and at the end)."""

    def __init__(self, pipe: redis.client.Pipeline) -> None:
        #: the pipeline to hand to ``JobQueue.stage(pipe=...)``; only this object sends it
        self.pipe = pipe

    def flush(self) -> None:
        """Send what is queued (one round trip). A refused write raises here, as redis-py raises it."""
        self.pipe.execute()


class BatchJobs:
    """The jobs of the batches of one key prefix (thread-safe: redis-py clients are)."""

    def __init__(self, client: redis.Redis, *, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._commit = COMMIT.bind(client)
        self._commit_upto = COMMIT_UPTO.bind(client)
        self._find_prefix = FIND_PREFIX.bind(client)
        self._remove_prefix = REMOVE_PREFIX.bind(client)
        self._reschedule = RESCHEDULE.bind(client)

    # ---- staging and commit -------------------------------------------------------------------
    @contextmanager
    def writes(self) -> Iterator[JobWrites]:
        """A pipeline for staging (no MULTI: a submit of a million jobs must not hold the server), reset
        when the block ends, whatever was left unsent."""
        with self.client.pipeline(transaction=False) as p:
            yield JobWrites(p)

    def _commit_keys(self, batch_id: str, queue_key: str, wakes: Sequence[str]) -> list[str]:
        # KEYS of COMMIT / COMMIT_UPTO: no queue key ('' pushes each job onto its own model's queue) needs a
        # placeholder key in its slot, RQ's queue set (never written as a list)
        return [self.keys.batch_jobs(batch_id), queue_key or RQ_QUEUES, RQ_QUEUES, self.keys.batch(batch_id),
                *wakes]

    def commit(self, *, batch_id: str, queue_key: str, wakes: Sequence[str], now: float, ttl_s: int,
               hold: tuple[str, str] | None = None) -> int:
        """Every staged job of the batch onto its queue (``queue_key``, or '' for each job's own model's
        queue), the record ``queued``, every key of the batch at ``ttl_s``, one token on each of ``wakes``:
        one script, fenced on ``queued_at``. Returns the jobs made visible, -1 when it had run already.

        ``hold``: (a set of job ids, a list): a canary (lmdq.gates). Only the set's jobs are queued; every
        other job goes onto the list, in job order, until the canary's verdict releases it. Both keys are
        the caller's (the gates' store owns them); this script only reads the set and appends to the list."""
        keys = self._commit_keys(batch_id, queue_key, wakes)
        keys[4:4] = list(hold) if hold else [RQ_QUEUES, RQ_QUEUES]  # placeholders, never touched unheld
        return int(self._commit(keys=keys, args=[queue_key, _COMMIT_CHUNK, now, ttl_s, "1" if hold else "0"]))

    def commit_upto(self, *, batch_id: str, queue_key: str, wakes: Sequence[str], jobs: int, requests: int,
                    now: float, ttl_s: int, last: bool, token: str = "") -> int:
        """Progressive staging: the staged jobs up to ``jobs`` (``requests`` requests) become visible, as
        :meth:`commit` does for all of them, only while the staging lease holds ``token`` ('': unfenced).
        Returns the jobs made visible, -1 when they were already, -2 when the batch is no longer live
        (cancelled while it was being staged), -3 when the lease is not ``token``'s."""
        keys = self._commit_keys(batch_id, queue_key, wakes)
        keys.insert(4, self.keys.staging_lease(batch_id))
        return int(self._commit_upto(keys=keys,
                                     args=[queue_key, jobs, requests, now, ttl_s, "1" if last else "0", token]))

    def reschedule(self, batch_id: str, *, queue_keys: Sequence[str], deadline: float, job_prefix: str) -> int:
        """Set the batch's deadline and move its waiting jobs on ``queue_keys`` to their new place
        (earliest deadline first), one script call. Returns the jobs moved."""
        return int(self._reschedule(keys=[self.keys.batch(batch_id), *queue_keys], args=[deadline, job_prefix]))

    # ---- the job list -------------------------------------------------------------------------
    def job_ids(self, batch_id: str, start: int = 0) -> list[str]:
        """The batch's job list from position ``start`` on, in job order (decoded with replacement)."""
        return [reply_text(j) for j in self.client.lrange(self.keys.batch_jobs(batch_id), start, -1)]

    # ---- rollback and abandon -----------------------------------------------------------------
    def staged(self, batch_id: str, candidates: Sequence[str]) -> tuple[list[str], bool]:
        """Which of ``candidates`` (keys a submit may have written) exist, and whether the batch is listed:
        one read-only round trip, so a rollback against a read-only replica writes nothing."""
        with self.client.pipeline(transaction=False) as p:
            for key in candidates:
                p.exists(key)
            p.zscore(self.keys.batches(), batch_id)
            *exists, listed_at = p.execute()
        return [key for key, n in zip(candidates, exists) if n], listed_at is not None

    def unstage(self, batch_id: str, present: Sequence[str]) -> None:
        """Delete ``present`` (what :meth:`staged` found) and the batch's listing entry, in one round trip."""
        with self.client.pipeline(transaction=False) as p:
            for start in range(0, len(present), _DELETE_CHUNK):
                p.delete(*present[start : start + _DELETE_CHUNK])
            p.zrem(self.keys.batches(), batch_id)
            p.execute()

    def drop_unqueued(self, batch_id: str, job_ids: Sequence[str], *, keep: int) -> None:
        """Delete the job hashes of ``job_ids`` and cut the job list to its first ``keep`` entries (the jobs
        a part-staged batch made visible), in one round trip."""
        job_keys = [Job.key_for(j) for j in job_ids]
        with self.client.pipeline(transaction=False) as p:
            for start in range(0, len(job_keys), _DELETE_CHUNK):
                p.delete(*job_keys[start : start + _DELETE_CHUNK])
            p.ltrim(self.keys.batch_jobs(batch_id), 0, keep - 1)
            p.execute()

    # ---- queues and leases (cancel, purge, in_flight) ------------------------------------------
    def queued(self, queue_key: str, id_prefix: str) -> list[str]:
        """Ids on the queue list ``queue_key`` that start with ``id_prefix`` (a read-only script)."""
        return [reply_text(j) for j in self._find_prefix(keys=[queue_key], args=[id_prefix])]

    def dequeue(self, queue_key: str, id_prefix: str) -> list[str]:
        """Take every id starting with ``id_prefix`` off the queue list ``queue_key`` (one pass over the
        list, in a script); returns the ids taken."""
        return [reply_text(j) for j in self._remove_prefix(keys=[queue_key], args=[id_prefix])]

    def mark_canceled(self, job_id: str) -> None:
        """RQ's status of the job hash: ``canceled`` (what ``rq info`` shows for a job cancel took off)."""
        self.client.hset(Job.key_for(job_id), "status", JobStatus.CANCELED.value)

    def lease_deadlines(self, job_ids: Sequence[str]) -> list[float | None]:
        """Each job's lease deadline (server clock; None: not leased), a round trip per chunk of ids."""
        out: list[float | None] = []
        for start in range(0, len(job_ids), _LEASE_CHUNK):
            out += map(_score, self.client.zmscore(self.keys.leases(), list(job_ids[start : start + _LEASE_CHUNK])))
        return out

    def leases_and_fields(self, job_ids: Sequence[str],
                          fields: Sequence[str]) -> list[tuple[float | None, list[bytes | None]]]:
        """For each job: its lease deadline (None: not leased) and ``fields`` of its job hash (raw, None:
        missing), in one round trip."""
        if not job_ids:
            return []
        with self.client.pipeline(transaction=False) as p:
            p.zmscore(self.keys.leases(), list(job_ids))
            for jid in job_ids:
                p.hmget(Job.key_for(jid), list(fields))
            leases, *values = p.execute()
        return [(_score(lease), [_raw(v) for v in vs]) for lease, vs in zip(leases, values)]


F = BatchField

# ==== Lua: this module's scripts (composed and run by lmdq.redis.scripts.LuaScript) ====

# Earliest deadline first (issue 46). ``lmdq_place(k, ids, dl, bkey)``: push job ids onto queue list ``k``
# so that the list stays in deadline order: ``dl`` (the batch's deadline, nil for none) places them before
# the first job whose batch has a later deadline or none (each job's batch read once, from its record's
# ``deadline`` field; ``bkey`` is this batch's record key, whose prefix names the others'); no deadline
# appends, as a FIFO queue does. Jobs of one batch keep their order; a job re-queued to the front stays
# there. The scan stops at the insertion point and reads the list 1,000 at a time; a batch without a
# deadline costs nothing more than before.
PLACE_JOBS = Fragment("place_jobs", f"""
local function lmdq_rpush(k, ids)
  for s = 1, #ids, 4000 do
    redis.call('RPUSH', k, unpack(ids, s, math.min(s + 3999, #ids)))
  end
end
local function lmdq_place(k, ids, dl, bkey)
  if #ids == 0 then return end
  if not dl then lmdq_rpush(k, ids); return end
  local base = string.match(bkey, '^(.*:batch:)[^:]+$')
  local n = redis.call('LLEN', k)
  local pos, seen = n, {{}}
  for start = 0, n - 1, 1000 do
    local found = false
    for i, id in ipairs(redis.call('LRANGE', k, start, start + 999)) do
      local bid = string.match(id, '^(.+)%-%d+$') or id
      local d = seen[bid]
      if d == nil then
        d = tonumber(redis.call('HGET', base .. bid, '{F.deadline}') or '') or false
        seen[bid] = d
      end
      if (not d) or d > dl then pos = start + i - 1; found = true; break end
    end
    if found then break end
  end
  if pos >= n then lmdq_rpush(k, ids); return end
  local tail = redis.call('LRANGE', k, pos, -1)
  if pos == 0 then redis.call('DEL', k) else redis.call('LTRIM', k, 0, pos - 1) end
  lmdq_rpush(k, ids)
  lmdq_rpush(k, tail)
end
""")

# ``lmdq_push(qkey, ids, queues, bkey)``: push job ids onto queue key ``qkey``, or, when it is '' (a batch
# over several models), each onto its own model's queue, the one its job hash names as ``origin`` (the
# ledger's stage wrote it); every queue used joins RQ's set of queues ``queues``. In deadline order: ``bkey``
# is the batch's record, whose ``deadline`` field places its jobs (``lmdq_place``).
PUSH_JOBS = Fragment("push_jobs", f"""
local function lmdq_push(qkey, ids, queues, bkey)
  if #ids == 0 then return end
  local dl = tonumber(redis.call('HGET', bkey, '{F.deadline}') or '')
  if qkey ~= '' then
    lmdq_place(qkey, ids, dl, bkey)
    redis.call('SADD', queues, qkey)
    return
  end
  local per, order = {{}}, {{}}
  for _, id in ipairs(ids) do
    local q = redis.call('HGET', '{Job.redis_job_namespace_prefix}' .. id, 'origin')
    if q then
      local k = '{rq_queue_key("")}' .. q
      if not per[k] then per[k] = {{}}; table.insert(order, k) end
      table.insert(per[k], id)
    end
  end
  for _, k in ipairs(order) do
    lmdq_place(k, per[k], dl, bkey)
    redis.call('SADD', queues, k)
  end
end
""", uses=(PLACE_JOBS,))

# KEYS: batch jobs list, rq queue list, rq queues set, batch hash, canary set, held list, the wake list of each
# model of the batch. ARGV: queue key ('': each job to its own model's queue, see PUSH_JOBS), chunk, now,
# running ttl, '1' when the batch has a canary (only the canary set's jobs are queued, the rest go onto the
# held list in job order; '0': KEYS[5] and KEYS[6] are placeholders, never touched).
# Returns the number of jobs made visible, or -1 when the batch was committed already (fence).
# Every key of the batch takes the running TTL here (lmdq.results.store: TTLs count from the batch's end).
COMMIT = LuaScript("commit", f"""
if redis.call('HEXISTS', KEYS[4], '{F.queued_at}') == 1 then return -1 end
local n = redis.call('LLEN', KEYS[1])
local chunk = tonumber(ARGV[2])
local gated = ARGV[5] == '1'
local visible = 0
for s = 0, n - 1, chunk do
  local ids = redis.call('LRANGE', KEYS[1], s, s + chunk - 1)
  if gated then
    local now_ids, later = {{}}, {{}}
    for _, id in ipairs(ids) do
      if redis.call('SISMEMBER', KEYS[5], id) == 1 then table.insert(now_ids, id) else table.insert(later, id) end
    end
    lmdq_push(ARGV[1], now_ids, KEYS[3], KEYS[4])
    for h = 1, #later, 4000 do redis.call('RPUSH', KEYS[6], unpack(later, h, math.min(h + 3999, #later))) end
    visible = visible + #now_ids
  else
    lmdq_push(ARGV[1], ids, KEYS[3], KEYS[4])
    visible = visible + #ids
  end
  for _, id in ipairs(ids) do redis.call('EXPIRE', '{Job.redis_job_namespace_prefix}' .. id, ARGV[4]) end
end
if gated then
  redis.call('EXPIRE', KEYS[5], ARGV[4])
  if redis.call('EXISTS', KEYS[6]) == 1 then redis.call('EXPIRE', KEYS[6], ARGV[4]) end
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
if visible > 0 then for i = 7, #KEYS do lmdq_wake(KEYS[i]) end end
return visible
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
lmdq_push(ARGV[1], ids, KEYS[3], KEYS[4])
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

# KEYS: batch hash, then each queue list of the batch's models.  ARGV: new deadline (Unix time), job id prefix.
# Moves a batch's deadline (issue 46): the field, then its jobs still waiting on each queue taken off it and
# placed again (``lmdq_place``), so claims see the new order at once. Returns the jobs moved.
RESCHEDULE = LuaScript("reschedule", f"""
redis.call('HSET', KEYS[1], '{F.deadline}', ARGV[1])
local dl = tonumber(ARGV[1])
local p = ARGV[2]
local moved = 0
for i = 2, #KEYS do
  local keep, mine = {{}}, {{}}
  for _, id in ipairs(redis.call('LRANGE', KEYS[i], 0, -1)) do
    if string.sub(id, 1, string.len(p)) == p then table.insert(mine, id) else table.insert(keep, id) end
  end
  if #mine > 0 then
    redis.call('DEL', KEYS[i])
    lmdq_rpush(KEYS[i], keep)
    lmdq_place(KEYS[i], mine, dl, KEYS[1])
    moved = moved + #mine
  end
end
return moved
""", uses=(PLACE_JOBS,))
