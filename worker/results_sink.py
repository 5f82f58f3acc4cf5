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
from lmdq.contract import JobPayload
from lmdq.keys import Keys

__all__ = ["flush_results"]


def flush_results(
    client: redis.Redis,
    keys: Keys,
    payload: JobPayload,
    jlog: Any,
    on_retry: Callable[[Exception, float], None] | None = None,
) -> None:
    """Results sink: the ended job's results become one shard, Redis keeps compact records.

    A sink failure is logged and leaves the full records in Redis, where ``results`` reads them.
    """
    from lmdq.sink import flush_job

    try:
        uri = with_reconnect(lambda: flush_job(client, keys, payload), on_retry=on_retry)
    except redis.RedisError:
        raise
    except Exception as e:  # noqa: BLE001 - the results are safe in Redis; only the offload failed
        jlog.error("results shard not written; full results stay in Redis", error=f"{type(e).__name__}: {e}")
        return
    if uri:
        jlog.debug("results shard written", uri=uri)
