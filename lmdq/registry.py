"""The worker registry: which workers are alive, which models are served, which batches are cancelled.

A worker's record is a hash with a TTL that its heartbeat renews, so a dead worker disappears on its
own; the models hash (model -> last seen) is what ``submit`` checks a model name against. Timestamps
come from the Redis server's clock (TIME), like leases: a worker with a wrong clock must not look
dead or stale. The worker never speaks Redis itself; it calls this and :class:`lmdq.jobs.JobQueue`.

Each worker also keeps an RQ worker record (``rq:worker:<name>`` in ``rq:workers`` and in
``rq:workers:<queue>`` for each of its queues), written by the same scripts, so ``rq info`` and
rq-dashboard list lmdq workers with their queues, state (busy/idle), birth and last heartbeat. Its
current jobs are RQ's executions, which :meth:`lmdq.jobs.JobQueue.mark_started` already records
under the same worker name. The RQ hash has the same TTL as lmdq's: a killed worker drops out of
``rq info`` by itself (RQ prunes set members whose hash is gone).
"""

from __future__ import annotations

import socket
import sys

import redis
from rq.version import VERSION as RQ_VERSION

from lmdq.keys import (
    Keys,
    queue_names,
    rq_worker_executions_key,
    rq_worker_key,
    rq_workers_by_queue_key,
    rq_workers_key,
)

__all__ = ["RQ_IDLE", "RQ_BUSY", "WorkerRegistry", "redis_answers"]

RQ_IDLE = "idle"
RQ_BUSY = "busy"
"""RQ's worker states (``rq info`` draws idle and busy workers differently)."""

# Server time as RQ writes it (rq.utils.utcformat: '%Y-%m-%dT%H:%M:%S.%fZ'), computed in the script
# from TIME so the RQ record and lmdq's share one clock. Days to civil date: H. Hinnant's algorithm.
_NOW = """
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
"""

# KEYS: models, worker hash, workers set, rq worker hash, rq workers set, rq workers-by-queue sets...
# ARGV: model, ttl, pid, worker name, rq queues (comma-separated), hostname, rq version, python version
_REGISTER = _NOW + """
redis.call('HSET', KEYS[1], ARGV[1], now)
redis.call('HSET', KEYS[2], 'model', ARGV[1], 'started_at', now, 'last_heartbeat', now, 'pid', ARGV[3])
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
"""

# KEYS: models, worker hash, rq worker hash.  ARGV: model, ttl, rq state, jobs done, jobs failed
_BEAT = _NOW + """
redis.call('HSET', KEYS[2], 'last_heartbeat', now)
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
redis.call('HSET', KEYS[1], ARGV[1], now)
redis.call('HSET', KEYS[3], 'last_heartbeat', utc(), 'state', ARGV[3],
  'successful_job_count', ARGV[4], 'failed_job_count', ARGV[5])
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[2]))
return 1
"""


class WorkerRegistry:
    """One worker's records in Redis (thread-safe: redis-py clients are)."""

    def __init__(self, client: redis.Redis, *, keys: Keys, name: str, model: str, ttl_s: float) -> None:
        self.client = client
        self.keys = keys
        self.name = name
        self.model = model
        #: the queues the worker drains, as RQ's record lists them
        self.queues = queue_names(model, keys.prefix)
        #: the worker hash outlives a missed beat by a second; a dead worker's record expires by itself
        self.ttl_s = max(1, int(ttl_s) + 1)
        self._register = client.register_script(_REGISTER)
        self._beat = client.register_script(_BEAT)

    def _rq_set_keys(self) -> list[str]:
        return [rq_workers_key(), *(rq_workers_by_queue_key(q) for q in self.queues)]

    def register(self, *, pid: int) -> None:
        """Announce the worker and its model (``submit`` accepts models a worker has served), to lmdq
        and to RQ."""
        py = sys.version.split(" ", 1)[0]
        self._register(
            keys=[self.keys.models(), self.keys.worker(self.name), self.keys.workers(),
                  rq_worker_key(self.name), *self._rq_set_keys()],
            args=[self.model, self.ttl_s, pid, self.name, ",".join(self.queues), socket.gethostname(),
                  RQ_VERSION, py],
        )

    def beat(self, *, busy: bool = False, done: int = 0, failed: int = 0) -> None:
        """Renew the worker records and the model's last-seen time. ``busy``: the worker holds jobs
        now (RQ's state); ``done``/``failed``: jobs it has finished so far (RQ's job counts)."""
        self._beat(
            keys=[self.keys.models(), self.keys.worker(self.name), rq_worker_key(self.name)],
            args=[self.model, self.ttl_s, RQ_BUSY if busy else RQ_IDLE, max(0, done), max(0, failed)],
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
