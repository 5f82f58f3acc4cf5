"""What lmdq asks the Redis server about itself: is it there, how full is it, what has it done.

Data access for :mod:`lmdq.batches.headroom` (submit's "does the batch fit"), the HTTP API's
readiness probe and the benchmarks' counters (commands, CPU, blocked clients); the callers keep the
judgement, this module the commands.
"""

from __future__ import annotations

from typing import Any

import redis

__all__ = ["info", "memory_info", "ping"]


def info(client: redis.Redis, section: str) -> dict[str, Any]:
    """``INFO <section>`` as redis-py parses it (``"stats"``, ``"clients"``, ``"commandstats"``,
    ``"all"``, ...): the server's own counters, which the benches read around a phase."""
    return dict(client.info(section))


def memory_info(client: redis.Redis) -> dict[str, Any]:
    """``INFO memory`` as redis-py parses it. Raises :class:`redis.ResponseError` where INFO is not
    allowed (some managed services rename or restrict it)."""
    return dict(client.info("memory"))


def ping(client: redis.Redis) -> bool:
    """``PING``: True when the server answered. Raises redis errors as any call does."""
    return bool(client.ping())
