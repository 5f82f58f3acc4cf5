"""The reuse index's store on a real Redis: buckets, sources, expiry, counters, memory, purge."""

from __future__ import annotations

import hashlib

import redis

from lmdq.redis.keys import Keys
from lmdq.reuse.store import (
    BUCKETS,
    SMALL_CAP,
    ReuseStore,
    decode_varints,
    encode_varints,
    split,
    split_small,
)


def ident(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def test_varints_round_trip_and_refuse_truncation() -> None:
    data = encode_varints(0, 127, 128, 300_000, 2**40)
    assert decode_varints(data, 5) == ([0, 127, 128, 300_000, 2**40], len(data))
    assert decode_varints(data[:-1], 5) is None
    assert len(encode_varints(1, 300, 1_000_000)) == 1 + 2 + 3


def test_record_lookup_sources_and_purge(client: redis.Redis, prefix: str) -> None:
    s = ReuseStore(client, keys=Keys(prefix))
    no = s.source("m", "batch_" + "a" * 24, "file:///x", 100)
    assert s.source("m", "batch_" + "a" * 24, "file:///x", 100) == no  # numbered once
    assert s.source("m", "batch_" + "b" * 24, None, 100) == no + 1
    assert s.record("m", [(ident(i), "p", b"S" + encode_varints(no, 0, i)) for i in range(50)], 100) == 50
    assert s.record("m", [(ident(0), "p", b"S" + encode_varints(no, 0, 0))], 100) == 0  # not new
    pairs, now = s.lookup("m", [ident(3), ident(99)])
    assert pairs == [b"S" + encode_varints(no, 0, 3), None] and now > 0
    src = s.sources("m", [no, no + 1, 77])
    assert src[no].batch_id == "batch_" + "a" * 24 and src[no].results_url == "file:///x"
    assert src[no + 1].results_url is None and 77 not in src and src[no].expires_at >= now + 99
    bucket, _ = split_small(ident(3))  # a small index: its entries are in the small level
    assert 0 < client.ttl(Keys(prefix).reuse_bucket("m", "ps", bucket)) <= 100
    s.count("m", 2, 1)
    assert s.counters("m") == {"entries": 50, "lookups": 2, "hits": 1}
    assert s.models() == ["m"] and s.memory("m") > 0
    assert s.purge("m") == 50
    assert s.lookup("m", [ident(3)])[0] == [None] and s.models() == [] and s.memory("m") == 0


def test_other_models_never_share_entries(client: redis.Redis, prefix: str) -> None:
    s = ReuseStore(client, keys=Keys(prefix))
    s.record("m", [(ident(1), "c", b"copy")], 100)
    assert s.lookup("n", [ident(1)])[0] == [None]
    s.purge("n")
    assert s.lookup("m", [ident(1)])[0] == [b"copy"]
    s.record("m", [(ident(1), "p", b"pointer")], 100)
    assert s.lookup("m", [ident(1)])[0] == [b"pointer"]  # a pointer wins over a copy
    assert BUCKETS == 65536


def test_a_model_past_the_small_cap_writes_the_big_level_and_both_are_read(client: redis.Redis, prefix: str) -> None:
    """83 B/entry at 50k (issue 47): few entries go to 4,096 buckets; past SMALL_CAP, to the 65,536."""
    keys = Keys(prefix)
    s = ReuseStore(client, keys=keys)
    n = 20_000
    assert s.record("m", [(ident(i), "p", b"S%d" % i) for i in range(n)], 100) == n
    small = {keys.reuse_bucket("m", "ps", split_small(ident(i))[0]) for i in range(n)}
    assert len(small) <= 4096 and not client.exists(*(keys.reuse_bucket("m", "p", split(ident(i))[0])
                                                      for i in range(n)))
    per_entry = sum(int(client.memory_usage(k, samples=0) or 0) for k in small) / n
    assert per_entry < 45  # 20,000 entries in 65,536 buckets (~1.2 a bucket) cost ~90 B each
    client.hset(keys.reuse_stats("m"), "entries", SMALL_CAP)  # as if the small level were full
    assert s.record("m", [(ident(i), "p", b"T%d" % i) for i in range(n - 10, n + 10)], 100) == 10
    assert client.hget(keys.reuse_bucket("m", "p", split(ident(n + 5))[0]), split(ident(n + 5))[1]) == b"T%d" % (n + 5)
    assert client.hget(keys.reuse_bucket("m", "ps", split_small(ident(n - 5))[0]), split_small(ident(n - 5))[1]) \
        == b"T%d" % (n - 5)  # rewritten where it was
    got, _ = s.lookup("m", [ident(5), ident(n - 5), ident(n + 5), ident(10 * n)])
    assert got == [b"S5", b"T%d" % (n - 5), b"T%d" % (n + 5), None]
    assert s.purge("m") == SMALL_CAP + 10 and s.lookup("m", [ident(5), ident(n + 5)])[0] == [None, None]
