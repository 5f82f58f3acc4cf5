"""Engine death seen from the requests: every request in flight ends with an engine-level error.

A dead engine *process* is found directly (lmdeploy_engine checks the process and LMDeploy's RPC state).
This covers what has no process to look at: an in-process engine (TurboMind, or the PyTorch engine with
``--no-mp-engine``) whose CUDA context is broken still answers, but every request it holds ends with
``internal_error``. One request's ``internal_error`` is that request's failure; all of them at once, with
nothing finishing well in between, is the engine's.

A streak starts at the first engine-level error and remembers how many requests were in flight then
(across every ``stream`` call on the engine). Any request finishing well ends the streak. The engine is
declared dead when the streak reaches that number (and at least ``min_requests``: with one or two requests
in flight, e.g. a suspected poison job run one request at a time, errors stay per-request); so does
everything in flight ending without a trip. While a
streak is open, callers hold their error events back (:meth:`wait_verdict`) instead of failing them, so
a dead engine turns no request into a failure.
"""

from __future__ import annotations

import threading

__all__ = ["FailureBurst"]


class FailureBurst:
    """Thread-safe book of requests in flight and the current streak of engine-level errors."""

    def __init__(self, min_requests: int = 4) -> None:
        self.min_requests = min_requests
        self._cond = threading.Condition()
        self.in_flight = 0
        self.streak = 0
        self.target = 0
        #: bumped each time a streak ends without tripping: held errors of an older epoch are per-request
        self.epoch = 0
        self.tripped = False

    def begin(self, n: int) -> None:
        """``n`` requests went into the engine."""
        with self._cond:
            self.in_flight += n

    def _close_streak(self) -> None:
        """End the open streak without a trip (caller holds the lock): its errors were the requests' own."""
        if self.streak and not self.tripped:
            self.streak = self.target = 0
            self.epoch += 1
            self._cond.notify_all()

    def end_ok(self) -> None:
        """A request finished well (stop/length): the engine works, the streak (if any) is over."""
        with self._cond:
            self.in_flight = max(0, self.in_flight - 1)
            self._close_streak()

    def end_neutral(self, n: int = 1) -> None:
        """Requests that ended saying nothing about the engine (abort, a per-request error, abandoned)."""
        with self._cond:
            self.in_flight = max(0, self.in_flight - n)
            if not self.in_flight:  # nothing left that could still fail with them
                self._close_streak()

    def end_engine_error(self) -> int:
        """A request ended with an engine-level error; returns the epoch to wait on."""
        with self._cond:
            if not self.streak:
                self.target = self.in_flight
            self.in_flight = max(0, self.in_flight - 1)
            self.streak += 1
            epoch = self.epoch
            if self.streak >= max(self.target, self.min_requests):
                self.tripped = True
                self._cond.notify_all()
            elif not self.in_flight:  # nothing left that could still fail with them
                self._close_streak()
            return epoch

    def wait_verdict(self, epoch: int, timeout: float) -> bool:
        """Wait until the streak of ``epoch`` trips (True: the engine is dead) or ends (False). Nothing left
        in flight without a trip also ends it (too few requests failed to say anything about the engine);
        so does ``timeout`` (the others are still running: these errors were their own)."""
        with self._cond:
            self._cond.wait_for(lambda: self.tripped or self.epoch != epoch, timeout)
            return self.tripped

    def settled(self, epoch: int) -> bool:
        """The streak of ``epoch`` is over, one way or the other (non-blocking :meth:`wait_verdict`)."""
        with self._cond:
            return self.tripped or self.epoch != epoch
