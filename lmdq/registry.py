"""The worker registry: which workers are alive, which models are served, which batches are cancelled.

A worker's record is a hash with a TTL that its heartbeat renews, so a dead worker disappears on its
own; the models hash (model -> last seen) is what ``submit`` checks a model name against. Timestamps
come from the Redis server's clock (TIME), like leases: a worker with a wrong clock must not look
dead or stale. The worker never speaks Redis itself; it calls this and :class:`lmdq.jobs.JobQueue`.
"""

from __future__ import annotations

import redis

from lmdq.keys import Keys

__all__ = ["WorkerRegistry", "redis_answers"]

# KEYS: models, worker hash, workers set.  ARGV: model, ttl, pid, worker name
_REGISTER = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('HSET', KEYS[1], ARGV[1], now)
redis.call('HSET', KEYS[2], 'model', ARGV[1], 'started_at', now, 'last_heartbeat', now, 'pid', ARGV[3])
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
redis.call('SADD', KEYS[3], ARGV[4])
return 1
"""

# KEYS: models, worker hash.  ARGV: model, ttl
_BEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('HSET', KEYS[2], 'last_heartbeat', now)
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
redis.call('HSET', KEYS[1], ARGV[1], now)
return 1
"""


class WorkerRegistry:
    """One worker's records in Redis (thread-safe: redis-py clients are)."""

    def __init__(self, client: redis.Redis, *, keys: Keys, name: str, model: str, ttl_s: float) -> None:
        self.client = client
        self.keys = keys
        self.name = name
        self.model = model
        #: the worker hash outlives a missed beat by a second; a dead worker's record expires by itself
        self.ttl_s = max(1, int(ttl_s) + 1)
        self._register = client.register_script(_REGISTER)
        self._beat = client.register_script(_BEAT)

    def register(self, *, pid: int) -> None:
        """Announce the worker and its model (``submit`` accepts models a worker has served)."""
        self._register(
            keys=[self.keys.models(), self.keys.worker(self.name), self.keys.workers()],
            args=[self.model, self.ttl_s, pid, self.name],
        )

    def beat(self) -> None:
        """Renew the worker record and the model's last-seen time."""
        self._beat(keys=[self.keys.models(), self.keys.worker(self.name)], args=[self.model, self.ttl_s])

    def deregister(self) -> None:
        """Remove the worker record (the model stays known: it has been served)."""
        with self.client.pipeline() as p:
            p.delete(self.keys.worker(self.name))
            p.srem(self.keys.workers(), self.name)
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
