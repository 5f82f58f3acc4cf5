"""``lmdq-bench plan``: a plan's predicted GPU-seconds against the measured run that follows (issue 46).

1. A sim fleet (N worker processes, ``--sim-prefill-us-per-token`` so prompts cost time too) runs the
   model's HISTORY: two batches of different shapes (long prompts and short answers, then short prompts and
   long answers), one after the other, so the workers' recording windows can tell a prefill token's cost
   from a decode token's (:mod:`lmdq.plan.rules`).
2. ``Client.plan`` plans the bench's FILE (``--requests`` lines, each line's shape drawn at random from
   the two, its own ``max_new_tokens``), with a word tokenizer that counts as the sim does
   (:func:`lmdq.plan.tokens.write_word_tokenizer`).
3. The file is submitted and run by the same fleet. Measured: the busy seconds the workers recorded over
   the run (the quantity a plan predicts: time with at least one job in an engine), and beside it wall
   time × workers from the batch's in-progress to its completion; the input tokens the workers report.

Printed side by side; the last line is the JSON object. Nothing is asserted (speed is reported, not
tested): docs/plan-deadline-canary.md and evidence/plan/ hold a run.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis

import lmdq
from lmdq.contract import BatchStatus
from lmdq.plan.store import PlanStore
from lmdq.plan.tokens import write_word_tokenizer
from lmdq.redis.keys import Keys
from lmdq.submission.settings import ProducerSettings
from lmdq_bench.sim_workers import SimWorkers

__all__ = ["PlanBenchConfig", "run_plan_bench", "table"]

PREFIX = "planbench"
MODEL = "planbench"
WORDS = [f"w{i}" for i in range(200)]


@dataclass
class PlanBenchConfig:
    requests: int = 10_000
    history: int = 2_000
    workers: int = 2
    capacity: int = 128
    batch_size: int = 32
    step_ms: float = 4.0
    prefill_us: float = 20.0
    seed: int = 46


def _shape(rng: random.Random, long_prompt: bool) -> dict[str, Any]:
    n_in = rng.randint(120, 240) if long_prompt else rng.randint(8, 30)
    n_out = rng.randint(4, 12) if long_prompt else rng.randint(24, 64)
    return {"prompt": " ".join(rng.choice(WORDS) for _ in range(n_in)), "params": {"max_new_tokens": n_out}}


def _write(path: Path, n: int, rng: random.Random, pick: Callable[[int], bool]) -> Path:
    import json

    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"custom_id": f"r{i}", **_shape(rng, pick(i))}) + "\n")
    return path


def _fleet(redis_url: str, cfg: PlanBenchConfig) -> SimWorkers:
    env = {**os.environ, "LMDQ_REDIS_URL": redis_url, "LMDQ_KEY_PREFIX": PREFIX, "LMDQ_LOG_FORMAT": "json",
           "LMDQ_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
    fleet = SimWorkers("plan", env, prefix="lmdq-planbench-", keep_logs=True)
    for _ in range(cfg.workers):
        fleet.start(["--served-model-name", MODEL, "--sim-max-batch", str(cfg.capacity), "--sim-step-ms",
                     str(cfg.step_ms), "--sim-prefill-us-per-token", str(cfg.prefill_us), "--sim-emit-every", "64"],
                    "plan")
    return fleet


def _run(api: lmdq.Client, fleet: SimWorkers, path: Path, log: Callable[[str], None]) -> lmdq.Batch:
    batch = api.submit(path, model=MODEL, allow_unknown_model=True, batch_size=api.settings.batch_size)
    t0 = time.monotonic()
    while not batch.info().status.terminal:
        fleet.check()
        if time.monotonic() - t0 > 1800:
            raise TimeoutError(f"plan bench: batch {batch.id} still running")
        time.sleep(0.25)
    info = batch.info()
    if info.status is not BatchStatus.completed or info.request_counts.completed != info.request_counts.total:
        raise RuntimeError(f"plan bench: batch {batch.id} ended {info.status.value} {info.request_counts}")
    log(f"  {path.name}: {info.request_counts.total:,} requests in {time.monotonic() - t0:.1f} s")
    return batch


def _busy(store: PlanStore) -> tuple[float, int, int]:
    h = store.history(MODEL)
    return sum(r.busy_s for r in h.rates), sum(r.prefill for r in h.rates), sum(r.decode for r in h.rates)


def _settled(store: PlanStore, want_decode: int, timeout: float = 30.0) -> tuple[float, int, int]:
    """The workers' totals once every window of the run has been flushed (the last one when each engine
    emptied): the decode tokens recorded reach those the results report."""
    t0 = time.monotonic()
    while True:
        got = _busy(store)
        if got[2] >= want_decode or time.monotonic() - t0 > timeout:
            return got
        time.sleep(0.2)


def run_plan_bench(cfg: PlanBenchConfig, *, redis_url: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    work = Path(tempfile.mkdtemp(prefix="lmdq-planbench-files-"))
    tok = write_word_tokenizer(work / "tokenizer", [*WORDS, "user:", "assistant:"])
    hist_a = _write(work / "history-long-prompts.jsonl", cfg.history // 2, rng, lambda _i: True)
    hist_b = _write(work / "history-long-answers.jsonl", cfg.history - cfg.history // 2, rng, lambda _i: False)
    planned = _write(work / "planned.jsonl", cfg.requests, rng, lambda _i: rng.random() < 0.5)
    client = redis.Redis.from_url(redis_url)
    store = PlanStore(client, keys=Keys(PREFIX))
    store.forget(MODEL)
    api = lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=PREFIX,
                                                          batch_size=cfg.batch_size))
    fleet = _fleet(redis_url, cfg)
    try:
        log(f"history: {cfg.history:,} requests in two shapes on {cfg.workers} sim workers")
        decoded = 0
        for f in (hist_a, hist_b):
            b = _run(api, fleet, f, log)
            decoded += sum(r.generate_token_len for r in b.results())
            _settled(store, decoded)
        plan = api.plan(planned, model=MODEL, tokenizer=tok)
        log("plan:\n" + "\n".join(plan.lines()))
        busy0, pre0, dec0 = _busy(store)
        batch = _run(api, fleet, planned, log)
        results = list(batch.results())
        out_tokens = sum(r.generate_token_len for r in results)
        busy1, pre1, dec1 = _settled(store, dec0 + out_tokens)
        info = batch.info()
    finally:
        fleet.stop()
    measured = busy1 - busy0
    wall = (info.completed_at or 0) - (info.in_progress_at or 0)
    in_tokens = sum(r.input_token_len or 0 for r in results)
    predicted = plan.gpu_seconds or 0.0
    return {
        "bench": "plan", "config": asdict(cfg),
        "plan": {"requests": plan.requests, "input_tokens": plan.input_tokens, "output_tokens": plan.output_tokens,
                 "gpu_seconds": round(predicted, 3), "eta_s": plan.eta_s, "prefill_tok_s": plan.prefill_tok_s,
                 "decode_tok_s": plan.decode_tok_s, "rate_basis": plan.rate_basis, "output_basis": plan.output_basis,
                 "input_basis": plan.input_basis},
        "measured": {"requests": len(results), "input_tokens_reported": in_tokens, "output_tokens": out_tokens,
                     "prefill_tokens_recorded": pre1 - pre0, "decode_tokens_recorded": dec1 - dec0,
                     "busy_gpu_seconds": round(measured, 3), "wall_s": round(wall, 3),
                     "wall_x_workers_s": round(wall * cfg.workers, 3)},
        "input_tokens_equal": plan.input_tokens == in_tokens,
        "gpu_seconds_error": round((predicted - measured) / measured, 4) if measured else None,
        "gpu_seconds_error_vs_wall": (round((predicted - wall * cfg.workers) / (wall * cfg.workers), 4)
                                      if wall else None),
    }


def table(res: dict[str, Any]) -> str:
    p, m = res["plan"], res["measured"]
    rows = [
        ("", "predicted (plan)", "measured (run)"),
        ("requests", f"{p['requests']:,}", f"{m['requests']:,}"),
        ("input tokens", f"{p['input_tokens']:,}", f"{m['input_tokens_reported']:,} (workers' count)"),
        ("output tokens", f"{p['output_tokens']:,}", f"{m['output_tokens']:,}"),
        ("GPU-seconds", f"{p['gpu_seconds']:,.1f}", f"{m['busy_gpu_seconds']:,.1f} busy "
                                                    f"({m['wall_x_workers_s']:,.1f} wall x workers)"),
        ("ETA", "-" if p["eta_s"] is None else f"{p['eta_s']:,.1f} s", f"{m['wall_s']:,.1f} s"),
    ]
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    lines.append(f"GPU-seconds error: {res['gpu_seconds_error']:+.1%} against busy, "
                 f"{res['gpu_seconds_error_vs_wall']:+.1%} against wall x workers; "
                 f"input tokens equal: {res['input_tokens_equal']}")
    return "\n".join(lines)
