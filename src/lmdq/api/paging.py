"""OpenAI's cursor pagination (``after`` = the last id of the previous page, ``limit``) over a
per-tenant sorted set of ids (score: creation time)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import redis

from lmdq.api import id_index
from lmdq.api.errors import bad_request

__all__ = ["Page", "page"]

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
        r = id_index.rank(client, index, after, newest_first=newest_first)
        if r is None:
            raise bad_request(f"after: no {what} {after!r} in this list (deleted or expired?)", param="after")
        start = r + 1
    items: list[T] = []
    while len(items) < limit + 1:
        want = limit + 1 - len(items)
        ids = id_index.slice_ids(client, index, start, want, newest_first=newest_first)
        if not ids:
            break
        shown, stale = load(ids)
        items.extend(shown)
        start += len(ids)
        if stale:
            id_index.drop(client, index, stale)
            start -= len(stale)
    return Page(items=items[:limit], has_more=len(items) > limit)
