"""What this worker measures for the plans of later batches (issue 46): output lengths and throughput.

:class:`lmdq.worker.attempt.JobAttempt` calls :meth:`PlanRecorder.enter` / :meth:`~PlanRecorder.leave`
around each job's time in the engine and :meth:`~PlanRecorder.request` as each request's final result
is built. Busy time is the worker's wall time with at least one job in its engine (the GPU-seconds a
plan predicts, whatever the batch's occupancy); the tokens are those the engine computed (prefill: the
prompt tokens it prefilled, a cached prefix not counted; decode: the tokens it generated). Every
:data:`FLUSH_S` of busy time, and whenever the engine empties, the window since the last flush goes to
:class:`lmdq.plan.store.PlanStore` in one round trip, on the job thread that closes it.

Best effort: a Redis error here is logged (at most once a minute) and the window dropped. A plan is an
estimate; a job must never fail or wait because its measurements could not be written.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis
import structlog

from lmdq.contract import JobPayload, Request
from lmdq.plan.store import PlanStore

__all__ = ["FLUSH_S", "PlanRecorder"]

FLUSH_S = 5.0
"""Seconds of busy time a recording window spans at most."""

_WARN_EVERY_S = 60.0

log = structlog.get_logger("lmdq.worker.plan")


class PlanRecorder:
    """One per worker (thread-safe): accumulates a window, flushes it to the plan's store."""

    def __init__(self, store: PlanStore | None, *, worker: str, flush_s: float = FLUSH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.worker = worker
        self.flush_s = flush_s
        self.clock = clock
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0  # when the current busy stretch (or the window's part of it) began
        self._window_start = 0.0
        self._busy = 0.0
        self._prefill = 0
        self._decode = 0
        self._lengths: Counter[tuple[int, bool]] = Counter()
        self._model: str | None = None
        self._max_new: dict[str, tuple[int, int]] = {}  # batch id -> its max_new_tokens, n
        self._warned = -_WARN_EVERY_S

    @classmethod
    def for_attempt(cls, attempt: Any) -> PlanRecorder:
        """The recorder of a :class:`~lmdq.worker.attempt.JobAttempt`: its queue's client and keys, its
        worker's name (a queue without a Redis client, a test double, records nothing)."""
        jobs = getattr(attempt, "jobs", None)
        client, keys = getattr(jobs, "client", None), getattr(jobs, "keys", None)
        store = PlanStore(client, keys=keys) if isinstance(client, redis.Redis) and keys is not None else None
        return cls(store, worker=str(attempt.worker))

    def enter(self, payload: JobPayload) -> None:
        """A job's requests go into the engine."""
        with self._lock:
            now = self.clock()
            if self._active == 0:
                self._since = now
                if self._busy == 0:
                    self._window_start = now
            self._active += 1
            self._model = payload.model

    def leave(self) -> None:
        """A job left the engine: the window is flushed when the engine is empty or the window is full."""
        with self._lock:
            now = self.clock()
            self._active = max(0, self._active - 1)
            if self._active == 0:
                self._busy += now - self._since
            due = self._active == 0 or now - self._window_start >= self.flush_s
            window = self._take(now) if due else None
        if window is not None:
            self._write(*window)

    def request(self, payload: JobPayload, req: Request, *, generated: int, prefilled: int, completed: bool) -> None:
        """A request's final result: its output length (``completed`` ones only; cut when it reached its
        max_new_tokens) and the tokens its engine computed."""
        own = req.params.max_new_tokens if req.params is not None else None
        own_n = req.params.n if req.params is not None else None
        with self._lock:
            batch = self._max_new.get(payload.batch_id)
            if batch is None:  # the batch's own, resolved once per batch (no per-request validation)
                r = payload.params.resolved()
                batch = (int(r["max_new_tokens"]), int(r.get("n") or 1))
                if len(self._max_new) > 1024:
                    self._max_new.clear()
                self._max_new[payload.batch_id] = batch
            # n samples: ``generated`` is their sum, as a plan counts a request's output (max_new_tokens × n)
            cap = (own if own is not None else batch[0]) * (own_n if own_n is not None else batch[1])
            if completed:
                self._lengths[(generated, generated >= cap)] += 1
            self._prefill += max(0, prefilled)
            self._decode += max(0, generated)

    def _take(self, now: float) -> tuple[str, Counter[tuple[int, bool]], float, int, int] | None:
        """The window so far, reset (lock held); None when there is nothing in it."""
        if self._active > 0:
            self._busy += now - self._since
            self._since = now
        self._window_start = now
        if self._model is None or (self._busy <= 0 and not self._lengths):
            return None
        out = (self._model, self._lengths, self._busy, self._prefill, self._decode)
        self._lengths, self._busy, self._prefill, self._decode = Counter(), 0.0, 0, 0
        return out

    def _write(self, model: str, lengths: Counter[tuple[int, bool]], busy: float, prefill: int, decode: int) -> None:
        if self.store is None:
            return
        try:
            self.store.record(model, self.worker, lengths=lengths, busy_s=busy, prefill=prefill, decode=decode)
        except redis.RedisError as e:
            now = self.clock()
            if now - self._warned >= _WARN_EVERY_S:
                self._warned = now
                log.warning("could not record plan measurements (a later plan rests on fewer)", error=str(e))
