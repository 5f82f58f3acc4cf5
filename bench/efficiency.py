"""Side-by-side throughput: raw engine vs lmdq (jobs in flight) vs naive lmdq (one job at a time).

All three run in ONE process on ONE loaded engine with the same prompts and settings, so their
ratio measures what the queue costs, not machine-to-machine noise.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmdq.contract import Endpoint, GenerationParams
from lmdq.redis.connection import connect
from lmdq.redis.keys import Keys
from lmdq.results.store import ResultStore
from lmdq.submission.submit import SubmitOptions, submit_file
from lmdq.worker.engines.base import Borrowed, Engine, EngineRequest
from lmdq.worker.runner import Worker
from lmdq.worker.settings import WorkerSettings
from lmdq_bench.finished_batch import read_finished, wait_terminal

__all__ = ["EfficiencyConfig", "run_efficiency"]


@dataclass
class EfficiencyConfig:
    n: int = 1024
    batch_size: int = 32
    input_len: int = 234
    output_len: int = 256
    repeat: int = 1
    jobs_in_flight: int = 0
    naive: bool = True
    # Also: every prompt in ONE engine.stream call (lmdq's engine adapter, per-token streaming, no queue).
    # With raw and lmdq beside it, the gap splits into what streaming costs and what the queue costs.
    stream_baseline: bool = False
    # Also: the first K prompts one request per engine.stream call, one after another (the unbatched
    # rate a loop over the model gets; at batch 1 that rate does not depend on K). 0 = off.
    one_at_a_time: int = 0


def make_prompts(engine: Engine, n: int, input_len: int, seed: int = 0) -> list[str]:
    """Raw prompts of about ``input_len`` tokens each, all different (no prefix sharing)."""
    rnd = random.Random(seed)
    tok = getattr(getattr(getattr(engine, "pipe", None), "async_engine", None), "tokenizer", None)
    out = []
    for i in range(n):
        if tok is None:  # sim: a token is a word
            out.append(" ".join(f"w{i}_{rnd.randrange(1000)}" for _ in range(input_len)))
        else:
            ids = [rnd.randrange(100, 40000) for _ in range(input_len)]
            out.append(tok.decode(ids))
    return out


def _params(cfg: EfficiencyConfig) -> GenerationParams:
    return GenerationParams(max_new_tokens=cfg.output_len, ignore_eos=True, do_sample=False)


def _requests(prompts: list[str], cfg: EfficiencyConfig) -> list[EngineRequest]:
    return [EngineRequest(index=i, prompt=p, endpoint=Endpoint.completion, params=_params(cfg))
            for i, p in enumerate(prompts)]


def _streamed_tokens(engine: Engine, reqs: list[EngineRequest]) -> int:
    """Drain one ``engine.stream`` call; the tokens its requests generated (counted as each finishes)."""
    toks = 0
    for ev in engine.stream(reqs, threading.Event()):
        if ev.finish_reason:
            toks += ev.generate_token_len
    return toks


def run_raw(engine: Engine, prompts: list[str], cfg: EfficiencyConfig) -> tuple[float, int]:
    """The engine given all prompts at once (LMDeploy: one pipe(prompts) call)."""
    return run_raw_requests(engine, _requests(prompts, cfg))


def run_raw_requests(engine: Engine, reqs: list[EngineRequest]) -> tuple[float, int]:
    """(seconds, generated tokens) of ``reqs`` given to the engine at once: LMDeploy one ``pipe()`` call
    (``infer_all``), other engines one ``stream`` call."""
    t0 = time.perf_counter()
    if hasattr(engine, "infer_all"):
        outs = engine.infer_all(reqs)
        toks = sum(int(o.generate_token_len) for o in outs)
    else:
        toks = _streamed_tokens(engine, reqs)
    return time.perf_counter() - t0, toks


def run_stream_one_call(engine: Engine, prompts: list[str], cfg: EfficiencyConfig) -> tuple[float, int]:
    """All prompts in one ``engine.stream`` call, consumed here: streaming without the queue."""
    reqs = _requests(prompts, cfg)
    t0 = time.perf_counter()
    toks = _streamed_tokens(engine, reqs)
    return time.perf_counter() - t0, toks


def run_one_at_a_time(engine: Engine, prompts: list[str], cfg: EfficiencyConfig) -> tuple[float, int]:
    """Each prompt in its own ``engine.stream`` call, one after another: no batching at all."""
    toks = 0
    t0 = time.perf_counter()
    for p in prompts:
        toks += _streamed_tokens(engine, [EngineRequest(index=0, prompt=p, endpoint=Endpoint.completion,
                                                        params=_params(cfg))])
    return time.perf_counter() - t0, toks


def _timeline(rs: list[Any], t0: float) -> dict[str, float]:
    """Where lmdq's time goes, seconds after the jobs became visible: ramp (first start / first token /
    last start) and tail (p50 / p99 / last finish)."""
    def q(xs: list[float], f: float) -> float:
        xs = sorted(xs)
        return round(xs[min(len(xs) - 1, int(f * len(xs)))] - t0, 3)
    started = [r.timings.started_at for r in rs if r.timings.started_at]
    first = [r.timings.first_token_at for r in rs if r.timings.first_token_at]
    done = [r.timings.finished_at for r in rs if r.timings.finished_at]
    out = {"first_start_s": q(started, 0.0), "last_start_s": q(started, 1.0), "p50_finish_s": q(done, 0.5),
           "p99_finish_s": q(done, 0.99), "last_finish_s": q(done, 1.0)}
    if first:
        out |= {"first_token_s": q(first, 0.0), "p50_first_token_s": q(first, 0.5), "last_first_token_s": q(first, 1.0)}
    return out


def run_lmdq(engine: Engine, prompts: list[str], cfg: EfficiencyConfig, *, redis_url: str, jobs_in_flight: int,
             prefix: str, timelines: list[dict[str, float]] | None = None,
             input_file: Path | None = None, user_clock: list[float] | None = None) -> tuple[float, int]:
    """Producer submit → a worker on the same engine → results stored; first enqueue to last result
    (the queue's own cost). With ``timelines``, the run's ramp/tail timeline is appended to it; with
    ``user_clock``, the seconds from the submit's start to the last result (what a user waits for,
    the file's parse and staging included). ``input_file``: submit this JSONL (holding ``prompts``, as
    completion requests) instead of writing one."""
    client = connect(redis_url)  # timeouts like every lmdq client
    keys = Keys(prefix)
    with tempfile.TemporaryDirectory() as d:
        f = input_file or Path(d) / "prompts.jsonl"
        if input_file is None:
            with f.open("w") as fh:
                for i, p in enumerate(prompts):
                    fh.write(json.dumps({"custom_id": str(i), "prompt": p, "endpoint": "completion"}) + "\n")
        s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, health_port=0, jobs_in_flight=jobs_in_flight,
                           partial_interval_s=3600, poll_interval_s=0.01)
        w = Worker(engine=Borrowed(engine), client=client, settings=s,
                   capacity=engine.capacity)
        th = threading.Thread(target=w.run, daemon=True)
        th.start()
        opts = SubmitOptions(model=engine.model_name, batch_size=cfg.batch_size, params=_params(cfg),
                             allow_unknown_model=True)
        t_submit = time.time()
        batch, _ = submit_file(f, opts, client=client, keys=keys, ttl_s=3600)
    store = ResultStore(client, keys=keys)
    done = wait_terminal(store, batch.id, poll_s=0.01)
    w.stop()
    th.join(60)
    # The batch's completed_at is stamped by the Lua that stores its last result: "last result stored".
    fin = read_finished(store, done, cfg.n)
    rs, t_end, toks = fin.results, fin.last_stored_at, fin.tokens
    assert len(rs) == cfg.n, f"{len(rs)} results for {cfg.n} prompts"
    # From the moment the jobs became visible on the queue (commit) to the last result stored.
    t0 = done.queued_at or batch.created_at
    if timelines is not None:
        timelines.append(_timeline(rs, t0))
    if user_clock is not None:
        user_clock.append(t_end - t_submit)
    return t_end - t0, toks


def empty_slot_steps(engine: Engine, steps_before: int) -> int | None:
    """Sim only: slot-steps left empty while requests were still to come, in the steps since
    ``steps_before`` (from the first step that ran full to the step the last request was admitted
    in). 0 means every slot freed in a step was refilled for the next one; a step count, so it
    does not depend on how busy the machine was."""
    occ = getattr(engine, "occupancy", None)
    if occ is None:
        return None
    cap = int(getattr(engine, "max_batch", 1))
    n = int(getattr(engine, "steps", 0)) - steps_before
    run = list(occ)[-n:] if n > 0 else []
    last = int(getattr(engine, "last_admit_step", -1)) - steps_before
    if cap not in run:
        return None
    first = run.index(cap)
    return int(sum(cap - x for x in run[first:last + 1]))


def run_efficiency(engine: Engine, cfg: EfficiencyConfig, *, redis_url: str, log: Any = print) -> dict[str, Any]:
    prompts = make_prompts(engine, cfg.n, cfg.input_len)
    log(f"warm-up: raw run of {cfg.n} prompts")
    run_raw(engine, prompts, cfg)
    rows: dict[str, list[tuple[float, int]]] = {"raw": [], "stream1": [], "lmdq": [], "naive": [], "one": []}
    lmdq_timelines: list[dict[str, float]] = []
    lmdq_user_s: list[float] = []  # the second clock: submit start -> last result, per lmdq run
    # Process CPU seconds per run (all threads: the engine's own loop too, which shares the GIL with the
    # worker's threads on LMDeploy's in-process engine): what each path burns besides the GPU.
    cpu: dict[str, list[float]] = {k: [] for k in rows}
    empty: dict[str, list[int | None]] = {k: [] for k in rows}

    def timed(k: str, fn: Any, *args: Any, **kw: Any) -> None:
        c0 = time.process_time()
        s0 = int(getattr(engine, "steps", 0))
        rows[k].append(fn(*args, **kw))
        cpu[k].append(round(time.process_time() - c0, 2))
        empty[k].append(empty_slot_steps(engine, s0))

    for rep in range(cfg.repeat):
        timed("raw", run_raw, engine, prompts, cfg)
        if cfg.stream_baseline:
            timed("stream1", run_stream_one_call, engine, prompts, cfg)
        timed("lmdq", run_lmdq, engine, prompts, cfg, redis_url=redis_url, jobs_in_flight=cfg.jobs_in_flight,
              prefix=f"bench{rep}a", timelines=lmdq_timelines, user_clock=lmdq_user_s)
        if cfg.naive:
            timed("naive", run_lmdq, engine, prompts, cfg, redis_url=redis_url, jobs_in_flight=1, prefix=f"bench{rep}b")
        if cfg.one_at_a_time and rep == 0:  # one run: the batch-1 rate is what it is
            timed("one", run_one_at_a_time, engine, prompts[:cfg.one_at_a_time], cfg)
        for k, v in rows.items():
            if not v:
                continue
            gaps = "" if empty[k][-1] is None else f", empty slot-steps {empty[k][-1]}"
            if k == "lmdq":
                gaps += f"; from submit start {v[-1][1] / lmdq_user_s[-1]:,.0f} tok/s"
            log(f"rep {rep}: {k:7s} {v[-1][1]:>9,d} tokens in {v[-1][0]:7.2f} s = {v[-1][1] / v[-1][0]:>9,.0f} tok/s"
                f"  (process CPU {cpu[k][-1]:.1f} s{gaps})")

    def best(k: str) -> float | None:
        """Median over repeats (each repeat runs raw, lmdq and naive back to back)."""
        if not rows[k]:
            return None
        return round(float(statistics.median(toks / secs for secs, toks in rows[k])), 1)

    raw, lmdq, naive, one = best("raw"), best("lmdq"), best("naive"), best("one")
    assert raw and lmdq
    # Two clocks (issue 49): "ratio" counts lmdq from its first visible job (the queue's own cost),
    # "ratio_from_submit" from the submit's start (what a user waits for); raw has one clock.
    user = round(float(statistics.median(t / u for (_, t), u in zip(rows["lmdq"], lmdq_user_s, strict=True))), 1)
    return {"raw_tok_s": raw, "lmdq_tok_s": lmdq, "naive_tok_s": naive, "ratio": round(lmdq / raw, 4),
            "lmdq_from_submit_tok_s": user, "ratio_from_submit": round(user / raw, 4),
            "naive_ratio": round(naive / raw, 4) if naive else None,
            "one_tok_s": one, "lmdq_vs_one": round(lmdq / one, 2) if one else None,
            "stream1_tok_s": best("stream1"), "lmdq_timelines": lmdq_timelines, "process_cpu_s": cpu,
            **({"sim_empty_slot_steps": empty} if any(x is not None for v in empty.values() for x in v) else {}),
            "runs": {k: [[round(s, 3), t] for s, t in v] for k, v in rows.items()}}
