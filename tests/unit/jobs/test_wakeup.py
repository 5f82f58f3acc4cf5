"""lmdq.jobs.wakeup: one token at most, one token wakes one waiter (real redis-server)."""

from __future__ import annotations

import redis

from lmdq.jobs.wakeup import BLOCK_MARGIN_S, WakeUp
from lmdq.redis.keys import Keys


def test_notify_leaves_at_most_one_token(client: redis.Redis, prefix: str) -> None:
    w = WakeUp(client, keys=Keys(prefix), model="m", block_s=1.0)
    try:
        for _ in range(3):
            w.notify()
        assert client.llen(Keys(prefix).wake("m")) == 1
        assert w.wait(0.01) is True
        assert client.llen(Keys(prefix).wake("m")) == 0
        assert w.wait(0.01) is False  # no token left: the (short) block ends empty
    finally:
        w.close()


def test_a_token_on_an_adapter_list_wakes_the_worker(client: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    w = WakeUp(client, keys=keys, model="base", block_s=1.0, also=["base/lora-a"])
    other = WakeUp(client, keys=keys, model="base/lora-a", block_s=1.0)
    try:
        assert w.wait_keys == [keys.wake("base"), keys.wake("base/lora-a")]
        other.notify()
        assert w.wait(0.01) is True
        assert client.llen(keys.wake("base/lora-a")) == 0
    finally:
        w.close()
        other.close()


def test_blocking_connection_outlives_the_block(client: redis.Redis, prefix: str) -> None:
    w = WakeUp(client, keys=Keys(prefix), model="m", block_s=5.0)
    try:
        assert w._pool.connection_kwargs["socket_timeout"] == 5.0 + BLOCK_MARGIN_S
    finally:
        w.close()
