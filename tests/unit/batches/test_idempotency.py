"""lmdq.batches.idempotency: an idempotency key bound, read and freed, on a real redis-server."""

from __future__ import annotations

import redis

from lmdq.batches.idempotency import IdempotencyKeys
from lmdq.redis.keys import Keys


def test_bind_once_then_bound_names_the_batch(client: redis.Redis, prefix: str) -> None:
    idem = IdempotencyKeys(client, keys=Keys(prefix))
    assert idem.bound("k") is None
    assert idem.bind("k", "b1", ttl_s=100)
    assert not idem.bind("k", "b2", ttl_s=100)  # SET NX: the second submit does not win
    assert idem.bound("k") == "b1"
    assert 90 <= client.ttl(Keys(prefix).idempotency("k")) <= 100


def test_release_frees_only_a_key_bound_to_that_batch(client: redis.Redis, prefix: str) -> None:
    idem = IdempotencyKeys(client, keys=Keys(prefix))
    idem.bind("k", "b1", ttl_s=100)
    idem.release("k", "b2")
    assert idem.bound("k") == "b1"
    idem.release("k", "b1")
    assert idem.bound("k") is None
    idem.release("k", "b1")  # free already: nothing to do, no error


def test_a_bad_utf8_value_reads_without_raising(client: redis.Redis, prefix: str) -> None:
    client.set(Keys(prefix).idempotency("k"), b"\xffb1")
    assert IdempotencyKeys(client, keys=Keys(prefix)).bound("k") == "\ufffdb1"
