"""The worker refills the engine in the step in which its slots free up (issue 18: no refill lag).

These tests count the sim engine's decode steps (:attr:`SimEngine.occupancy`: sequences run per
step) instead of timing anything: a slot left empty for one step shows up as a step with fewer
sequences than ``max_batch``, however fast or slow the machine is. The only timing assumption is
a generous one: the worker tops its lookahead up within one decode wave (``max_new_tokens`` steps).
A claim from Redis is made to cost at least one decode step while the engine has work
(:class:`_ClaimTakesAStep`): on a fast idle machine a real round trip can beat a 2 ms sim step, and the
lookahead check must not depend on which of the two is quicker.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import redis

from lmdq.contract import BatchStatus, Result
from lmdq.jobs.queue import Claim
from lmdq.worker.engines.sim import SimEngine
from lmdq.worker.runner import Worker
from lmdq.worker.settings import WorkerSettings
from tests.faultkit import assert_exactly_once, submit
from tests.helpers import wait_batch, write_jsonl

MAX_BATCH = 8
JOB = 4  # requests per job: two jobs fill the engine, so a wave frees two jobs' slots in one step
TOKENS = 150  # every request decodes exactly this many steps (ignore_eos), so whole waves end at once


class _ClaimTakesAStep(Worker):
    """A worker whose claims return only after the engine's next decode step while it has work: the
    refill cost the lookahead must cover, made structural instead of a race between a Redis round
    trip and the sim's step (an idle engine, at the start or the end of a batch, does not wait)."""

    def _claim(self, n: int) -> list[Claim]:
        engine = self.engine
        assert isinstance(engine, SimEngine)
        start = engine.steps
        while engine.steps == start and (engine._active or engine._pending) and not self._stop.is_set():
            time.sleep(0.0002)
        return super()._claim(n)


def _run(tmp_path: Path, env: dict[str, str], redis_url: str, client: redis.Redis, prefix: str,
         n: int, *, max_batch: int = MAX_BATCH, tokens: dict[int, int] | None = None,
         **settings: object) -> tuple[SimEngine, list[Result]]:
    """Submit ``n`` requests (TOKENS each, or ``tokens[i]``) in jobs of JOB, drain them with one
    in-process worker; its engine and the results."""
    ids = [f"r{i}" for i in range(n)]
    rows: list[dict[str, object]] = [{"custom_id": c, "prompt": c} for c in ids]
    for i, t in (tokens or {}).items():
        rows[i]["params"] = {"max_new_tokens": t}
    bid = submit(write_jsonl(tmp_path / "p.jsonl", rows), env,
                 "--batch-size", str(JOB), "--max-new-tokens", str(TOKENS), "--ignore-eos")["id"]
    # A claim costs at least one 2 ms step (_ClaimTakesAStep), so only requests already handed to the
    # engine can fill a slot in the step it frees up.
    engine = SimEngine(model_name="sim", step_ms=2, max_batch=max_batch)
    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, health_port=0, partial_interval_s=3600,
                       **settings)
    w = _ClaimTakesAStep(engine=engine, client=client, settings=s, capacity=max_batch)
    th = threading.Thread(target=w.run, daemon=True)
    th.start()
    try:
        assert wait_batch(client, prefix, bid, timeout=120).status is BatchStatus.completed
    finally:
        w.stop()
        th.join(60)
    return engine, assert_exactly_once(client, prefix, bid, ids)


def _underfull(engine: SimEngine) -> list[tuple[int, int]]:
    """(step, sequences) for every step that ran below max_batch between the first full step and
    the step the last request was admitted in: slots that stayed empty while work was held."""
    occ = list(engine.occupancy)
    assert MAX_BATCH in occ, f"the engine never ran full: {occ}"
    first = occ.index(MAX_BATCH)
    return [(i, occ[i]) for i in range(first, engine.last_admit_step + 1) if occ[i] != MAX_BATCH]


def test_slots_freed_in_a_step_are_refilled_for_the_next_step(tmp_path: Path, env: dict[str, str], redis_url: str,
                                                              client: redis.Redis, prefix: str) -> None:
    """Every wave frees all MAX_BATCH slots in the same step; the next requests must run in the very
    next step (the worker holds a whole engine-full behind the running one), through 6 waves."""
    engine, _ = _run(tmp_path, env, redis_url, client, prefix, n=6 * MAX_BATCH)
    assert engine.last_admit_step >= 5 * TOKENS, "the test must span several waves"
    assert _underfull(engine) == []


def test_the_check_sees_a_lookahead_too_short_to_refill(tmp_path: Path, env: dict[str, str], redis_url: str,
                                                        client: redis.Redis, prefix: str) -> None:
    """The same run holding only one job beyond capacity: half of each wave's slots wait for a claim
    round trip, and the step count shows it (the test above can fail)."""
    engine, _ = _run(tmp_path, env, redis_url, client, prefix, n=6 * MAX_BATCH, prefetch_requests=JOB)
    assert _underfull(engine) != []


def test_a_slow_request_does_not_hold_the_slots_its_finished_job_mates_left(
        tmp_path: Path, env: dict[str, str], redis_url: str, client: redis.Redis, prefix: str) -> None:
    """Each job: one long request (300 steps) and three short ones (5 steps); the engine takes one
    job (4), the worker holds two. When the short requests of both jobs are done, six slots are
    free while both jobs still run: the third job must start then, not when the first job's long
    request ends (slots counted free per request, at its final event, not per job)."""
    long = {i: 300 for i in range(0, 3 * JOB, JOB)}
    _, results = _run(tmp_path, env, redis_url, client, prefix, n=3 * JOB, max_batch=JOB,
                      tokens={i: long.get(i, 5) for i in range(3 * JOB)})
    by_id = {r.custom_id: r for r in results}
    first_long_done = by_id["r0"].timings.finished_at
    third_job_started = by_id[f"r{2 * JOB + 1}"].timings.started_at
    assert first_long_done is not None and third_job_started is not None
    assert third_job_started < first_long_done
