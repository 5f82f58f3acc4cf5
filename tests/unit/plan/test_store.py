"""lmdq.plan.store: lengths and rates recorded and read back against a real redis-server."""

from __future__ import annotations

import redis

from lmdq.plan.store import MAX_WINDOWS, PlanStore, bucket
from lmdq.redis.keys import Keys


def test_bucket_is_exact_up_to_256_and_close_above() -> None:
    assert [bucket(n) for n in (0, 1, 255, 256)] == [0, 1, 255, 256]
    for n in (257, 1000, 4097, 100_000):
        assert bucket(n) <= n and (n - bucket(n)) / n < 0.016


def test_record_then_history(client: redis.Redis, prefix: str) -> None:
    store = PlanStore(client, keys=Keys(prefix))
    assert store.history("m").requests == 0 and store.history("m").rates == []
    store.record("m", "w1", lengths={(10, False): 3, (32, True): 2}, busy_s=2.0, prefill=100, decode=50)
    store.record("m", "w1", lengths={(10, False): 1}, busy_s=1.0, prefill=10, decode=20)
    store.record("m", "w2", lengths={}, busy_s=0.5, prefill=5, decode=5)
    h = store.history("m")
    assert h.stopped == {10: 4} and h.cut == {32: 2} and h.requests == 6
    w1, w2 = h.rates
    assert (w1.worker, w1.busy_s, w1.prefill, w1.decode) == ("w1", 3.0, 110, 70)
    assert w1.windows == [(2.0, 100, 50), (1.0, 10, 20)]
    assert w2.worker == "w2" and h.now >= w1.at > 0
    assert store.history("other").requests == 0  # per model


def test_windows_are_capped_and_bad_fields_skipped(client: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    store = PlanStore(client, keys=keys)
    for i in range(MAX_WINDOWS + 5):
        store.record("m", "w", lengths={}, busy_s=1.0, prefill=i, decode=1)
    client.hset(keys.plan_rates("m"), "junk", "{not json")
    client.hset(keys.plan_lengths("m"), "x+", "3")
    (rate,) = store.history("m").rates
    assert len(rate.windows) == MAX_WINDOWS and rate.windows[-1][1] == MAX_WINDOWS + 4
    assert store.history("m").requests == 0
    store.forget("m")
    assert client.exists(keys.plan_rates("m")) == 0
