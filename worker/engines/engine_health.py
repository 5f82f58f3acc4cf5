"""Engine health seen from what fails in it: ONE helper for "is this error the engine's, or the request's?"

An engine can die without saying so. A dead engine *process* is found directly (lmdeploy_engine checks the
process and LMDeploy's RPC state), but an in-process engine (TurboMind, or the PyTorch engine with
``--no-mp-engine``) whose CUDA context is broken still answers: every request it holds ends with
``internal_error``. One unit failing is that unit's failure; every unit in flight failing at once, with
nothing finishing well in between, is the engine's. The same rule is kept at two levels with this one
class: requests inside an engine (:mod:`lmdq.worker.engines.lmdeploy_engine`) and jobs in the worker
(:mod:`lmdq.worker.attempt`: every job in the engine raising ``EngineError`` at once).

A streak starts at the first engine-level error and remembers how many units were in flight then. Any
unit finishing well (or :meth:`EngineHealth.ok`) ends the streak. The engine is declared dead when the
streak reaches that number (and at least ``min_units``: with one or two in flight, e.g. a suspected
poison job run one request at a time, errors stay per-unit); everything in flight ending without a trip
ends the streak too. While a streak is open, callers hold their error back (:meth:`wait_verdict`)
instead of failing it, so a dead engine turns nothing into a failure. No clock decides it, except the
``timeout`` a caller gives :meth:`wait_verdict` for units still running.
"""

from __future__ import annotations

import threading

__all__ = ["EngineHealth"]


class EngineHealth:
    """Thread-safe book of units (requests or jobs) in flight and the current streak of engine-level errors."""

    def __init__(self, min_units: int = 4) -> None:
        self.min_units = min_units
        self._cond = threading.Condition()
        self.in_flight = 0
        self.streak = 0
        self.target = 0
        #: bumped each time a streak ends without tripping: held errors of an older epoch are per-request
        self.epoch = 0
        self.tripped = False

    def begin(self, n: int = 1) -> None:
        """``n`` units went into the engine."""
        with self._cond:
            self.in_flight += n

    def _close_streak(self) -> None:
        """End the open streak without a trip (caller holds the lock): its errors were the requests' own."""
        if self.streak and not self.tripped:
            self.streak = self.target = 0
            self.epoch += 1
            self._cond.notify_all()

    def end_ok(self) -> None:
        """A unit finished well (stop/length): the engine works, the streak (if any) is over."""
        with self._cond:
            self.in_flight = max(0, self.in_flight - 1)
            self._close_streak()

    def ok(self) -> None:
        """Something inside a unit still in flight finished well (a job's request): the streak is over."""
        with self._cond:
            self._close_streak()

    def end_neutral(self, n: int = 1) -> None:
        """Units that ended saying nothing about the engine (abort, a per-unit error, abandoned)."""
        with self._cond:
            self.in_flight = max(0, self.in_flight - n)
            if not self.in_flight:  # nothing left that could still fail with them
                self._close_streak()

    def end_engine_error(self) -> int:
        """A unit ended with an engine-level error; returns the epoch to wait on."""
        with self._cond:
            if not self.streak:
                self.target = self.in_flight
            self.in_flight = max(0, self.in_flight - 1)
            self.streak += 1
            epoch = self.epoch
            if self.streak >= max(self.target, self.min_units):
                self.tripped = True
                self._cond.notify_all()
            elif not self.in_flight:  # nothing left that could still fail with them
                self._close_streak()
            return epoch

    def wait_verdict(self, epoch: int, timeout: float) -> bool:
        """Wait until the streak of ``epoch`` trips (True: the engine is dead) or ends (False). Nothing left
        in flight without a trip also ends it (too few units failed to say anything about the engine);
        so does ``timeout`` (the others are still running: these errors were their own)."""
        with self._cond:
            self._cond.wait_for(lambda: self.tripped or self.epoch != epoch, timeout)
            return self.tripped

    def settled(self, epoch: int) -> bool:
        """The streak of ``epoch`` is over, one way or the other (non-blocking :meth:`wait_verdict`)."""
        with self._cond:
            return self.tripped or self.epoch != epoch
