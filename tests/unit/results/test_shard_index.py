"""lmdq.results.shard_index: the shard index entry, a job's finals and the one-call seal, on a real
redis-server."""

from __future__ import annotations

import redis

from lmdq.redis.keys import BatchField, Keys
from lmdq.results import shard_index


def test_seal_moves_records_out_and_the_entry_in_once(client: redis.Redis, prefix: str) -> None:
    k = Keys(prefix)
    client.hset(k.batch("b1"), mapping={BatchField.status.value: "in_progress", BatchField.ttl.value: 60})
    client.hset(k.results("b1"), mapping={"0": "r0", "1": "r1", "2": "r2"})
    assert shard_index.index_entry(client, k, "b1", "0") is None
    assert shard_index.job_finals(client, k, "b1", [0, 1, 5]) == [b"r0", b"r1", None]
    assert shard_index.seal(client, k, "b1", "0", "entry", 60, [0, 1]) == 1
    assert shard_index.index_entry(client, k, "b1", "0") == b"entry"
    assert client.hkeys(k.results("b1")) == [b"2"]  # only the sealed job's records left
    assert client.getbit(k.sealed("b1"), 0) == 1 and client.getbit(k.sealed("b1"), 1) == 1
    assert client.getbit(k.sealed("b1"), 2) == 0
    assert shard_index.seal(client, k, "b1", "0", "other", 60, [0, 1]) == 0  # fenced on the entry
    assert shard_index.index_entry(client, k, "b1", "0") == b"entry"
