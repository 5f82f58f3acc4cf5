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

__all__ = ["FinishedBatch", "read_finished", "wait_terminal"]


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
