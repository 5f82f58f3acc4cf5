"""A sorted set of ids by creation time (the HTTP API's per-tenant file and batch lists), read a slice at
a time: the API's store of id lists, for :mod:`lmdq.api.paging`, which keeps OpenAI's cursor rules."""

from __future__ import annotations

import redis

__all__ = ["drop", "rank", "slice_ids"]


def rank(client: redis.Redis, index: str, member: str, *, newest_first: bool) -> int | None:
    """``member``'s 0-based position in ``index`` (newest first or oldest first), None when absent."""
    r = client.zrevrank(index, member) if newest_first else client.zrank(index, member)
    return None if r is None else int(r)  # type: ignore[arg-type]


def slice_ids(client: redis.Redis, index: str, start: int, count: int, *, newest_first: bool) -> list[str]:
    """Up to ``count`` ids of ``index`` from position ``start`` on (decoded with replacement: untrusted)."""
    rng = client.zrevrange if newest_first else client.zrange
    return [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)
            for x in rng(index, start, start + count - 1)]


def drop(client: redis.Redis, index: str, members: list[str]) -> None:
    """Take ``members`` (ids whose records are gone) off ``index``."""
    if members:
        client.zrem(index, *members)
