"""Issue 47, never pay twice: a request whose identity has a completed answer is answered from it.

Real redis-server, real in-process workers on the sim engine (the engine's step counter says whether
anything reached it), the embedded CPU model on the transformers engine, and a SIGKILLed worker process
for exactly-once."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import redis

from lmdq.contract import BatchStatus, Result
from lmdq.redis.keys import Keys
from lmdq.results.reader import ResultReader
from lmdq.results.store import ResultStore
from lmdq.reuse.store import ReuseStore
from lmdq.testing import enqueue_requests
from lmdq.worker.engines.sim import SimEngine
from lmdq.worker.runner import Worker
from lmdq.worker.settings import WorkerSettings
from tests.helpers import wait_batch

TTL = 3600


class SimWorker:
    """A real worker on a sim engine in a thread; ``model`` is what it serves, ``weights`` its --model folder."""

    def __init__(self, url: str, prefix: str, *, weights: Path | None = None, **sim: Any) -> None:
        s = WorkerSettings(redis_url=url, key_prefix=prefix, health_port=0, partial_interval_s=3600,
                           engine="sim", served_model_name="sim", model=str(weights) if weights else None)
        self.engine = SimEngine(model_name="sim", step_ms=sim.pop("step_ms", 0.2), max_batch=256, **sim)
        self.worker = Worker(engine=self.engine, client=redis.Redis.from_url(url), settings=s)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.worker.stop()
        self.thread.join(60)
        assert not self.thread.is_alive()


def run_batch(client: redis.Redis, url: str, prefix: str, rows: list[dict[str, Any]], *, reuse: bool = True,
              weights: Path | None = None, batch_size: int = 500, **fields: Any) -> tuple[list[Result], int]:
    """Enqueue ``rows`` (custom_ids r0..), drain them with a fresh sim worker; (results in order, engine steps)."""
    bid = enqueue_requests(client, Keys(prefix), "sim", rows, batch_size=batch_size,
                           reuse_ttl_s=TTL if reuse else None, **fields)
    w = SimWorker(url, prefix, weights=weights)
    try:
        assert wait_batch(client, prefix, bid, timeout=600).status is BatchStatus.completed
    finally:
        w.stop()
    store = ResultStore(client, keys=Keys(prefix))
    reader = ResultReader.of(store, store.batches.get(bid))
    got = [Result.model_validate_json(raw) for _, raw in reader.records(partial=False) if raw]
    assert [r.custom_id for r in got] == [f"r{i}" for i in range(len(rows))]  # every custom_id exactly once
    return got, w.engine.steps


def rows_of(n: int, **params: Any) -> list[dict[str, Any]]:
    return [{"prompt": f"question {i}: name {i % 97} colours", "params": {"max_new_tokens": 8, **params}}
            for i in range(n)]


def test_a_greedy_batch_run_twice_is_answered_from_reuse_the_second_time(
        client: redis.Redis, redis_url: str, prefix: str) -> None:
    rows = rows_of(10_000)
    first, steps1 = run_batch(client, redis_url, prefix, rows)
    assert steps1 > 0 and all(r.reused_from is None for r in first)
    second, steps2 = run_batch(client, redis_url, prefix, rows)
    assert steps2 == 0  # nothing reached the engine
    for a, b in zip(first, second, strict=True):
        assert (b.text, b.input_token_len, b.generate_token_len, b.finish_reason) == \
            (a.text, a.input_token_len, a.generate_token_len, a.finish_reason)
        assert b.reused_from is not None
        assert (b.reused_from.batch, b.reused_from.custom_id) == (a.batch_id, a.custom_id)
        assert b.custom_id == a.custom_id and b.batch_id != a.batch_id
    stats = ReuseStore(client, keys=Keys(prefix)).counters("sim")
    assert stats["entries"] == 10_000 and stats["hits"] == 10_000
