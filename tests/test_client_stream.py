"""Batch.stream (issue 45, LMDeploy's ``stream_infer`` counterpart) end to end: a real lmdq worker (sim
engine, in a thread of this process) writes each running request's partial text, and the stream yields it
per request before the request ends.

No wall clock: the worker's clock steps one second a call, so every token after a request's first is due
a partial write (LMDQ_PARTIAL_INTERVAL_S is far below a step); the engine holds every request's final
event until the test has seen that request's text in the stream. A worker writes a partial synchronously
while handling the event before, so by the time the engine blocks, the text is in Redis."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import redis

import lmdq
from lmdq.client.stream import StreamChunk
from lmdq.contract import ResultStatus
from lmdq.submission.settings import ProducerSettings


class HeldFinals:
    """A sim engine whose requests' final events wait for ``gate`` (their text events pass)."""

    def __init__(self) -> None:
        from lmdq.worker.engines.sim import SimEngine

        self.inner = SimEngine(model_name="sim", step_ms=0, emit_every=1)  # an event per token
        self.gate = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def stream(self, requests: Sequence[Any], abort: threading.Event) -> Iterator[Any]:
        for ev in self.inner.stream(requests, abort):
            if ev.finish_reason is not None and not self.gate.wait(60):
                raise RuntimeError("gate never opened")
            yield ev


def test_stream_yields_each_requests_text_before_it_ends(redis_url: str, prefix: str) -> None:
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    api = lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix))
    b = api.submit([{"custom_id": f"r{i}", "prompt": f"tell me about {i}"} for i in range(3)], model="sim",
                   allow_unknown_model=True, batch_size=3, max_new_tokens=12)
    engine = HeldFinals()
    ticks = itertools.count()
    w = Worker(engine=engine, client=redis.Redis.from_url(redis_url), clock=lambda: float(next(ticks)),
               settings=WorkerSettings(redis_url=redis_url, key_prefix=prefix, health_port=0, burst=True,
                                       partial_interval_s=0.05))
    th = threading.Thread(target=w.run, daemon=True)
    th.start()
    try:
        it = b.stream(timeout=60, poll_interval=0.01, max_interval=0.05)
        before: list[StreamChunk] = []
        while {c.index for c in before} != {0, 1, 2}:  # every request's text, while no request can end
            c = next(it)
            assert not c.finished and c.result is None and c.finish_reason is None and c.text
            before.append(c)
        assert b.counts().done == 0
        engine.gate.set()
        after = list(it)
    finally:
        engine.gate.set()
        th.join(60)
    finals = [c for c in after if c.finished]
    assert sorted(c.custom_id for c in finals) == ["r0", "r1", "r2"]  # one last chunk per request
    for c in finals:
        assert c.result is not None and c.result.status is ResultStatus.completed and c.finish_reason == "length"
        mine = [x for x in before + after if x.index == c.index]
        assert mine[-1] is c and not any(x.restart for x in mine)
        assert "".join(x.text for x in mine) == c.result.text  # the deltas add up to the answer
        assert c.generate_token_len == 12
    assert b.status() is lmdq.BatchStatus.completed
