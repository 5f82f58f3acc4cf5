"""The gates' state in Redis: the config, the canary's jobs, the held jobs, the judged entries, the
verdict and the report; and the scripts that release, pause and resume a batch.

Keys (:class:`lmdq.redis.keys.Keys`; all expire with the batch: ``lmdq_batch_ended``):

==============================  ===================================================================
``P:batch:<id>:gates``          hash: ``config`` (GateConfig JSON), ``queue_key`` / ``queues`` / ``wakes``
                                (where held jobs go), ``pending`` (canary jobs not judged yet),
                                ``verdict`` (passed | failed | paused | resumed), ``report`` (JSON)
``P:batch:<id>:gates:canary``   set: the canary's job ids (the commit queues only these)
``P:batch:<id>:gates:held``     list: job ids held off the queue (written by the commit, then here)
``P:batch:<id>:gates:seen``     list: judged entries (the canary's; then the rolling window's, newest first)
``P:batch:<id>:gates:jobs``     set: job numbers judged already (a job judged twice counts once)
==============================  ===================================================================

Why scripts: a verdict and what it does (jobs onto the queue, or the batch paused with its queued jobs
taken off) must be one step, fenced, whichever worker gets there first and however often it is re-sent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import redis

from lmdq.batches.batch_jobs import PUSH_JOBS, RQ_QUEUES
from lmdq.contract import BatchStatus
from lmdq.gates.config import GateConfig
from lmdq.redis.keys import BatchField, Keys
from lmdq.redis.replies import reply_text
from lmdq.redis.scripts import WAKE, Fragment, LuaScript
from lmdq.webhooks.store import WEBHOOK_EVENT

__all__ = ["GateState", "GateStore"]

F = BatchField


class GateState:
    """What ``status`` shows of a batch's gates (read once, untrusted: bad JSON reads as absent)."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.config: GateConfig | None = None
        self.report: dict[str, Any] | None = None
        try:
            self.config = GateConfig.model_validate_json(raw.get("config") or "")
        except ValueError:
            pass
        try:
            rep = json.loads(raw.get("report") or "null")
            self.report = rep if isinstance(rep, dict) else None
        except ValueError:
            pass
        self.verdict: str | None = raw.get("verdict")
        try:
            self.pending = int(raw.get("pending") or 0)
        except ValueError:
            self.pending = 0
        self.held = 0

    def as_dict(self) -> dict[str, Any]:
        return {"config": self.config.model_dump(exclude_none=True) if self.config else None,
                "verdict": self.verdict, "canary_jobs_left": self.pending, "held_jobs": self.held,
                "report": self.report}


class GateStore:
    """The gates of the batches of one key prefix."""

    def __init__(self, client: redis.Redis, *, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._record = RECORD.bind(client)
        self._release = RELEASE.bind(client)
        self._pause = PAUSE.bind(client)
        self._resume = RESUME.bind(client)

    def hold_keys(self, batch_id: str) -> tuple[str, str]:
        """(canary set, held list): what the batch's commit reads and appends to."""
        return self.keys.gates_canary(batch_id), self.keys.gates_held(batch_id)

    def all_keys(self, batch_id: str) -> list[str]:
        k = self.keys
        return [k.gates(batch_id), k.gates_canary(batch_id), k.gates_held(batch_id), k.gates_seen(batch_id),
                k.gates_jobs(batch_id)]

    def create(self, batch_id: str, config: GateConfig, *, canary_job_ids: Sequence[str], queue_key: str,
               queues: Sequence[str], wakes: Sequence[str], ttl_s: int) -> None:
        """Write the batch's gates before its commit (one round trip)."""
        with self.client.pipeline(transaction=True) as p:
            p.delete(*self.all_keys(batch_id))
            p.hset(self.keys.gates(batch_id), mapping={
                "config": config.model_dump_json(exclude_none=True), "queue_key": queue_key,
                "queues": json.dumps(list(queues)), "wakes": json.dumps(list(wakes)),
                "pending": len(canary_job_ids)})
            p.expire(self.keys.gates(batch_id), ttl_s)
            for s in range(0, len(canary_job_ids), 1000):
                p.sadd(self.keys.gates_canary(batch_id), *canary_job_ids[s : s + 1000])
            p.expire(self.keys.gates_canary(batch_id), ttl_s)
            p.execute()

    def delete(self, batch_id: str) -> None:
        """Every gates key of the batch (a rolled-back submit)."""
        self.client.delete(*self.all_keys(batch_id))

    def state(self, batch_id: str) -> GateState | None:
        """The batch's gates as ``status`` shows them; None when it has none (one round trip)."""
        with self.client.pipeline(transaction=False) as p:
            p.hgetall(self.keys.gates(batch_id))
            p.llen(self.keys.gates_held(batch_id))
            raw, held = p.execute()
        if not raw:
            return None
        st = GateState({reply_text(k): reply_text(v) for k, v in raw.items()})
        st.held = int(held)
        return st

    def config(self, batch_id: str) -> GateConfig | None:
        raw = self.client.hget(self.keys.gates(batch_id), "config")
        if raw is None:
            return None
        try:
            return GateConfig.model_validate_json(raw)
        except ValueError:
            return None

    def record(self, batch_id: str, job_id: str, job_no: int, entries: Sequence[dict[str, Any]],
               window: int | None) -> tuple[str, list[dict[str, Any]]]:
        """Add a job's judged entries. Returns what to judge now: ('canary', every canary entry) when this
        was the canary's last job, ('window', the newest ``window``) once the window is full, else
        ('wait' | 'dup' | 'none', [])."""
        k = self.keys
        reply = self._record(keys=[k.gates(batch_id), k.gates_canary(batch_id), k.gates_seen(batch_id),
                                   k.gates_jobs(batch_id), k.batch(batch_id)],
                             args=[job_id, job_no, window or 0, *[json.dumps(e) for e in entries]])
        phase = reply_text(reply[0])
        out: list[dict[str, Any]] = []
        for raw in reply[1:]:
            try:
                e = json.loads(raw)
            except ValueError:
                continue
            if isinstance(e, dict):
                out.append(e)
        return phase, out

    def _where(self, batch_id: str) -> tuple[str, list[str], list[str]]:
        qkey, queues, wakes = self.client.hmget(self.keys.gates(batch_id), ["queue_key", "queues", "wakes"])
        return (reply_text(qkey) if qkey is not None else "", json.loads(queues or "[]"), json.loads(wakes or "[]"))

    def release(self, batch_id: str) -> int:
        """The canary passed: its held jobs onto the queue, once. Returns the jobs queued; -1 when a verdict
        was given already, -2 when the batch is not running any more (cancelled: cancel answers them)."""
        qkey, _, wakes = self._where(batch_id)
        k = self.keys
        return int(self._release(keys=[k.gates(batch_id), k.gates_held(batch_id), k.batch(batch_id),
                                       k.gates_seen(batch_id), RQ_QUEUES, *wakes], args=[qkey]))

    def pause(self, batch_id: str, report: dict[str, Any], *, verdict: str) -> int:
        """A gate failed: the batch ``paused`` with ``report``, its jobs still on a queue taken off and held.
        Returns 1 when paused now, 0 when it was not running (paused, ended, cancelled) or a canary verdict
        was given already."""
        _, queues, _ = self._where(batch_id)
        k = self.keys
        return int(self._pause(keys=[k.gates(batch_id), k.batch(batch_id), k.gates_held(batch_id), *queues],
                               args=[json.dumps(report), verdict, time.time(), f"{batch_id}-"]))

    def resume(self, batch_id: str) -> int:
        """Run the rest of a paused batch: its held jobs onto the queue, the rolling window started afresh.
        Returns the jobs queued; -1 when the batch is not paused."""
        qkey, _, wakes = self._where(batch_id)
        k = self.keys
        return int(self._resume(keys=[k.gates(batch_id), k.gates_held(batch_id), k.batch(batch_id),
                                      k.gates_seen(batch_id), RQ_QUEUES, *wakes], args=[qkey, time.time()]))


# ==== Lua ====
_RUNNING = f"st == '{BatchStatus.queued.value}' or st == '{BatchStatus.in_progress.value}'"

# KEYS: gates hash, canary set, seen list, judged-jobs set, batch hash. ARGV: job id, job no, window, entries...
# Returns {phase, entries...}: 'dup' (the job was judged), 'canary' + every canary entry (its last job),
# 'window' + the newest window entries (the window full), 'wait' (more to come), 'none' (nothing to judge).
RECORD = LuaScript("gates_record", f"""
if redis.call('EXISTS', KEYS[1]) == 0 then return {{'none'}} end
if redis.call('SADD', KEYS[4], ARGV[2]) == 0 then return {{'dup'}} end
local ttl = redis.call('TTL', KEYS[1])
if ttl > 0 then redis.call('EXPIRE', KEYS[4], ttl) end
local verdict = redis.call('HGET', KEYS[1], 'verdict')
if not verdict and redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then
  for i = 4, #ARGV do redis.call('RPUSH', KEYS[3], ARGV[i]) end
  if ttl > 0 then redis.call('EXPIRE', KEYS[3], ttl) end
  if redis.call('HINCRBY', KEYS[1], 'pending', -1) > 0 then return {{'wait'}} end
  local out = redis.call('LRANGE', KEYS[3], 0, -1)
  table.insert(out, 1, 'canary')
  return out
end
local window = tonumber(ARGV[3])
local st = redis.call('HGET', KEYS[5], '{F.status}')
if window <= 0 or not ({_RUNNING}) or verdict == 'failed' then return {{'none'}} end
for i = 4, #ARGV do redis.call('LPUSH', KEYS[3], ARGV[i]) end
redis.call('LTRIM', KEYS[3], 0, window - 1)
if ttl > 0 then redis.call('EXPIRE', KEYS[3], ttl) end
if redis.call('LLEN', KEYS[3]) < window then return {{'wait'}} end
local out = redis.call('LRANGE', KEYS[3], 0, -1)
table.insert(out, 1, 'window')
return out
""")

# ``lmdq_push_held(held, qkey, queues, bkey)``: every job id on the list ``held`` onto its queue (PUSH_JOBS'
# rules: in the batch ``bkey``'s deadline order), the list deleted; returns how many.
PUSH_HELD = Fragment("push_held", """
local function lmdq_push_held(held, qkey, queues, bkey)
  local n = redis.call('LLEN', held)
  for s = 0, n - 1, 4000 do
    lmdq_push(qkey, redis.call('LRANGE', held, s, s + 3999), queues, bkey)
  end
  redis.call('DEL', held)
  return n
end
""", uses=(PUSH_JOBS,))

# KEYS: gates hash, held list, batch hash, seen list, rq queues set, wake lists... ARGV: queue key.
RELEASE = LuaScript("gates_release", f"""
if redis.call('HSETNX', KEYS[1], 'verdict', 'passed') == 0 then return -1 end
local st = redis.call('HGET', KEYS[3], '{F.status}')
if not ({_RUNNING}) then return -2 end
local n = lmdq_push_held(KEYS[2], ARGV[1], KEYS[5], KEYS[3])
redis.call('DEL', KEYS[4])
if n > 0 then for i = 6, #KEYS do lmdq_wake(KEYS[i]) end end
return n
""", uses=(WAKE, PUSH_HELD))

# KEYS: gates hash, batch hash, held list, the batch's queue lists... ARGV: report JSON, verdict ('failed': the
# canary's, fenced like RELEASE; 'paused': the window's), now, job id prefix.
PAUSE = LuaScript("gates_pause", f"""
local st = redis.call('HGET', KEYS[2], '{F.status}')
if not ({_RUNNING}) then return 0 end
if ARGV[2] == 'failed' then
  if redis.call('HSETNX', KEYS[1], 'verdict', 'failed') == 0 then return 0 end
else
  redis.call('HSET', KEYS[1], 'verdict', ARGV[2])
end
redis.call('HSET', KEYS[2], '{F.status}', '{BatchStatus.paused.value}')
lmdq_webhook_event(KEYS[2], 'paused')  -- issue 48: batch.paused, in the same step as the status
redis.call('HSET', KEYS[1], 'report', ARGV[1], 'paused_at', ARGV[3])
local p = ARGV[4]
for q = 4, #KEYS do
  local ids = redis.call('LRANGE', KEYS[q], 0, -1)
  local keep, mine = {{}}, {{}}
  for _, id in ipairs(ids) do
    if string.sub(id, 1, string.len(p)) == p then table.insert(mine, id) else table.insert(keep, id) end
  end
  if #mine > 0 then
    redis.call('DEL', KEYS[q])
    for s = 1, #keep, 4000 do redis.call('RPUSH', KEYS[q], unpack(keep, s, math.min(s + 3999, #keep))) end
    for s = 1, #mine, 4000 do redis.call('RPUSH', KEYS[3], unpack(mine, s, math.min(s + 3999, #mine))) end
  end
end
local ttl = redis.call('TTL', KEYS[1])
if ttl > 0 and redis.call('EXISTS', KEYS[3]) == 1 then redis.call('EXPIRE', KEYS[3], ttl) end
return 1
""", uses=(WEBHOOK_EVENT,))

# KEYS: gates hash, held list, batch hash, seen list, rq queues set, wake lists... ARGV: queue key, now.
RESUME = LuaScript("gates_resume", f"""
if redis.call('HGET', KEYS[3], '{F.status}') ~= '{BatchStatus.paused.value}' then return -1 end
local n = lmdq_push_held(KEYS[2], ARGV[1], KEYS[5], KEYS[3])
redis.call('DEL', KEYS[4])
local to = '{BatchStatus.queued.value}'
if redis.call('HEXISTS', KEYS[3], '{F.in_progress_at}') == 1 then to = '{BatchStatus.in_progress.value}' end
redis.call('HSET', KEYS[3], '{F.status}', to)
redis.call('HSET', KEYS[1], 'verdict', 'resumed', 'resumed_at', ARGV[2])
if n > 0 then for i = 6, #KEYS do lmdq_wake(KEYS[i]) end end
return n
""", uses=(WAKE, PUSH_HELD))
