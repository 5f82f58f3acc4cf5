"""What lmdq asks the Redis server about itself: is it there, how full is it.

Data access for :mod:`lmdq.batches.headroom` (submit's "does the batch fit") and the HTTP API's
readiness probe; the callers keep the judgement, this module the commands.
"""

from __future__ import annotations

from typing import Any

import redis

__all__ = ["memory_info", "ping"]


def memory_info(client: redis.Redis) -> dict[str, Any]:
    """``INFO memory`` as redis-py parses it. Raises :class:`redis.ResponseError` where INFO is not
    allowed (some managed services rename or restrict it)."""
    return dict(client.info("memory"))


def ping(client: redis.Redis) -> bool:
    """``PING``: True when the server answered. Raises redis errors as any call does."""
    return bool(client.ping())
