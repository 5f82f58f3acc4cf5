"""The worker refills the engine in the step in which its slots free up (issue 18: no refill lag).

These tests count the sim engine's decode steps (:attr:`SimEngine.occupancy`: sequences run per
step) instead of timing anything: a slot left empty for one step shows up as a step with fewer
sequences than ``max_batch``, however fast or slow the machine is. The only timing assumption is
a generous one: the worker tops its lookahead up within one decode wave (``max_new_tokens`` steps).
"""

from __future__ import annotations

import threading
from pathlib import Path

import redis

from lmdq.contract import BatchStatus
from lmdq.worker.engines.sim import SimEngine
from lmdq.worker.runner import Worker
from lmdq.worker.settings import WorkerSettings
from tests.faultkit import assert_exactly_once, submit
from tests.helpers import wait_batch, write_jsonl

MAX_BATCH = 8
JOB = 4  # requests per job: two jobs fill the engine, so a wave frees two jobs' slots in one step
TOKENS = 60  # every request decodes exactly this many steps (ignore_eos), so whole waves end at once


def _run(tmp_path: Path, env: dict[str, str], redis_url: str, client: redis.Redis, prefix: str,
         n: int, **settings: object) -> SimEngine:
    """Submit ``n`` equal requests in jobs of JOB, drain them with one in-process worker; its engine."""
    ids = [f"r{i}" for i in range(n)]
    bid = submit(write_jsonl(tmp_path / "p.jsonl", [{"custom_id": c, "prompt": c} for c in ids]), env,
                 "--batch-size", str(JOB), "--max-new-tokens", str(TOKENS), "--ignore-eos")["id"]
    # 2 ms steps: shorter than the claim → read → start round trips that a refill from Redis needs,
    # so only requests already handed to the engine can fill a slot in the step it frees up.
    engine = SimEngine(model_name="sim", step_ms=2, max_batch=MAX_BATCH)
    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, health_port=0, partial_interval_s=3600,
                       **settings)
    w = Worker(engine=engine, client=client, settings=s, capacity=MAX_BATCH)
    th = threading.Thread(target=w.run, daemon=True)
    th.start()
    try:
        assert wait_batch(client, prefix, bid, timeout=120).status is BatchStatus.completed
    finally:
        w.stop()
        th.join(60)
    assert_exactly_once(client, prefix, bid, ids)
    return engine


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
    engine = _run(tmp_path, env, redis_url, client, prefix, n=6 * MAX_BATCH)
    assert engine.last_admit_step >= 5 * TOKENS, "the test must span several waves"
    assert _underfull(engine) == []


def test_the_check_sees_a_lookahead_too_short_to_refill(tmp_path: Path, env: dict[str, str], redis_url: str,
                                                        client: redis.Redis, prefix: str) -> None:
    """The same run holding only one job beyond capacity: half of each wave's slots wait for a claim
    round trip, and the step count shows it (the test above can fail)."""
    engine = _run(tmp_path, env, redis_url, client, prefix, n=6 * MAX_BATCH, prefetch_requests=JOB)
    assert _underfull(engine) != []
