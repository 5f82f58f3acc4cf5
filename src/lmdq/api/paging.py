"""OpenAI's cursor pagination (``after`` = the last id of the previous page, ``limit``) over a
per-tenant sorted set of ids (score: creation time).

The id lists' store is here too (tests/test_redis_boundary.py): the sorted set of ids by creation time
(the HTTP API's per-tenant file and batch lists), read a slice at a time (:func:`rank`,
:func:`slice_ids`, :func:`drop`); ids are decoded with replacement (untrusted)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import redis

from lmdq.api.errors import bad_request

__all__ = ["Page", "drop", "page", "rank", "slice_ids"]

T = TypeVar("T")


@dataclass
class Page(Generic[T]):
    items: list[T]
    has_more: bool


def page(client: redis.Redis, index: str, *, after: str | None, limit: int, newest_first: bool,
         load: Callable[[list[str]], tuple[list[T], list[str]]], what: str) -> Page[T]:
    """Up to ``limit`` items after ``after``. ``load(ids)`` returns the items to show (filtered) and
    the ids whose record is gone (expired, deleted): those are dropped from the index as they are
    met, and the page is filled from the ids behind them."""
    start = 0
    if after:
        r = rank(client, index, after, newest_first=newest_first)
        if r is None:
            raise bad_request(f"after: no {what} {after!r} in this list (deleted or expired?)", param="after")
        start = r + 1
    items: list[T] = []
    while len(items) < limit + 1:
        want = limit + 1 - len(items)
        ids = slice_ids(client, index, start, want, newest_first=newest_first)
        if not ids:
            break
        shown, stale = load(ids)
        items.extend(shown)
        start += len(ids)
        if stale:
            drop(client, index, stale)
            start -= len(stale)
    return Page(items=items[:limit], has_more=len(items) > limit)


# ==== The store: the per-tenant id lists in Redis ========================================================


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
