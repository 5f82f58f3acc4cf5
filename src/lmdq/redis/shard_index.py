"""The Redis half of sealing a job's shard: the batch's shard index (``Keys.shards``: job -> entry), the
job's final records it is built from, and the seal itself (``SEAL_SHARD``: entry in, sealed bits set,
records out, in one script call).

Why a module of its own: when a job may be sealed, what its shard holds and how an entry is decoded are
the results' rules (:mod:`lmdq.results.sink`, :mod:`lmdq.results.shards`); the commands are here,
because lmdq speaks Redis only under :mod:`lmdq.redis` (tests/test_redis_boundary.py). Replies are
handed back raw (untrusted: the callers validate them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from lmdq.redis import scripts
from lmdq.redis.keys import Keys

__all__ = ["index_entry", "job_finals", "seal"]


def index_entry(client: redis.Redis, keys: Keys, batch_id: str, job: str) -> Any:
    """The raw shard-index entry of job number ``job`` (None: the job is not sealed)."""
    return client.hget(keys.shards(batch_id), job)


def job_finals(client: redis.Redis, keys: Keys, batch_id: str, indices: Sequence[int]) -> list[Any]:
    """The final records of ``indices`` in Redis, raw, in that order (None: no final result there)."""
    return list(client.hmget(keys.results(batch_id), list(indices)))


def seal(client: redis.Redis, keys: Keys, batch_id: str, job: str, entry: str, ttl_s: int,
         indices: Sequence[int]) -> int:
    """Seal one job in ONE script call (atomic: a reader finds its records all in Redis or all in its
    shard). Returns 1 when sealed now, 0 when an earlier seal holds the entry, negative when refused
    (the script's comment in :mod:`lmdq.redis.scripts` says when)."""
    bid = batch_id
    return int(scripts.SEAL_SHARD(keys=[keys.results(bid), keys.shards(bid), keys.sealed(bid), keys.batch(bid)],
                                  args=[job, entry, ttl_s, *indices], client=client))
