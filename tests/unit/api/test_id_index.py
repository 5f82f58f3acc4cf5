"""lmdq.api.id_index: a per-tenant sorted set of ids read a slice at a time (real redis-server)."""

from __future__ import annotations

import redis

from lmdq.api import id_index


def _index(client: redis.Redis, prefix: str, n: int) -> str:
    key = f"{prefix}:ids"
    client.zadd(key, {f"id{i}": i for i in range(n)})
    return key


def test_rank_in_both_orders_and_absent(client: redis.Redis, prefix: str) -> None:
    key = _index(client, prefix, 5)
    assert id_index.rank(client, key, "id0", newest_first=False) == 0
    assert id_index.rank(client, key, "id0", newest_first=True) == 4
    assert id_index.rank(client, key, "nope", newest_first=True) is None
    assert id_index.rank(client, f"{prefix}:missing", "id0", newest_first=False) is None


def test_slices_page_without_overlap_or_gap(client: redis.Redis, prefix: str) -> None:
    key = _index(client, prefix, 5)
    assert id_index.slice_ids(client, key, 0, 2, newest_first=True) == ["id4", "id3"]
    assert id_index.slice_ids(client, key, 2, 2, newest_first=True) == ["id2", "id1"]
    assert id_index.slice_ids(client, key, 4, 2, newest_first=True) == ["id0"]
    assert id_index.slice_ids(client, key, 5, 2, newest_first=True) == []
    assert id_index.slice_ids(client, key, 1, 3, newest_first=False) == ["id1", "id2", "id3"]


def test_undecodable_member_is_replaced(client: redis.Redis, prefix: str) -> None:
    key = f"{prefix}:ids"
    client.zadd(key, {b"f\xff": 1})
    assert id_index.slice_ids(client, key, 0, 10, newest_first=False) == ["f\ufffd"]


def test_drop_removes_only_the_named_and_accepts_none(client: redis.Redis, prefix: str) -> None:
    key = _index(client, prefix, 3)
    id_index.drop(client, key, [])
    id_index.drop(client, key, ["id1", "never"])
    assert id_index.slice_ids(client, key, 0, 10, newest_first=False) == ["id0", "id2"]
