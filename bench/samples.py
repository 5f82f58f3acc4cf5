"""``lmdq-bench samples``: P prompts x n samples (``params.n``) vs the same P x n requests one per line.

Both sides run through the real submit and one worker on ONE engine built as the worker builds it, with
the same prompts, sampling settings and seeds (line ``j`` of prompt ``p`` carries ``seed + j``, which
is what sample ``j`` of the n-sample request uses) and prompts of the same count and lengths (not the
same texts: the prefix cache keeps what the first side prefilled, and the second side must not find its
prompts there), so the two sides differ only in how the requests reach the engine:

* ``n``: P requests with ``params.n = n``: the worker sends a request's n samples side by side in one
  stream call and the engine shares their prefill (transformers: one prefill fanned out; LMDeploy: the
  prefix cache, primed once per prompt);
* ``lines``: P x n requests, a prompt's n copies on consecutive lines (what a user does without ``n``),
  ``n`` x the batch size per job so a job holds the same sequences as on the ``n`` side.

Reported side by side: output tokens per second (first job visible to last result stored) and the
prompt tokens the engine really prefilled (the worker's accounting, ``Result.prefill_token_len``,
from LMDeploy's ``cached_tokens``; the sim's own counters where results carry none), beside the prompt
tokens 8 separate unshared requests would prefill. The ``n`` side runs first, after a warm-up.

``raw_baseline=True`` (``--raw-baseline``) adds a third side: the same P x n requests (fresh prompts
again) in ONE call to the engine, no queue (LMDeploy: one ``pipe(prompts)``, the prefix cache doing what it
does unprimed): what the engine alone makes of this workload, so a slow pair of lmdq sides can be told apart
from a slow engine (session 11 on the H200: both lmdq sides ~5k tok/s, a third of SmolLM2's chat rate,
cause unmeasured).
"""

from __future__ import annotations

import json
import tempfile
import threading
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
from lmdq_bench.efficiency import EfficiencyConfig, make_prompts, run_raw, run_raw_requests
from lmdq_bench.finished_batch import read_finished, wait_terminal

__all__ = ["SamplesConfig", "run_samples"]


@dataclass
class SamplesConfig:
    prompts: int = 1024
    n: int = 8
    input_len: int = 234
    output_len: int = 128
    #: requests per job on the ``n`` side (the ``lines`` side has n x as many)
    batch_size: int = 32
    temperature: float = 1.0
    seed: int = 0
    jobs_in_flight: int = 0
    #: also time the same requests in one raw engine call (no queue)
    raw_baseline: bool = False


def _write(path: Path, prompts: list[str], cfg: SamplesConfig, *, as_n: bool) -> int:
    """The JSONL of one side; returns its number of lines."""
    lines = 0
    with path.open("w") as f:
        for p, prompt in enumerate(prompts):
            seed = cfg.seed + p * cfg.n  # disjoint seed ranges per prompt
            if as_n:
                rows = [{"custom_id": f"p{p}", "prompt": prompt, "endpoint": "completion",
                         "params": {"n": cfg.n, "random_seed": seed}}]
            else:
                rows = [{"custom_id": f"p{p}-s{j}", "prompt": prompt, "endpoint": "completion",
                         "params": {"random_seed": seed + j}} for j in range(cfg.n)]
            for row in rows:
                f.write(json.dumps(row) + "\n")
                lines += 1
    return lines


def _counters(engine: Engine) -> dict[str, int] | None:
    stats = getattr(engine, "stats", None)
    return dict(stats()) if callable(stats) else None


def _run_side(engine: Engine, path: Path, requests: int, batch_size: int, cfg: SamplesConfig, *, redis_url: str,
              prefix: str) -> dict[str, Any]:
    """Submit ``path`` and drain it with one worker on ``engine``: time, tokens, prefill."""
    client = connect(redis_url)
    keys = Keys(prefix)
    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, health_port=0, jobs_in_flight=cfg.jobs_in_flight,
                       partial_interval_s=3600, poll_interval_s=0.01)
    w = Worker(engine=Borrowed(engine), client=client, settings=s,
               capacity=int(getattr(engine, "capacity", None) or getattr(engine, "max_batch", 1) or 1))
    th = threading.Thread(target=w.run, daemon=True)
    th.start()
    before = _counters(engine)
    params = GenerationParams(max_new_tokens=cfg.output_len, ignore_eos=True, do_sample=True,
                              temperature=cfg.temperature)
    opts = SubmitOptions(model=engine.model_name, batch_size=batch_size, params=params, allow_unknown_model=True,
                         prefix_groups=False)
    batch, _ = submit_file(path, opts, client=client, keys=keys, ttl_s=3600)
    store = ResultStore(client, keys=keys)
    b = wait_terminal(store, batch.id, poll_s=0.01)
    w.stop()
    th.join(60)
    after = _counters(engine)
    fin = read_finished(store, b, requests)
    rs, toks = fin.results, fin.tokens
    assert len(rs) == requests, f"{len(rs)} results for {requests} requests"
    secs = fin.last_stored_at - (b.queued_at or batch.created_at)
    sequences = sum(len(r.samples) if r.samples else 1 for r in rs)
    out: dict[str, Any] = {"requests": requests, "sequences": sequences, "s": round(secs, 3), "tokens": toks,
                           "tok_s": round(toks / secs, 1), "prompt_tokens_unshared": sum(
                               r.input_token_len * (len(r.samples) if r.samples else 1) for r in rs)}
    if all(r.prefill_token_len is not None for r in rs):
        out["prefilled_tokens"] = sum(r.prefill_token_len or 0 for r in rs)
        out["prefill_from"] = "results"
    elif before is not None and after is not None:
        out["prefilled_tokens"] = after["prefilled_tokens"] - before["prefilled_tokens"]
        out["prefill_from"] = "engine counters"
    return out


def _run_raw_side(engine: Engine, prompts: list[str], cfg: SamplesConfig) -> dict[str, Any]:
    """The P x n requests of the lines side, as one engine call: LMDeploy ``pipe()`` (``infer_all``), other
    engines one ``stream`` call. Seeds as the lines side's (sample ``j`` of prompt ``p``: ``seed + p*n + j``)."""
    reqs = [EngineRequest(index=p * cfg.n + j, prompt=prompt, endpoint=Endpoint.completion,
                          params=GenerationParams(max_new_tokens=cfg.output_len, ignore_eos=True, do_sample=True,
                                                  temperature=cfg.temperature, random_seed=cfg.seed + p * cfg.n + j))
            for p, prompt in enumerate(prompts) for j in range(cfg.n)]
    before = _counters(engine)
    secs, toks = run_raw_requests(engine, reqs)
    after = _counters(engine)
    out: dict[str, Any] = {"requests": len(reqs), "sequences": len(reqs), "s": round(secs, 3), "tokens": toks,
                           "tok_s": round(toks / secs, 1)}
    if before is not None and after is not None:
        out["prefilled_tokens"] = after["prefilled_tokens"] - before["prefilled_tokens"]
        out["prefill_from"] = "engine counters"
    return out


def run_samples(engine: Engine, cfg: SamplesConfig, *, redis_url: str, log: Any = print) -> dict[str, Any]:
    # Each side gets its own prompts (same count and lengths): the prefix cache keeps what the first side
    # prefilled, and the second side must not find its prompts there.
    sides = {"n": make_prompts(engine, cfg.prompts, cfg.input_len, seed=cfg.seed),
             "lines": make_prompts(engine, cfg.prompts, cfg.input_len, seed=cfg.seed + 7919)}
    warm = make_prompts(engine, min(32, cfg.prompts), 64, seed=cfg.seed + 1)
    run_raw(engine, warm, EfficiencyConfig(n=len(warm), output_len=8))  # CUDA graphs, allocator: not timed
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        for side, as_n in (("n", True), ("lines", False)):
            path = Path(d) / f"{side}.jsonl"
            requests = _write(path, sides[side], cfg, as_n=as_n)
            per_job = cfg.batch_size if as_n else cfg.batch_size * cfg.n
            runs[side] = _run_side(engine, path, requests, per_job, cfg, redis_url=redis_url,
                                   prefix=f"benchsamples{side}")
            r = runs[side]
            log(f"{side}: {r['requests']:,} requests, {r['sequences']:,} sequences, {r['tokens']:,} tokens in "
                f"{r['s']:.2f} s = {r['tok_s']:,.0f} tok/s; prefilled {r.get('prefilled_tokens', 'n/a')} of "
                f"{r['prompt_tokens_unshared']:,} prompt tokens")
    if cfg.raw_baseline:
        r = runs["raw"] = _run_raw_side(engine, make_prompts(engine, cfg.prompts, cfg.input_len,
                                                             seed=cfg.seed + 15485863), cfg)
        log(f"raw: {r['requests']:,} requests in one engine call, {r['tokens']:,} tokens in {r['s']:.2f} s = "
            f"{r['tok_s']:,.0f} tok/s; prefilled {r.get('prefilled_tokens', 'n/a')}")
    n, lines = runs["n"], runs["lines"]
    res: dict[str, Any] = {"n_tok_s": n["tok_s"], "lines_tok_s": lines["tok_s"],
                           "tok_s_ratio": round(n["tok_s"] / lines["tok_s"], 4), "runs": runs}
    if cfg.raw_baseline:
        res["raw_tok_s"] = runs["raw"]["tok_s"]
        res["n_vs_raw"] = round(n["tok_s"] / runs["raw"]["tok_s"], 4)
    if "prefilled_tokens" in n and "prefilled_tokens" in lines:
        res["n_prefilled"], res["lines_prefilled"] = n["prefilled_tokens"], lines["prefilled_tokens"]
        res["prefill_saving_vs_unshared"] = round(n["prompt_tokens_unshared"] / max(1, n["prefilled_tokens"]), 3)
        res["prefill_saving_vs_lines"] = round(lines["prefilled_tokens"] / max(1, n["prefilled_tokens"]), 3)
    return res
