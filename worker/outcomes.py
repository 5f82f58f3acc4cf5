"""How a job attempt ends, why a held job is stopped, and how the worker process ends.

Faults are not failures: only what the engine reports about a job's own requests spends one of its
``max_attempts``. Everything else (a drain, a lost lease, a store error, an engine death) re-runs
the work for free. docs/reliability.md ("What counts as an attempt") is the user-facing version.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["EXIT_ENGINE_DEAD", "MAX_RUNS", "SUSPECT_AFTER_CRASHES", "AbortReason", "AttemptEnd", "Outcome"]

EXIT_ENGINE_DEAD = 70
"""Process exit code after the engine died (EX_SOFTWARE): the supervisor starts a fresh worker."""

MAX_RUNS = 100
"""Safety cap on UNCHARGED runs of one job (drains, lost leases, store errors, engine deaths): a job
that can never finish (say, every run is cut short by a restart) still ends, its unfinished requests
``failed`` with code ``max_runs_exceeded``. Far above any real fleet's interruptions."""

SUSPECT_AFTER_CRASHES = 2
"""A job whose runs were cut short by this many engine deaths runs alone in the engine, one request
at a time, so the request that kills it is known and fails (``engine_crash``) instead of the fleet
crash-looping on it."""


class AbortReason(str, Enum):
    """Why a held job's in-flight requests are being stopped."""

    #: the batch was cancelled: unfinished requests end ``cancelled``
    cancel = "cancel"
    #: the worker is stopping (SIGTERM, drain timeout): the job runs again elsewhere, uncharged
    drain = "drain"
    #: the lease was reaped (the worker was presumed dead): another worker owns the job now
    lost = "lost"
    #: the engine died: the job runs again on a fresh engine, uncharged, its crash counted
    engine_dead = "engine_dead"


class Outcome(str, Enum):
    """How one job attempt ended: what the worker does with the job's lease."""

    #: every request has a final result: release the lease, RQ marks the job finished
    done = "done"
    #: every request has a final result but the job failed as a whole (attempts exhausted): RQ failed
    failed = "failed"
    #: the engine failed the job's requests (or processing them crashed): re-queue, charging one attempt
    retry = "retry"
    #: infrastructure, not the job (drain, store error, lost engine slot): re-queue, uncharged
    requeue = "requeue"
    #: the engine died under the job: re-queue, uncharged, one engine crash counted against the job
    crashed = "crashed"
    #: the lease is gone: the new owner runs the job; touch nothing
    lost = "lost"
    #: not an lmdq job: dropped from the queue and failed in RQ, never run
    refused = "refused"


@dataclass(frozen=True)
class AttemptEnd:
    """The end of one attempt: the outcome, RQ's failure text, and for a crash the request that was
    alone in the engine when it died."""

    outcome: Outcome
    failure: str | None = None
    killer: int | None = None
    #: for ``crashed``: what the engine said as it died
    error: str | None = None
