"""The idle worker's sleep: its loop waits on a condition while a helper thread blocks in Redis.

Why a thread: a BLPOP in the loop's own (main) thread could not be cut short by SIGTERM (Python
resumes an interrupted ``recv`` for the rest of its timeout), so a drain would wait for the whole
block. Here the loop waits on the worker's condition, which the signal handler and ``Worker.stop``
notify, and the helper thread does the blocking (:class:`lmdq.jobs.wakeup.WakeUp`) only while the loop
asks for it: a busy worker never pops a token meant for an idle one. A token that arrives when nobody
waits any more (the worker began draining, or gave up on a slow Redis) is passed on to the next idle
worker, never swallowed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import redis

from lmdq.jobs.wakeup import BLOCK_MARGIN_S, WakeUp

__all__ = ["IdleWaiter"]

ERROR_PAUSE_S = 1.0
"""After a failed block (Redis away, a proxy refusing BLPOP) the helper waits this long before the next,
so a broken Redis is not hammered; the loop, woken at once, tries its claim and backs off on its own."""


class IdleWaiter:
    """Wakes the worker loop when a token arrives on its model's wake list, or after ``wakeup.block_s``.

    :meth:`wait` is called with ``cond`` held (the worker's ``_slot``); the helper thread takes ``cond``
    only to hand results over, never while blocked in Redis.
    """

    def __init__(self, wakeup: WakeUp, cond: threading.Condition, *, log: Any) -> None:
        self.wakeup = wakeup
        self.cond = cond
        self.log = log
        self._armed = False  # the loop waits for a wake-up now
        self._woken = False  # the current wait has its answer (token, timeout or error)
        self._closed = False
        self._failing = False
        #: tokens popped (tests and the worker's stop line read it)
        self.tokens = 0
        self._thread = threading.Thread(target=self._run, name="lmdq-idle-wait", daemon=True)
        self._thread.start()

    def wait(self, stop: threading.Event) -> bool:
        """Sleep until woken (True) or ``stop`` is set (False); ``cond`` must be held by the caller.

        The block itself ends after ``block_s`` at most (then the loop claims anyway: the safety net
        for a lost token); the extra margin only matters when Redis does not answer the block."""
        self._armed, self._woken = True, False
        self.cond.notify_all()
        deadline = time.monotonic() + self.wakeup.block_s + BLOCK_MARGIN_S
        while not self._woken and not stop.is_set() and not self._closed:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.cond.wait(left)
        woken = self._woken
        self._armed = False
        return woken

    def close(self) -> None:
        """Stop the helper thread now, cutting a block in progress (the worker is stopping)."""
        with self.cond:
            self._closed = True
            self.cond.notify_all()
        self.wakeup.close()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self._armed and not self._closed:
                    self.cond.wait()
                if self._closed:
                    return
            try:
                got = self.wakeup.wait()
                error: Exception | None = None
            except Exception as e:  # noqa: BLE001 - redis errors, and OSError/ValueError from a cut socket
                got, error = False, e
            with self.cond:
                if got:
                    self.tokens += 1
                wanted = self._armed and not self._closed
                if wanted:
                    self._woken, self._armed = True, False
                    self.cond.notify_all()
                closed = self._closed
            if got and not wanted:
                self._pass_on()
            if closed:
                return
            if error is not None:
                self._report(error)
                time.sleep(ERROR_PAUSE_S)
            elif self._failing:
                self._failing = False
                self.log.info("idle wait recovered")

    def _pass_on(self) -> None:
        """A token nobody waits for goes back for the next idle worker (best effort: a lost token only
        delays work until some idle worker's block ends)."""
        try:
            self.wakeup.notify()
        except redis.RedisError:
            pass

    def _report(self, e: Exception) -> None:
        """One warning per episode of failed blocks (the claims report Redis outages themselves)."""
        if not self._failing:
            self._failing = True
            self.log.warning("idle wait failed; claiming on a timer until it works (LMDQ_IDLE_WAIT_S=0 "
                             "polls instead, for a Redis proxy without BLPOP)", error=str(e))
