"""The results sink, worker side: when a job ends, its results become one shard in object storage.

Offloading is an optimisation, never a risk to the results: a sink failure is logged and the full
records stay in Redis, where ``results`` reads them; only a Redis failure propagates (the job is
then re-queued like any other Redis outage).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis

from lmdq.connection import with_reconnect
from lmdq.contract import JobPayload, ResultStatus
from lmdq.keys import Keys
from lmdq.sink import ShardEntry

__all__ = ["all_completed", "flush_results"]


def flush_results(
    client: redis.Redis,
    keys: Keys,
    payload: JobPayload,
    jlog: Any,
    on_retry: Callable[[Exception, float], None] | None = None,
    ttl_s: int = 7 * 24 * 3600,
) -> ShardEntry | None:
    """Results sink: the ended job's results become one shard, Redis keeps one index entry for it.

    A sink failure is logged and leaves the full records in Redis, where ``results`` reads them.
    Returns the job's index entry once its results are in the shard.
    """
    from lmdq.sink import flush_job

    try:
        entry = with_reconnect(lambda: flush_job(client, keys, payload, ttl_s=ttl_s), on_retry=on_retry)
    except redis.RedisError:
        raise
    except Exception as e:  # noqa: BLE001 - the results are safe in Redis; only the offload failed
        jlog.error("results shard not written; full results stay in Redis", error=f"{type(e).__name__}: {e}")
        return None
    if entry is not None:
        jlog.debug("results shard written", shard=entry.shard)
    return entry


def all_completed(entry: ShardEntry | None) -> bool:
    """Whether nothing in the job is left for ``retry`` (which reads failed requests from the job)."""
    return entry is not None and set(entry.counts) <= {ResultStatus.completed}
