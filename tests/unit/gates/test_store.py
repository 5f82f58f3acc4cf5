"""lmdq.gates.store against a real redis-server: the record fence, the canary's last job, the window, and
release / pause / resume moving held jobs (their scripts' fences)."""

from __future__ import annotations

import redis

from lmdq.contract import BatchStatus
from lmdq.gates.config import GateConfig
from lmdq.gates.store import GateStore
from lmdq.redis.keys import BatchField, Keys


def _setup(client: redis.Redis, prefix: str, config: GateConfig, canary: list[str]) -> tuple[GateStore, Keys]:
    keys = Keys(prefix)
    store = GateStore(client, keys=keys)
    client.hset(keys.batch("b1"), BatchField.status.value, BatchStatus.queued.value)
    store.create("b1", config, canary_job_ids=canary, queue_key=f"{prefix}:q", queues=[f"{prefix}:q"],
                 wakes=[f"{prefix}:wake"], ttl_s=600)
    client.rpush(keys.gates_held("b1"), "b1-000001", "b1-000002")
    return store, keys


def test_canary_verdict_is_due_once_on_its_last_job(client: redis.Redis, prefix: str) -> None:
    store, keys = _setup(client, prefix, GateConfig(canary=2), ["b1-000000", "b1-000003"])
    assert store.record("b1", "b1-000000", 0, [{"i": 0, "ok": True}], None) == ("wait", [])
    assert store.record("b1", "b1-000000", 0, [{"i": 0, "ok": True}], None) == ("dup", [])
    phase, seen = store.record("b1", "b1-000003", 3, [{"i": 3, "ok": False}], None)
    assert phase == "canary" and sorted(e["i"] for e in seen) == [0, 3]
    assert store.release("b1") == 2
    assert client.lrange(f"{prefix}:q", 0, -1) == [b"b1-000001", b"b1-000002"]
    assert client.lrange(f"{prefix}:wake", 0, -1) == [b"1"]
    assert store.release("b1") == -1  # one verdict
    assert store.pause("b1", {"x": 1}, verdict="failed") == 0
    st = store.state("b1")
    assert st is not None and st.verdict == "passed" and st.held == 0


def test_pause_takes_queued_jobs_off_and_resume_puts_them_back(client: redis.Redis, prefix: str) -> None:
    store, keys = _setup(client, prefix, GateConfig(window=2), [])
    client.rpush(f"{prefix}:q", "other-000000", "b1-000003")
    assert store.record("b1", "b1-000000", 0, [{"i": 0, "ok": True}], 2) == ("wait", [])
    phase, seen = store.record("b1", "b1-000004", 4, [{"i": 8, "ok": False}], 2)
    assert phase == "window" and [e["i"] for e in seen] == [8, 0]  # newest first
    assert store.pause("b1", {"phase": "window"}, verdict="paused") == 1
    assert client.hget(keys.batch("b1"), "status") == b"paused"
    assert client.lrange(f"{prefix}:q", 0, -1) == [b"other-000000"]
    assert store.state("b1").held == 3  # type: ignore[union-attr]
    assert store.pause("b1", {}, verdict="paused") == 0  # paused already
    assert store.record("b1", "b1-000005", 5, [{"i": 9, "ok": False}], 2) == ("none", [])  # nothing judged
    assert store.resume("b1") == 3
    assert client.hget(keys.batch("b1"), "status") == b"queued"
    assert client.lrange(f"{prefix}:q", 0, -1) == [b"other-000000", b"b1-000001", b"b1-000002", b"b1-000003"]
    assert client.llen(keys.gates_seen("b1")) == 0  # the window starts afresh
    assert store.resume("b1") == -1


def test_release_of_a_cancelled_batch_queues_nothing(client: redis.Redis, prefix: str) -> None:
    store, keys = _setup(client, prefix, GateConfig(canary=1), ["b1-000000"])
    client.hset(keys.batch("b1"), "status", BatchStatus.cancelling.value)
    assert store.release("b1") == -2
    assert client.llen(f"{prefix}:q") == 0
    assert store.config("b1") == GateConfig(canary=1)
    store.delete("b1")
    assert store.state("b1") is None and store.config("b1") is None
