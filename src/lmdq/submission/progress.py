"""A batch's progress for a person at a terminal and for a log: done/total, rate, ETA, and why
nothing moves.

``status --watch``, ``results --wait`` and ``results --follow -o FILE`` share it. On a terminal it
draws one live bar (rich) with requests/s, tokens/s and the ETA beside it. Anywhere else (a log
file, CI) a redrawn bar would be noise and a line per poll is 86,400 lines a day, so it writes a
plain line when the status changes, when the no-worker hint appears or goes, when the batch ends,
and otherwise one line per ``interval_s`` (``--interval``, 30 s by default). Polling stays at about
once a second either way, so the end of a batch is seen at once.

Rates are measured over the last :data:`RATE_WINDOW_S` seconds of polls, not since the start: a
batch that waited an hour for a worker and then runs at 500 req/s shows 500, and its ETA follows.
Tokens/s reads the batch's ``output_tokens`` counter, which the results script bumps with each
final result (:mod:`lmdq.results.store`). Whether a live worker serves each model the batch still waits on is read
from the worker registry every :data:`WORKER_CHECK_S` seconds; a batch nobody can run says so, naming
every such model (it would otherwise show ``queued 0/8`` forever, or a batch over several models would
stall at 2/3 with no word about its third).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, TextIO

from lmdq.contract import Batch, BatchStatus

if TYPE_CHECKING:
    # rich and the stores (redis-py) are imported where a progress is drawn or read: the CLI reads this
    # module's DEFAULT_INTERVAL_S for its --interval options at start-up (issue 49: `--help` and
    # `status` import only what they need)
    from rich.progress import Progress as Bar
    from rich.progress import TaskID

    from lmdq.registry.store import ModelRegistry
    from lmdq.results.store import ResultStore

__all__ = [
    "DEFAULT_INTERVAL_S",
    "POLL_S",
    "RATE_WINDOW_S",
    "WORKER_CHECK_S",
    "BatchProgress",
    "Rates",
    "RateWindow",
    "format_duration",
    "no_worker_hint",
    "waiting_models",
    "watch",
]

DEFAULT_INTERVAL_S = 30.0
"""Seconds between progress lines in a log when nothing else happened (``--interval``)."""

POLL_S = 1.0
"""Seconds between polls of the batch (at most: a smaller ``--interval`` polls that often)."""

RATE_WINDOW_S = 60.0
"""Rates are measured over this much recent time."""

WORKER_CHECK_S = 5.0
"""Seconds between checks for a live worker of the batch's model (a few Redis calls each)."""


@dataclass(frozen=True)
class Rates:
    """Requests and generated tokens per second over the recent window (None: not measurable yet)."""

    requests_s: float | None
    tokens_s: float | None


class RateWindow:
    """Samples ``(time, requests done, tokens)``; rates over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int, int]] = deque()

    def add(self, at: float, done: int, tokens: int) -> None:
        self._samples.append((at, done, tokens))
        # keep one sample older than the window, so the window is always covered
        while len(self._samples) > 2 and self._samples[1][0] <= at - self.window_s:
            self._samples.popleft()

    def rates(self) -> Rates:
        if len(self._samples) < 2:
            return Rates(None, None)
        t0, d0, k0 = self._samples[0]
        t1, d1, k1 = self._samples[-1]
        if t1 - t0 <= 0:
            return Rates(None, None)
        return Rates(max(0, d1 - d0) / (t1 - t0), max(0, k1 - k0) / (t1 - t0))


def format_duration(s: float | None) -> str:
    """``4s``, ``3m05s``, ``2h07m``, ``3d04h``; ``-`` for unknown."""
    if s is None or s != s or s == float("inf"):
        return "-"
    s = max(0, int(round(s)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _rate(v: float | None, unit: str) -> str:
    if v is None:
        return f"- {unit}"
    return f"{v:,.0f} {unit}" if v >= 100 else f"{v:.1f} {unit}"


def waiting_models(b: Batch) -> list[str]:
    """The models ``b`` still has requests waiting on (all of a batch of one model until it ends; of a
    batch over several, each model with requests not done yet), in the batch's order."""
    if b.status.terminal:
        return []
    if not b.model_counts:
        return [b.model]
    return [m for m, c in b.model_counts.items() if c.total > c.done]


def no_worker_hint(b: Batch, live_workers: Mapping[str, int] | None) -> str | None:
    """What to do about the models of ``b`` that no live worker serves (None when every model the batch
    still waits on has one, when the batch has ended, or when the workers are unknown).

    ``live_workers``: live workers per model name (a model absent: none). Every model the batch waits on
    without a worker is named, with its waiting requests when the batch runs over several models."""
    if live_workers is None:
        return None
    idle = [m for m in waiting_models(b) if live_workers.get(m, 0) <= 0]
    if not idle:
        return None
    if not b.model_counts or len(b.model_counts) == 1:
        m = idle[0]
        return (f"no live worker serves model {m!r}: its requests wait until one starts "
                f"(lmdq-worker --served-model-name {m} ...; see `lmdq-producer models list`)")
    counts = b.model_counts

    def waiting(m: str) -> str:
        return f"{m!r} ({counts[m].total - counts[m].done:,} waiting)"

    if len(idle) == 1:
        m = idle[0]
        return (f"no live worker serves model {waiting(m)}: its requests wait until one starts "
                f"(lmdq-worker --served-model-name {m} ...; see `lmdq-producer models list`)")
    starts = "; ".join(f"lmdq-worker --served-model-name {m} ..." for m in idle)
    return (f"no live worker serves models {', '.join(waiting(m) for m in idle)}: their requests wait until "
            f"one starts for each ({starts}; see `lmdq-producer models list`)")


class BatchProgress:
    """Shows a batch's progress on ``stream``: a live bar on a terminal, throttled lines elsewhere.

    Call :meth:`update` with each fresh :class:`Batch` (every poll); use as a context manager so the
    live bar is taken down. ``clock`` is monotonic seconds, ``wall`` the time shown on log lines
    (both injectable: the throttling is tested without waiting)."""

    def __init__(
        self,
        *,
        store: ResultStore,
        models: ModelRegistry | None,
        stream: TextIO,
        terminal: bool,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        quiet: bool = False,
    ) -> None:
        self.store = store
        self.models = models
        self.stream = stream
        self.terminal = terminal
        self.interval_s = interval_s
        self.quiet = quiet
        self.clock = clock
        self.wall = wall
        self.window = RateWindow()
        self.started = clock()
        self.lines = 0
        self._live: dict[str, int] | None = None
        self._tokens = 0
        self._checked_at: float | None = None
        self._checked_status: BatchStatus | None = None
        self._said: tuple[str, str | None] | None = None  # (status, hint) of the last line
        self._last_line_at = -float("inf")
        self._bar: Bar | None = None
        self._task: TaskID | None = None
        self._hint_shown: str | None = None

    # ---- context --------------------------------------------------------------------------
    def __enter__(self) -> BatchProgress:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    # ---- one poll -------------------------------------------------------------------------
    def update(self, b: Batch) -> None:
        if self.quiet:
            return
        now = self.clock()
        # The display's own reads (tokens, live workers) are not the poll: a Redis that goes away between
        # the poll and them must not end a wait that the next, patient poll would ride out (the poll says
        # "lost Redis" and waits); the last values are shown meanwhile.
        from lmdq.redis.connection import RETRYABLE_ERRORS

        try:
            tokens = self._tokens = self.store.output_tokens(b.id)
        except RETRYABLE_ERRORS:
            tokens = self._tokens
        self.window.add(now, b.request_counts.done, tokens)
        hint = no_worker_hint(b, self._live_workers(b, now))
        if self.terminal:
            self._draw(b, tokens, hint)
            return
        state = (b.status.value, hint)
        if state != self._said or b.status.terminal or now - self._last_line_at >= self.interval_s:
            if b.status.terminal and self._said is not None and self._said[0] == b.status.value:
                return  # the end is said once
            self._say(self.line(b, tokens), hint if hint is not None and state != self._said else None)
            self._said, self._last_line_at = state, now

    def _live_workers(self, b: Batch, now: float) -> dict[str, int] | None:
        """Live workers of each model the batch waits on (read every WORKER_CHECK_S; None: not known)."""
        if self.models is None or b.status.terminal:
            return None
        # again at once when the status moved (queued -> in_progress: someone serves it after all)
        if self._checked_at is None or now - self._checked_at >= WORKER_CHECK_S or b.status != self._checked_status:
            from lmdq.redis.connection import RETRYABLE_ERRORS

            self._checked_at, self._checked_status = now, b.status
            try:
                served = {m.name: m.live_workers for m in self.models.models()}
                self._live = {m: served.get(m, 0) for m in b.models}
            except RETRYABLE_ERRORS:
                self._checked_at = None  # asked again at the next poll
        return self._live

    def summary(self, b: Batch, tokens: int) -> str:
        """``3.2 req/s  410 tok/s  ETA 1m27s`` (rate and ETA over the recent window)."""
        r = self.window.rates()
        c = b.request_counts
        left = c.total - c.done
        if b.status.terminal or left <= 0:
            eta = "done"
        elif r.requests_s:
            eta = f"ETA {format_duration(left / r.requests_s)}"
        else:
            eta = "ETA -"
        return f"{_rate(r.requests_s, 'req/s')}  {_rate(r.tokens_s, 'tok/s')}  {eta}"

    def line(self, b: Batch, tokens: int) -> str:
        """One log line: time, status, done/total (percent), rates, ETA, and any non-zero failures."""
        c = b.request_counts
        pct = f"{100 * c.done / c.total:.1f}%" if c.total else "-"
        ts = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.wall()))
        bad = " ".join(f"{k}={v}" for k, v in (("failed", c.failed), ("cancelled", c.cancelled),
                                               ("expired", c.expired)) if v)
        elapsed = format_duration(self.clock() - self.started)
        return (f"{ts} {b.id} {b.status.value} {c.done}/{c.total} done ({pct}) {self.summary(b, tokens)}"
                f"{' ' + bad if bad else ''} elapsed={elapsed}")

    def _say(self, line: str, hint: str | None) -> None:
        text = line + "\n" + (f"hint: {hint}\n" if hint else "")
        self.stream.write(text)  # one write: a line never interleaves with another thread's output
        self.stream.flush()
        self.lines += 1

    def _draw(self, b: Batch, tokens: int, hint: str | None) -> None:
        c = b.request_counts
        if self._bar is None or self._task is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                            console=Console(file=self.stream), transient=False)
            self._bar.start()
            self._task = self._bar.add_task(b.status.value, total=c.total, completed=c.done, info="")
        if hint != self._hint_shown:
            if hint:
                self._bar.console.print(f"hint: {hint}", markup=False, highlight=False)
            self._hint_shown = hint
        self._bar.update(self._task, completed=c.done, total=c.total, description=b.status.value,
                         info=self.summary(b, tokens))


def watch(
    get: Callable[[], Batch],
    progress: BatchProgress,
    first: Batch,
    *,
    deadline: float | None = None,
    poll_s: float = POLL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Batch:
    """Poll ``get`` until the batch ends or is paused (a quality gate failed: only ``resume`` or ``cancel``
    moves it on), or ``deadline`` (on ``clock``), showing each poll on ``progress``; returns the last batch
    seen (the caller tells a timeout by its status)."""
    b = first
    progress.update(b)
    while not b.status.terminal and b.status is not BatchStatus.paused:
        if deadline is not None and clock() >= deadline:
            return b
        sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - clock())))
        b = get()
        progress.update(b)
    return b
