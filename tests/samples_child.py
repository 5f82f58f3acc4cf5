"""A worker on the embedded model that freezes at a chosen final event, for tests/test_samples.py.

``python -m tests.samples_child REDIS_URL PREFIX MARKER AFTER``: serves the embedded SmolLM2 (transformers
engine) one job at a time; when the engine hands up its ``AFTER``-th final event (one sample of one
request ending) the worker writes ``MARKER`` and blocks every job thread there, so the test SIGKILLs
it at a known point (some requests answered, one request with only part of its samples) instead of
guessing one with a sleep.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import redis

from lmdq.worker.engines.base import EngineEvent, EngineRequest


class FreezeAt:
    """An engine that passes events through and freezes at its ``after``-th final event."""

    def __init__(self, engine: Any, after: int, marker: Path) -> None:
        self._engine, self._after, self._marker = engine, after, marker
        self.name, self.backend, self.model_name = engine.name, engine.backend, engine.model_name
        self.capacity = getattr(engine, "max_batch", 1)
        self._finals = 0
        self._lock = threading.Lock()
        self._never = threading.Event()

    def stream(self, requests: Sequence[EngineRequest], abort: threading.Event) -> Iterator[EngineEvent]:
        for ev in self._engine.stream(requests, abort):
            if ev.finish_reason is not None:
                with self._lock:
                    self._finals += 1
                    hit = self._finals >= self._after
                if hit:
                    if not self._marker.exists():
                        self._marker.write_text(f"{self._finals}\n")
                    self._never.wait()  # until SIGKILL
            yield ev

    def count_tokens(self, text: str) -> int:
        return int(self._engine.count_tokens(text))

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        self._engine.close()


def main(argv: list[str]) -> None:
    url, prefix, marker, after = argv[0], argv[1], Path(argv[2]), int(argv[3])
    from lmdq.worker import default_model
    from lmdq.worker.engines.transformers_engine import TransformersEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    engine = TransformersEngine(model_path=default_model.ensure_default_model(),
                                served_model_name=default_model.DEFAULT_MODEL_NAME)
    s = WorkerSettings(redis_url=url, key_prefix=prefix, health_port=0, jobs_in_flight=1, heartbeat_ttl_s=2,
                       worker_name="frozen")
    Worker(engine=FreezeAt(engine, after, marker), client=redis.Redis.from_url(url), settings=s).run()


if __name__ == "__main__":
    main(sys.argv[1:])
