"""The Redis half of the sink's retry schedule: jobs whose shard write failed, retried by every worker's
sweeper. A zset (``<batch id>:<job no>`` -> next try, Redis server time) and a hash (member -> the
job's request ranges and tries), one pair per key prefix, fleet-wide.

Why a module of its own: what an entry holds, how it is validated and the backoff are the results'
rules (:mod:`lmdq.results.sink`, :mod:`lmdq.results.worker_sink`); the script calls are here, because
lmdq speaks Redis only under :mod:`lmdq.redis` (tests/test_redis_boundary.py). Every change is one
script call (``PENDING_ADD`` / ``PENDING_CLAIM`` / ``PENDING_DROP``), so two sweepers never interleave.
"""

from __future__ import annotations

from typing import Any

import redis

from lmdq.redis import scripts
from lmdq.redis.keys import Keys

__all__ = ["add", "claim_due", "count", "drop"]


def add(client: redis.Redis, keys: Keys, *, member: str, data: str, delay_s: float, batch_id: str,
        job_no: int) -> None:
    """Schedule ``member`` ``delay_s`` from now (replacing an earlier schedule), unless its job is sealed
    by now (the script checks the batch's shard index)."""
    z, h = keys.sink_pending()
    scripts.PENDING_ADD(keys=[z, h, keys.shards(batch_id)], args=[member, data, f"{delay_s:.3f}", job_no],
                        client=client)


def claim_due(client: redis.Redis, keys: Keys, *, limit: int, lease_s: float, ahead_s: float) -> list[Any]:
    """Up to ``limit`` entries due within ``ahead_s``, each pushed ``lease_s`` ahead, in one script call:
    the raw flat reply ``[member, data, member, data, ...]`` (untrusted)."""
    z, h = keys.sink_pending()
    return list(scripts.PENDING_CLAIM(keys=[z, h], args=[limit, f"{lease_s:.3f}", f"{ahead_s:.3f}"],
                                      client=client))


def drop(client: redis.Redis, keys: Keys, member: str) -> None:
    """Take ``member`` off the schedule (one script call)."""
    z, h = keys.sink_pending()
    scripts.PENDING_DROP(keys=[z, h], args=[member], client=client)


def count(client: redis.Redis, keys: Keys) -> int:
    """Entries on the schedule, fleet-wide."""
    return int(client.zcard(keys.sink_pending()[0]))
