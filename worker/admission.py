"""How much work to hold: how many jobs to claim now, and who may be in the engine at once.

Keep the engine's slots full plus a lookahead queued behind them (half an engine-full, at least one
job), so when many sequences end in the same step the engine refills from requests it already holds
instead of waiting for the next claim round trip. The worker claims nothing while its engine is dead,
while the store refuses writes, or while a suspect job (one that has killed engines) waits to run
alone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Admission", "EngineGate"]

MAX_CLAIM = 64
"""Most jobs one claim call takes (one Lua call claims them all: see JobQueue.claim_many)."""


class Admission:
    """Request accounting of the jobs a worker holds (all methods are called under the worker's lock)."""

    def __init__(self, *, capacity: int, max_jobs: int, prefetch_requests: int = 0) -> None:
        self.capacity = max(1, capacity)
        self.max_jobs = max(1, max_jobs)
        self.prefetch_requests = prefetch_requests
        #: requests counted against capacity (a claimed job counts as one last-seen job until read)
        self.requests_in_flight = 0
        self.last_job_size = 32

    def room(self, held_jobs: int) -> int:
        """How many more jobs to claim now."""
        lookahead = self.prefetch_requests or max(self.last_job_size, self.capacity // 2)
        free = self.capacity + lookahead - self.requests_in_flight
        if free <= 0:
            return 0
        return max(0, min(self.max_jobs - held_jobs, -(-free // max(1, self.last_job_size)), MAX_CLAIM))

    def reserve(self) -> int:
        """Count a just-claimed job (size unknown until its payload is read); returns the reservation."""
        self.requests_in_flight += self.last_job_size
        return self.last_job_size

    def resize(self, reserved: int, actual: int) -> int:
        """The job's payload says it has ``actual`` requests; returns the new reservation."""
        self.requests_in_flight += actual - reserved
        self.last_job_size = max(1, actual)
        return actual

    def release(self, reserved: int) -> None:
        self.requests_in_flight -= reserved


class EngineGate:
    """Shared entry for ordinary jobs, exclusive entry for a suspect job.

    A job that has been in the engine when it died twice runs ALONE, one request at a time: then, if
    the engine dies again, the request in it is the one that killed it (and only that one fails,
    ``engine_crash``). Exclusive entry waits for the jobs in the engine to leave and keeps new ones
    out (writer preference), so a suspect job cannot starve behind a stream of ordinary ones.
    Waits end early when ``cancelled()`` says so (drain, engine death, abort).
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    @property
    def exclusive_wanted(self) -> bool:
        """A suspect job waits or runs: claim nothing new."""
        with self._cv:
            return self._exclusive or self._waiting > 0

    def in_engine(self) -> int:
        """Jobs inside the engine now."""
        with self._cv:
            return self._shared + (1 if self._exclusive else 0)

    @contextmanager
    def shared(self, cancelled: threading.Event) -> Iterator[bool]:
        """Enter beside other ordinary jobs; yields False if ``cancelled`` was set while waiting."""
        with self._cv:
            while (self._exclusive or self._waiting) and not cancelled.is_set():
                self._cv.wait(0.2)
            if cancelled.is_set():
                entered = False
            else:
                self._shared += 1
                entered = True
        try:
            yield entered
        finally:
            if entered:
                with self._cv:
                    self._shared -= 1
                    self._cv.notify_all()

    @contextmanager
    def exclusive(self, cancelled: threading.Event) -> Iterator[bool]:
        """Enter alone; yields False if ``cancelled`` was set while waiting."""
        with self._cv:
            self._waiting += 1
            try:
                while (self._exclusive or self._shared) and not cancelled.is_set():
                    self._cv.wait(0.2)
            finally:
                self._waiting -= 1
            entered = not cancelled.is_set()
            if entered:
                self._exclusive = True
            self._cv.notify_all()
        try:
            yield entered
        finally:
            if entered:
                with self._cv:
                    self._exclusive = False
                    self._cv.notify_all()
