"""The registries: which workers are alive, which models are known, which batches are cancelled.

A worker's record is a hash with a TTL that its heartbeat renews, so a dead worker disappears on its
own; the models hash (model -> last seen) records what workers have served. Timestamps come from
the Redis server's clock (TIME), like leases: a worker with a wrong clock must not look dead or
stale. The worker never speaks Redis itself; it calls this and :class:`lmdq.jobs.queue.JobQueue`.

Each worker also keeps an RQ worker record (``rq:worker:<name>`` in ``rq:workers`` and in
``rq:workers:<queue>`` for each of its queues), written by the same scripts, so ``rq info`` and
rq-dashboard list lmdq workers with their queues, state (busy/idle), birth and last heartbeat. Its
current jobs are RQ's executions, which :meth:`lmdq.jobs.queue.JobQueue.mark_started` already records
under the same worker name. The RQ hash has the same TTL as lmdq's: a killed worker drops out of
``rq info`` by itself (RQ prunes set members whose hash is gone).

``submit`` checks a model name against :class:`ModelRegistry`: the models workers have served PLUS
the models an operator registered (``lmdq-producer models add``, or the deployment's one-shot
registration). The second half is what lets an autoscaled deployment start from zero workers: the
first submit must be accepted, or the autoscaler never sees work and no worker ever starts.
"""

from __future__ import annotations

import json
import math
import socket
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from rq.version import VERSION as RQ_VERSION

from lmdq.redis.keys import (
    MAX_MODEL_NAME,
    Keys,
    check_model_name,
    queue_names,
    rq_worker_executions_key,
    rq_worker_key,
    rq_workers_by_queue_key,
    rq_workers_key,
)
from lmdq.redis.replies import reply_text
from lmdq.redis.scripts import Fragment, LuaScript
from lmdq.registry import MAX_NOTE

__all__ = [
    "MAX_MODEL_NAME",
    "MAX_NOTE",
    "ModelInfo",
    "ModelRegistry",
    "RQ_BUSY",
    "RQ_IDLE",
    "RemovedModel",
    "WorkerRegistry",
    "check_model_name",
    "redis_answers",
]

RQ_IDLE = "idle"
RQ_BUSY = "busy"
"""RQ's worker states (``rq info`` draws idle and busy workers differently)."""





class WorkerRegistry:
    """One worker's records in Redis (thread-safe: redis-py clients are)."""

    def __init__(self, client: redis.Redis, *, keys: Keys, name: str, model: str, ttl_s: float,
                 adapters: Sequence[str] = ()) -> None:
        self.client = client
        self.keys = keys
        self.name = name
        self.model = check_model_name(model)
        #: every model name the worker serves: its own, then its LoRA adapters' (``--adapter``), all known to submit
        self.models = [self.model, *(check_model_name(a) for a in adapters)]
        #: the queues the worker drains, as RQ's record lists them
        self.queues = [q for m in self.models for q in queue_names(m, keys.prefix)]
        #: the worker hash outlives a missed beat by a second; a dead worker's record expires by itself
        self.ttl_s = max(1, int(ttl_s) + 1)
        self._register = WORKER_REGISTER.bind(client)
        self._beat = WORKER_BEAT.bind(client)

    def _rq_set_keys(self) -> list[str]:
        return [rq_workers_key(), *(rq_workers_by_queue_key(q) for q in self.queues)]

    def register(self, *, pid: int) -> None:
        """Announce the worker and its model (``submit`` accepts models a worker has served), to lmdq
        and to RQ."""
        py = sys.version.split(" ", 1)[0]
        self._register(
            keys=[self.keys.models(), self.keys.worker(self.name), self.keys.workers(),
                  rq_worker_key(self.name), *self._rq_set_keys()],
            args=[",".join(self.models), self.ttl_s, pid, self.name, ",".join(self.queues), socket.gethostname(),
                  RQ_VERSION, py],
        )

    def beat(self, *, busy: bool = False, done: int = 0, failed: int = 0) -> None:
        """Renew the worker records and the model's last-seen time. ``busy``: the worker holds jobs
        now (RQ's state); ``done``/``failed``: jobs it has finished so far (RQ's job counts)."""
        self._beat(
            keys=[self.keys.models(), self.keys.worker(self.name), rq_worker_key(self.name)],
            args=[",".join(self.models), self.ttl_s, RQ_BUSY if busy else RQ_IDLE, max(0, done), max(0, failed)],
        )

    def deregister(self) -> None:
        """Remove the worker records, lmdq's and RQ's (the model stays known: it has been served)."""
        rq_key = rq_worker_key(self.name)
        with self.client.pipeline() as p:
            p.delete(self.keys.worker(self.name))
            p.srem(self.keys.workers(), self.name)
            p.delete(rq_key, rq_worker_executions_key(self.name))
            for k in self._rq_set_keys():
                p.srem(k, rq_key)
            p.execute()

    def cancelled_batches(self) -> set[str]:
        """Ids of batches being cancelled (workers abort their in-flight requests)."""
        raw = self.client.smembers(self.keys.cancelled())
        return {b.decode(errors="replace") if isinstance(b, bytes) else str(b) for b in raw}

    def ping(self) -> bool:
        """Is Redis answering? (the health endpoint's readiness check)"""
        return redis_answers(self.client)


def redis_answers(client: redis.Redis) -> bool:
    """Is Redis answering? For the health endpoint, which asks before the worker (and its registry)
    exists: while the engine loads."""
    return bool(client.ping())




def _time(value: Any) -> float | None:
    """A timestamp read back from Redis (untrusted): a finite non-negative number, else None."""
    try:
        t = float(reply_text(value))
    except (TypeError, ValueError):
        return None
    return t if math.isfinite(t) and t >= 0 else None


@dataclass(frozen=True)
class ModelInfo:
    """One model as ``models list`` shows it: who made it known, and whether anything serves it."""

    name: str
    registered: bool
    #: server time of the operator's registration (its latest ``models add``)
    registered_at: float | None
    note: str | None
    #: server time a worker last announced or beat for this model; None if none ever did
    last_seen: float | None
    #: workers whose record is alive now (their heartbeat TTL has not run out)
    live_workers: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "registered": self.registered,
            "registered_at": self.registered_at,
            "note": self.note,
            "last_seen": self.last_seen,
            "live_workers": self.live_workers,
        }


@dataclass(frozen=True)
class RemovedModel:
    """What ``models remove`` deleted, and what will bring the model back."""

    name: str
    registered: bool
    seen: bool
    #: live workers of the model: their next heartbeat records it as served again
    live_workers: int


class ModelRegistry:
    """The models ``submit`` accepts: registered by an operator, or served by some worker.

    The two are kept in two hashes on purpose. Workers write ``Keys.models`` on every heartbeat and
    never delete from it; operators write ``Keys.registered_models``, and a note and a registration
    time only mean something there. ``remove`` deletes from both, so a retired model is refused again
    (unless a live worker still serves it: its next beat announces it again, which ``remove`` reports).
    """

    def __init__(self, client: redis.Redis, *, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    def known(self) -> set[str]:
        """Every model name ``submit`` accepts without ``--allow-unknown-model``."""
        with self.client.pipeline(transaction=False) as p:
            p.hkeys(self.keys.registered_models())
            p.hkeys(self.keys.models())
            registered, seen = p.execute()
        return {reply_text(m) for m in registered} | {reply_text(m) for m in seen}

    def add(self, name: str, *, note: str | None = None) -> bool:
        """Register ``name`` (with an optional note); True if it was not registered before.

        Adding again replaces the note and the registration time: the deployment's one-shot runs it
        on every apply, and the latest registration is the one worth showing."""
        check_model_name(name)
        if note is not None and len(note) > MAX_NOTE:
            raise ValueError(f"expected a note of at most {MAX_NOTE} characters, got {len(note)}")
        sec, usec = self.client.time()
        record: dict[str, Any] = {"added_at": sec + usec / 1_000_000}
        if note:
            record["note"] = note
        return bool(self.client.hset(self.keys.registered_models(), name, json.dumps(record)))

    def remove(self, name: str) -> RemovedModel:
        """Forget ``name``: its registration and its last-seen record (``submit`` refuses it again)."""
        with self.client.pipeline(transaction=False) as p:
            p.hdel(self.keys.registered_models(), name)
            p.hdel(self.keys.models(), name)
            registered, seen = p.execute()
        return RemovedModel(name=name, registered=bool(registered), seen=bool(seen),
                            live_workers=self._live_workers().get(name, 0))

    def now(self) -> float:
        """The Redis server's clock: the one the registration and last-seen times were written with."""
        sec, usec = self.client.time()
        return float(sec + usec / 1_000_000)

    def models(self) -> list[ModelInfo]:
        """Every known model, registered or seen, sorted by name."""
        with self.client.pipeline(transaction=False) as p:
            p.hgetall(self.keys.registered_models())
            p.hgetall(self.keys.models())
            raw_registered, raw_seen = p.execute()
        registered = {reply_text(k): _registration(v) for k, v in raw_registered.items()}
        seen = {reply_text(k): _time(v) for k, v in raw_seen.items()}
        live = self._live_workers()
        out = []
        for name in sorted(set(registered) | set(seen)):
            at, note = registered.get(name, (None, None))
            out.append(ModelInfo(name=name, registered=name in registered, registered_at=at, note=note,
                                 last_seen=seen.get(name), live_workers=live.get(name, 0)))
        return out

    def _live_workers(self) -> Counter[str]:
        """Live workers per model: members of the workers set whose record has not expired (a
        worker killed without deregistering stays in the set, but its record's TTL runs out)."""
        names = list(self.client.smembers(self.keys.workers()))
        if not names:
            return Counter()
        with self.client.pipeline(transaction=False) as p:
            for n in names:
                p.hmget(self.keys.worker(reply_text(n)), ["model", "served"])
            records = p.execute()
        live: Counter[str] = Counter()
        for model, served in records:  # served: the worker's model and its LoRA adapters' (comma-separated)
            if served is not None:
                live.update({m for m in reply_text(served).split(",") if m})
            elif model is not None:
                live[reply_text(model)] += 1
        return live


def _registration(raw: bytes | str) -> tuple[float | None, str | None]:
    """(registered at, note) from a registration record; anything malformed reads as unknown, since
    the record is untrusted and the registration itself (the hash field) is what counts."""
    try:
        record = json.loads(reply_text(raw))
    except ValueError:
        return None, None
    if not isinstance(record, dict):
        return None, None
    note = record.get("note")
    return _time(record.get("added_at")), (note[:MAX_NOTE] if isinstance(note, str) else None)


# ==== Lua: this module's scripts (composed and run by lmdq.redis.scripts.LuaScript) ====

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
