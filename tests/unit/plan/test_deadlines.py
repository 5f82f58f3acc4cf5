"""lmdq.plan.deadlines: parsing, a batch's projected finish, the workers its model needs (no Redis)."""

from __future__ import annotations

import math

import pytest

from lmdq.plan.deadlines import MIN_LEFT_S, DeadlineBatch, outlook, parse_deadline, workers_needed
from lmdq.plan.store import History, WorkerRate

NOW = 1_000_000.0
#: 2 busy worker-seconds per recorded request
HISTORY = History(model="m", stopped={5: 50}, rates=[WorkerRate("w", 100.0, 0, 250, [], NOW)], now=NOW)


def batch(deadline_in: float, total: int, answered: int = 0, started_ago: float | None = None,
          bid: str = "b") -> DeadlineBatch:
    return DeadlineBatch(id=bid, model="m", deadline=NOW + deadline_in, total=total, answered=answered,
                         started_at=None if started_ago is None else NOW - started_ago)


def test_parse_deadline() -> None:
    assert parse_deadline("1970-01-12T13:46:40Z", now=0) == NOW
    assert parse_deadline("1970-01-12T14:46:40+01:00", now=0) == NOW
    assert parse_deadline(NOW + 5, now=NOW) == NOW + 5
    assert parse_deadline(None) is None
    for bad, says in [("soon", "ISO 8601"), ("1970-01-12T13:46:40", "with its zone"), (NOW - 1, "in the future")]:
        with pytest.raises(ValueError, match=says):
            parse_deadline(bad, now=NOW)


def test_outlook_from_history_then_from_the_measured_rate() -> None:
    o = outlook(batch(100, 100), history=HISTORY, live_workers=1, now=NOW)
    assert o.finish == NOW + 100 * 2 and o.misses and "history" in o.basis
    assert "batch b is projected to finish 100 s after its deadline" in (o.warning() or "")
    ok = outlook(batch(100, 100), history=HISTORY, live_workers=4, now=NOW)
    assert not ok.misses and ok.warning() is None
    measured = outlook(batch(1000, 100, answered=50, started_ago=100), history=HISTORY, live_workers=1, now=NOW)
    assert measured.finish == NOW + 100 and "measured 0.50 requests/s" in measured.basis
    assert outlook(batch(100, 10), history=History(model="m"), live_workers=1, now=NOW).finish is None
    assert outlook(batch(100, 10), history=HISTORY, live_workers=0, now=NOW).finish == math.inf


def test_workers_needed_covers_every_deadline_earliest_first() -> None:
    assert workers_needed([], history=HISTORY, live_workers=1, now=NOW) == 0
    assert workers_needed([batch(3600, 100)], history=HISTORY, live_workers=1, now=NOW) == 1
    # 200 worker-seconds by 100 s from now: 2; a later batch adds its work to the one before it
    assert workers_needed([batch(100, 100)], history=HISTORY, live_workers=1, now=NOW) == 2
    two = [batch(400, 300, bid="late"), batch(100, 100, bid="soon")]
    assert workers_needed(two, history=HISTORY, live_workers=1, now=NOW) == 2  # (200 + 600) / 400
    tighter = [batch(300, 300, bid="late"), batch(100, 100, bid="soon")]
    assert workers_needed(tighter, history=HISTORY, live_workers=1, now=NOW) == 3  # 800 / 300
    # a passed deadline counts MIN_LEFT_S away; nothing known: one worker while work is left
    assert workers_needed([batch(-5, 30)], history=HISTORY, live_workers=1, now=NOW) == math.ceil(60 / MIN_LEFT_S)
    assert workers_needed([batch(100, 10)], history=History(model="m"), live_workers=1, now=NOW) == 1
