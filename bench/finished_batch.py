"""A submitted batch seen through to its end, as a benchmark measures it: wait until it is terminal, then its
results, their tokens and the moment its last result was stored.

Why one module: every side that drains a real batch (``lmdq-bench e2e``'s worker processes, ``efficiency``'s
and ``samples``' in-process workers) must end its clock at the same event, the batch's ``completed_at`` that
the Lua storing its last result stamps, and count the same tokens, or their ratios compare different things.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from lmdq.contract import Batch, Result
from lmdq.results.store import ResultStore

__all__ = ["FinishedBatch", "read_finished", "timeline", "wait_terminal"]


def wait_terminal(store: ResultStore, batch_id: str, *, poll_s: float,
                  stuck: Callable[[], str | None] | None = None) -> Batch:
    """Poll the batch record until its status is terminal and return that record. ``stuck`` is asked after
    every poll that found it still running: a reason (the worker exited, the deadline passed) ends the wait
    with ``RuntimeError("batch <id> not done (<reason>)")``."""
    while True:
        batch = store.batches.get(batch_id)
        if batch.status.terminal:
            return batch
        why = stuck() if stuck is not None else None
        if why is not None:
            raise RuntimeError(f"batch {batch_id} not done ({why})")
        time.sleep(poll_s)


@dataclass(frozen=True)
class FinishedBatch:
    """What a terminal batch left: its final results (input order), their generated tokens, and when the
    last one was stored (``completed_at``; the latest ``finished_at`` where the record has none)."""

    results: list[Result]
    tokens: int
    last_stored_at: float


def read_finished(store: ResultStore, batch: Batch, n: int) -> FinishedBatch:
    """The final results of the first ``n`` requests of the terminal ``batch`` (partial records not
    counted: a benchmark times finished work only)."""
    rows = [Result.model_validate_json(raw) for _, raw in store.iter_results(batch.id, n, partial=False) if raw]
    done = batch.completed_at or max(r.timings.finished_at or 0 for r in rows)
    return FinishedBatch(results=rows, tokens=sum(r.generate_token_len for r in rows), last_stored_at=done)


def timeline(rows: list[Result], t0: float) -> dict[str, float]:
    """When a batch's results finished and how many requests the worker held meanwhile, from the results' own
    stamps (``started_at`` is the job's start on the worker, ``finished_at`` the request's end).

    Why: a side that is slower on later batches either decodes slower or keeps the engine short of work
    (session 16, TurboMind: lmdq fell from 0.97 to 0.83 of raw over three batches, raw did not). ``held_min``
    is the fewest requests held between the first 10 % and 90 % of results finishing, the stretch where a
    fed engine always has a full running batch; ``held_mean`` the time-weighted mean over the batch;
    ``finished_pNN_s`` seconds from ``t0`` (the submit process's start) to NN % of results finished."""
    spans = [(r.timings.started_at, r.timings.finished_at) for r in rows
             if r.timings.started_at is not None and r.timings.finished_at is not None]
    if not spans:
        return {}
    ends = sorted(f for _, f in spans)

    def done(q: int) -> float:  # when q % of the results had finished
        return ends[max(0, -(-len(ends) * q // 100) - 1)]

    out = {f"finished_p{q}_s": round(done(q) - t0, 3) for q in (10, 50, 90, 99)}
    out["first_started_s"] = round(min(s for s, _ in spans) - t0, 3)
    events = sorted([(s, 1) for s, _ in spans] + [(f, -1) for _, f in spans])  # a finish before a start at one instant
    lo, hi = done(10), done(90)
    held, area, prev, low = 0, 0.0, events[0][0], len(spans)
    for t, d in events:  # the count after each event; the window's lowest is held_min
        area += held * (t - prev)
        held, prev = held + d, t
        if lo <= t < hi:
            low = min(low, held)
    total = ends[-1] - events[0][0]
    out["held_mean"] = round(area / total, 1) if total > 0 else float(len(spans))
    out["held_min"] = float(low)
    return out
