"""lmdq_bench.keyspace: find keys by pattern, weigh them exactly, delete them in chunks."""

from __future__ import annotations

import redis

from lmdq_bench import keyspace


def test_scan_finds_exactly_the_matching_keys(client: redis.Redis, prefix: str) -> None:
    client.set(f"{prefix}:a:1", "x")
    client.hset(f"{prefix}:a:2", "f", "v")
    client.set(f"{prefix}:b:1", "x")
    assert sorted(keyspace.scan(client, f"{prefix}:a:*")) == [f"{prefix}:a:1".encode(), f"{prefix}:a:2".encode()]
    everything = set(keyspace.scan(client))
    assert {f"{prefix}:{k}".encode() for k in ("a:1", "a:2", "b:1")} <= everything


def test_keys_memory_is_the_sum_of_memory_usage_and_a_missing_key_weighs_nothing(client: redis.Redis,
                                                                                   prefix: str) -> None:
    small, large = f"{prefix}:small", f"{prefix}:large"
    client.set(small, "x")
    client.set(large, "y" * 10_000)
    each = [int(client.memory_usage(k, samples=0) or 0) for k in (small, large)]
    assert each[1] > 10_000 > each[0] > 0
    assert keyspace.keys_memory(client, [small, large.encode(), f"{prefix}:absent"]) == sum(each)
    assert keyspace.keys_memory(client, []) == 0


def test_delete_removes_every_key_across_chunks_and_counts_those_that_existed(client: redis.Redis,
                                                                              prefix: str) -> None:
    names = [f"{prefix}:k{i}" for i in range(2500)]  # three DELs of at most 1000 keys
    with client.pipeline(transaction=False) as p:
        for n in names:
            p.set(n, "1")
        p.execute()
    client.set(f"{prefix}:kept", "1")
    assert keyspace.delete(client, [*names, f"{prefix}:absent"]) == 2500
    assert not any(client.exists(n) for n in names[::97]) and not list(keyspace.scan(client, f"{prefix}:k[0-9]*"))
    assert client.exists(f"{prefix}:kept") == 1
    assert keyspace.delete(client, []) == 0
