"""How much work to hold: how many jobs to claim now, and who may be in the engine at once.

Keep the engine's slots full plus a lookahead queued behind them: one whole engine-full (at least
one job) by default. Requests of equal length that started together all end in the same decode step
(uniform ``max_new_tokens`` with ``ignore_eos``, or a wave of short outputs), freeing every slot at
once; only requests already handed to the engine can fill those slots in the step they free up. A
claim round trip (claim, read, begin, stream: several Redis calls and thread switches) takes longer
than a decode step, so with half an engine-full behind, half the slots idled a step or two in every
wave (sim, 5 ms steps, 32-token outputs: 1,700-3,300 empty slot-steps a run; a whole engine-full: 0-64;
numbers in docs/performance.md).

A request's slot is counted free when the engine returns its final event, not when its job ends:
a job whose other requests are still decoding (or whose results are still being written) no longer
holds the slots its finished requests left, so the worker claims the next job as soon as one job's
worth of slots is free. The worker claims nothing while its engine is dead, while the store refuses
writes, or while a suspect job (one that has killed engines) waits to run alone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Admission", "EngineGate", "fair_share"]

MAX_CLAIM = 64
"""Most jobs one claim call takes (one Lua call claims them all: see JobQueue.claim_many)."""


class Admission:
    """Request accounting of the jobs a worker holds (all methods are called under the worker's lock)."""

    def __init__(self, *, capacity: int, max_jobs: int, prefetch_requests: int) -> None:
        self.capacity = max(1, capacity)
        self.max_jobs = max(1, max_jobs)
        self.prefetch_requests = prefetch_requests
        #: requests counted against capacity (a claimed job counts as one last-seen job until read)
        self.requests_in_flight = 0
        self.last_job_size = 32

    @property
    def lookahead(self) -> int:
        """Requests held beyond capacity: ``prefetch_requests``, else one engine-full (at least one job)."""
        return self.prefetch_requests or max(self.last_job_size, self.capacity)

    def free(self) -> int:
        """Requests the worker may still take on (negative: over, e.g. while jobs are being read)."""
        return self.capacity + self.lookahead - self.requests_in_flight

    def job_fits(self) -> bool:
        """A whole job of the last seen size fits: worth waking the claimer for."""
        return self.free() >= self.last_job_size

    def room(self, held_jobs: int) -> int:
        """How many more jobs to claim now."""
        free = self.free()
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


def fair_share(room: int, *, held: int, visible: int, idle_peers: int) -> int:
    """How many of ``room`` jobs to claim while ``idle_peers`` other workers of the model have nothing.

    The work in sight (``visible`` jobs on the queues plus the ``held`` ones) is split evenly over
    this worker and the idle ones, rounded up: with 4 jobs and one idle peer each takes 2, and the
    peer, woken by the token this claim passes on, finds its 2 still queued. A worker holding nothing
    always gets at least one job of a non-empty queue (no one waits on a peer that never comes), and
    with no idle peer, or a batch whose share exceeds ``room``, the claim is ``room`` as before.
    """
    if idle_peers <= 0 or room <= 0:
        return room
    target = -(-(visible + held) // (idle_peers + 1))
    return max(0, min(room, target - held))


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
