"""Deadlines (issue 46): when an open batch will finish, and how many workers its model needs.

A batch's work left is its requests not yet answered. What one of them costs a worker comes, in order:

1. from the batch itself once it has answered some: its measured rate (requests answered / seconds since
   it went in progress) projects its finish directly (``now + left / rate``), and that rate over the
   model's live workers is what a request costs one of them;
2. before that, from the model's history (:class:`lmdq.plan.store.History`): the busy seconds its workers
   spent per request they finished.

``workers_needed``: the model's open deadline batches in deadline order (the order the queue serves them:
earliest deadline first), each needing the work of every batch before it and its own done by its deadline:
``max over k of ceil(sum of work left up to k / seconds to deadline k)``, at least 1 while any work is
left. A deadline already passed counts :data:`MIN_LEFT_S` seconds away (the work is still wanted, as soon
as possible). Nothing is known about the cost (no history, no progress): 1 worker per model with work left.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lmdq.plan.store import History

__all__ = ["MIN_LEFT_S", "DeadlineBatch", "Outlook", "outlook", "parse_deadline", "seconds_per_request",
           "workers_needed"]

MIN_LEFT_S = 60.0
"""Seconds a deadline counts as away once it has passed (or is closer than this)."""


@dataclass(frozen=True)
class DeadlineBatch:
    """What the projection reads of an open batch."""

    id: str
    model: str
    deadline: float
    total: int
    answered: int
    #: when its first request started (in_progress_at; None: not started)
    started_at: float | None

    @property
    def left(self) -> int:
        return max(0, self.total - self.answered)


@dataclass(frozen=True)
class Outlook:
    """A batch's projected finish (None: unknown) against its deadline, and what it rests on."""

    batch_id: str
    deadline: float
    finish: float | None
    basis: str

    @property
    def misses(self) -> bool:
        return self.finish is not None and self.finish > self.deadline

    def warning(self) -> str | None:
        """The line ``status`` prints (None when on time or unknown)."""
        if not self.misses or self.finish is None:
            return None
        late = self.finish - self.deadline
        return (f"warning: batch {self.batch_id} is projected to finish {_span(late)} after its deadline "
                f"({self.basis})")


def parse_deadline(value: str | float | None, *, now: float | None = None) -> float | None:
    """A deadline as Unix time: ISO 8601 with its zone (``2026-12-06T07:00Z``, ``...+01:00``) or a number
    (Unix time); None stays None. It must be in the future: a batch cannot be sized for a time already
    gone. ValueError says what was expected and what was given."""
    import datetime as dt
    import time

    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        at = float(value)
    else:
        text = str(value).strip()
        try:
            parsed = dt.datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
        except ValueError:
            raise ValueError("expected an ISO 8601 time with its zone, e.g. 2026-12-06T07:00Z; "
                             f"got {value!r}") from None
        if parsed.tzinfo is None:
            raise ValueError(f"expected a time with its zone (Z or +HH:MM), e.g. 2026-12-06T07:00Z; got {value!r}")
        at = parsed.timestamp()
    if not math.isfinite(at) or at <= (time.time() if now is None else now):
        raise ValueError(f"expected a time in the future, got {value!r}")
    return at


def _span(s: float) -> str:
    return f"{s:,.0f} s" if s < 120 else f"{s / 60:,.1f} min" if s < 7200 else f"{s / 3600:,.1f} h"


def seconds_per_request(history: History) -> float | None:
    """Busy seconds of one worker per request, from the model's history (None: none recorded)."""
    busy = sum(r.busy_s for r in history.rates)
    n = history.requests
    return busy / n if busy > 0 and n > 0 else None


def outlook(b: DeadlineBatch, *, history: History, live_workers: int, now: float) -> Outlook:
    """``b``'s projected finish (see the module doc)."""
    if b.left == 0:
        return Outlook(b.id, b.deadline, now, "every request answered")
    if b.answered > 0 and b.started_at is not None and now > b.started_at:
        rate = b.answered / (now - b.started_at)
        return Outlook(b.id, b.deadline, now + b.left / rate,
                       f"measured {rate:,.2f} requests/s so far, {b.left:,} requests left")
    spr = seconds_per_request(history)
    if spr is None:
        return Outlook(b.id, b.deadline, None, f"no history for {b.model} and no progress yet: unknown")
    if live_workers <= 0:
        return Outlook(b.id, b.deadline, math.inf, f"no live worker serves {b.model}")
    return Outlook(b.id, b.deadline, now + b.left * spr / live_workers,
                   f"{b.left:,} requests left at {spr:,.3f} worker-seconds each ({b.model}'s history), "
                   f"{live_workers} live worker(s)")


def _cost(b: DeadlineBatch, spr: float | None, live_workers: int, now: float) -> float | None:
    """Worker-seconds per request for ``b``: its own measured rate over the live workers, else history."""
    if b.answered > 0 and b.started_at is not None and now > b.started_at and live_workers > 0:
        return live_workers * (now - b.started_at) / b.answered
    return spr


def workers_needed(batches: Sequence[DeadlineBatch], *, history: History, live_workers: int, now: float) -> int:
    """Workers the model needs to meet every deadline of ``batches`` (its open deadline batches)."""
    open_ = sorted((b for b in batches if b.left > 0), key=lambda b: b.deadline)
    if not open_:
        return 0
    spr = seconds_per_request(history)
    need, work = 1, 0.0
    for b in open_:
        cost = _cost(b, spr, live_workers, now)
        if cost is None:
            continue
        work += b.left * cost
        need = max(need, math.ceil(work / max(b.deadline - now, MIN_LEFT_S)))
    return need
