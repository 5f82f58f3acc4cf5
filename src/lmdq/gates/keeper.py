"""What a worker does with a gated job's results when the job ends (the one call in
``lmdq.worker.attempt``): judge them, record them, and on the canary's last job or a full rolling window,
give the verdict: release the held jobs, or pause the batch with a report.

Why the worker and not a watcher: the verdict is due the moment the canary's last result is written, and
the worker that wrote it is there; no extra process, no polling, and a verdict fenced in Redis (any worker
may be the one: whichever records the canary's last job).
"""

from __future__ import annotations

from typing import Any

from lmdq.contract import JobPayload, Result
from lmdq.gates.gates import entry_of, judge
from lmdq.gates.store import GateStore
from lmdq.jobs.queue import job_id_for
from lmdq.results.store import ResultStore

__all__ = ["GateKeeper"]


class GateKeeper:
    """Judges gated jobs for one worker (thread-safe: it keeps no state of its own)."""

    def __init__(self, store: ResultStore) -> None:
        self.results = store
        self.store = GateStore(store.client, keys=store.keys)

    def job_ended(self, payload: JobPayload, log: Any) -> None:
        """``payload``'s job ended (done or failed, its results written, not yet sealed). Nothing for an
        ungated job. Never raises for bad stored data: a result that does not parse is not judged."""
        if not payload.gated:
            return
        config = self.store.config(payload.batch_id)
        if config is None:
            return
        finals, _ = self.results.read_records(payload.batch_id, [r.index for r in payload.requests], partial=False)
        entries = []
        for req, raw in zip(payload.requests, finals):
            if raw is None:
                continue
            try:
                result = Result.model_validate_json(raw)
            except ValueError:
                continue
            rf = payload.params.merged(req.params).response_format
            e = entry_of(result, config, rf)
            if e is not None:
                entries.append(e)
        phase, seen = self.store.record(payload.batch_id, job_id_for(payload.batch_id, payload.job_no),
                                        payload.job_no, entries, config.window)
        if phase not in ("canary", "window"):
            return
        verdict = judge(seen, config)
        if verdict.passed:
            if phase == "canary":
                n = self.store.release(payload.batch_id)
                log.info("canary passed: the rest of the batch runs", batch=payload.batch_id, judged=verdict.judged,
                         released_jobs=max(0, n))
            return
        report = {"phase": phase, **verdict.model_dump()}
        if self.store.pause(payload.batch_id, report, verdict="failed" if phase == "canary" else "paused"):
            log.warning("quality gate failed: batch paused", batch=payload.batch_id, phase=phase,
                        gates=[f.gate for f in verdict.failures], judged=verdict.judged)
