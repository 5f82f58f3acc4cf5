"""lmdq.api.paging: OpenAI cursor pages over a real sorted set, with stale ids dropped as met; and its store,
the per-tenant sorted set of ids read a slice at a time."""

from __future__ import annotations

import pytest
import redis

from lmdq.api import paging
from lmdq.api.errors import ApiError
from lmdq.api.paging import page


def _index(client: redis.Redis, prefix: str, n: int) -> str:
    key = f"{prefix}:files"
    client.zadd(key, {f"f{i}": i for i in range(n)})
    return key


def _all_live(ids: list[str]) -> tuple[list[str], list[str]]:
    return ids, []


def test_pages_cover_every_id_once_newest_first(client: redis.Redis, prefix: str) -> None:
    key = _index(client, prefix, 5)
    seen: list[str] = []
    after = None
    while True:
        p = page(client, key, after=after, limit=2, newest_first=True, load=_all_live, what="file")
        seen += p.items
        if not p.has_more:
            break
        after = p.items[-1]
    assert seen == ["f4", "f3", "f2", "f1", "f0"]


def test_exact_fit_has_no_more(client: redis.Redis, prefix: str) -> None:
    key = _index(client, prefix, 3)
    p = page(client, key, after=None, limit=3, newest_first=False, load=_all_live, what="file")
    assert p.items == ["f0", "f1", "f2"] and p.has_more is False
    assert page(client, f"{prefix}:none", after=None, limit=3, newest_first=False, load=_all_live,
                what="file").items == []


def test_stale_ids_are_dropped_and_the_page_is_filled(client: redis.Redis, prefix: str) -> None:
    key = _index(client, prefix, 6)
    gone = {"f1", "f2"}

    def load(ids: list[str]) -> tuple[list[str], list[str]]:
        return [i for i in ids if i not in gone], [i for i in ids if i in gone]

    p = page(client, key, after=None, limit=3, newest_first=False, load=load, what="file")
    assert p.items == ["f0", "f3", "f4"] and p.has_more is True
    assert client.zscore(key, "f1") is None and client.zscore(key, "f2") is None
    p2 = page(client, key, after="f4", limit=3, newest_first=False, load=load, what="file")
    assert p2.items == ["f5"] and p2.has_more is False


def test_filtered_ids_are_skipped_without_being_dropped(client: redis.Redis, prefix: str) -> None:
    key = _index(client, prefix, 4)
    p = page(client, key, after=None, limit=10, newest_first=False,
             load=lambda ids: ([i for i in ids if i != "f2"], []), what="file")
    assert p.items == ["f0", "f1", "f3"]
    assert client.zcard(key) == 4


def test_unknown_cursor_is_a_400_naming_it(client: redis.Redis, prefix: str) -> None:
    key = _index(client, prefix, 2)
    with pytest.raises(ApiError) as e:
        page(client, key, after="nope", limit=2, newest_first=True, load=_all_live, what="batch")
    assert e.value.status == 400 and e.value.param == "after" and "'nope'" in e.value.message


def _ids(client: redis.Redis, prefix: str, n: int) -> str:
    key = f"{prefix}:ids"
    client.zadd(key, {f"id{i}": i for i in range(n)})
    return key


def test_rank_in_both_orders_and_absent(client: redis.Redis, prefix: str) -> None:
    key = _ids(client, prefix, 5)
    assert paging.rank(client, key, "id0", newest_first=False) == 0
    assert paging.rank(client, key, "id0", newest_first=True) == 4
    assert paging.rank(client, key, "nope", newest_first=True) is None
    assert paging.rank(client, f"{prefix}:missing", "id0", newest_first=False) is None


def test_slices_page_without_overlap_or_gap(client: redis.Redis, prefix: str) -> None:
    key = _ids(client, prefix, 5)
    assert paging.slice_ids(client, key, 0, 2, newest_first=True) == ["id4", "id3"]
    assert paging.slice_ids(client, key, 2, 2, newest_first=True) == ["id2", "id1"]
    assert paging.slice_ids(client, key, 4, 2, newest_first=True) == ["id0"]
    assert paging.slice_ids(client, key, 5, 2, newest_first=True) == []
    assert paging.slice_ids(client, key, 1, 3, newest_first=False) == ["id1", "id2", "id3"]


def test_undecodable_member_is_replaced(client: redis.Redis, prefix: str) -> None:
    key = f"{prefix}:ids"
    client.zadd(key, {b"f\xff": 1})
    assert paging.slice_ids(client, key, 0, 10, newest_first=False) == ["f\ufffd"]


def test_drop_removes_only_the_named_and_accepts_none(client: redis.Redis, prefix: str) -> None:
    key = _ids(client, prefix, 3)
    paging.drop(client, key, [])
    paging.drop(client, key, ["id1", "never"])
    assert paging.slice_ids(client, key, 0, 10, newest_first=False) == ["id0", "id2"]
