"""``params.n`` on a real GPU (issue 24): n = 8 on SmolLM2 through the worker, on LMDeploy.

Run on the GPU host: ``python -m pytest tests/gpu/test_samples_gpu.py -v -s`` (both backends unless
LMDQ_GPU_BACKENDS says otherwise). Each test prints its numbers; what it asserts:

* n = 8 with a seed through submit + the worker: ONE result per prompt holding 8 samples, indices 0..7,
  mostly distinct texts, usage = the prompt once + the samples' tokens summed; the same batch again
  gives the same 8 samples (seed + i per sample) where the engine alone repeats them given the same seeds
  (two identical ``pipe()`` calls; otherwise the test ends XFAIL saying so: the engine decides, not lmdq);
* prefill: the worker's own accounting (``Result.prefill_token_len``, from LMDeploy's ``cached_tokens``
  and the priming request, worker/engines/lmdeploy_engine.py) is at least 2x below what 8 separate
  requests prefill (8 x the prompt's tokens, no sharing), and the worker's Prometheus counter
  ``lmdq_tokens_prefilled_total`` says the same as the results.

The engine runs with ``enable_prefix_caching`` (what shares the prefill on LMDeploy); prompts are
long enough (~600 tokens) that the 64-token KV blocks matter.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import redis

from lmdq.contract import GenerationParams, Result, ResultStatus
from tests.conftest import RedisServer

N = 8
PROMPTS = 16


@pytest.fixture(scope="module")
def engine(model_path: Path, gpu_dtype: str, gpu_mp_engine: bool, gpu_backend: str):  # type: ignore[no-untyped-def]
    from lmdq.worker.engines.lmdeploy_engine import LMDeployEngine

    eng = LMDeployEngine.load(model_path=str(model_path), served_model_name="smollm2", backend=gpu_backend,
                              dtype=gpu_dtype, session_len=2048, cache_max_entry_count=0.3, emit_interval_s=0.02,
                              mp_engine=gpu_mp_engine, enable_prefix_caching=True)
    yield eng
    eng.close()


def _prompt(i: int) -> str:
    facts = " ".join(f"Fact {j}: the number {i * 100 + j} is written with the digits of {j * 7 + i}."
                     for j in range(40))
    return f"Read these notes.\n{facts}\nNow write one short sentence about note {i}."


def _run_batch(engine: Any, srv: RedisServer, f: Path, params: GenerationParams) -> tuple[list[Result], float]:
    """Submit ``f`` and run a burst worker on the module's engine; returns the results (input order) and
    the worker's ``lmdq_tokens_prefilled_total`` counter after the run."""
    from lmdq.redis.keys import Keys
    from lmdq.results.store import ResultStore
    from lmdq.submission.submit import SubmitOptions, submit_file
    from lmdq.worker.engines.base import Borrowed
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    client = redis.Redis.from_url(srv.url)
    opts = SubmitOptions(model="smollm2", batch_size=8, allow_unknown_model=True, params=params)
    batch, _ = submit_file(f, opts, client=client, keys=Keys(), ttl_s=3600)
    from lmdq.worker.health import WorkerHealth

    s = WorkerSettings(redis_url=srv.url, burst=True, health_port=0)
    health = WorkerHealth(worker_name="gpu-samples", model="smollm2")
    w = Worker(engine=Borrowed(engine), client=client, settings=s, capacity=engine.capacity, health=health)
    w.run()
    rows = [Result.model_validate_json(raw) for _, raw in
            ResultStore(client).iter_results(batch.id, batch.request_counts.total, partial=False) if raw]
    return rows, _prefilled_counter(w)


def _prefilled_counter(worker: Any) -> float:
    """The worker's ``lmdq_tokens_prefilled_total`` (its health registry)."""
    from prometheus_client import generate_latest

    registry = worker.health.registry
    total = 0.0
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("lmdq_tokens_prefilled_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _engine_alone_repeats(engine: Any, params: GenerationParams) -> int:
    """Of the PROMPTS prompts, how many get the same N sample texts from two identical ``infer_all`` calls
    (sample ``i`` seeded ``seed + i``, as the worker fans them out: worker/samples.py)."""
    from lmdq.worker.engines.base import EngineRequest
    from lmdq.worker.samples import sample_seed

    pairs = [(p, i) for p in range(PROMPTS) for i in range(N)]
    reqs = [EngineRequest(index=k, prompt=_prompt(p), params=params.model_copy(
        update={"n": None, "random_seed": sample_seed(params.random_seed, i)})) for k, (p, i) in enumerate(pairs)]
    first = [o.text for o in engine.infer_all(reqs)]
    second = [o.text for o in engine.infer_all(reqs)]
    return sum(first[p * N:(p + 1) * N] == second[p * N:(p + 1) * N] for p in range(PROMPTS))


def test_n8_distinct_samples_and_at_least_2x_fewer_prefill_tokens(engine: Any, tmp_path: Path) -> None:
    srv = RedisServer().start()
    try:
        f = tmp_path / "p.jsonl"
        f.write_text("".join(json.dumps({"custom_id": f"p{i}", "prompt": _prompt(i)}) + "\n" for i in range(PROMPTS)))
        params = GenerationParams(n=N, do_sample=True, temperature=1.0, top_p=0.95, random_seed=2024,
                                  max_new_tokens=24)
        rows, counter = _run_batch(engine, srv, f, params)
        assert len(rows) == PROMPTS and [r.custom_id for r in rows] == [f"p{i}" for i in range(PROMPTS)]
        distinct = []
        for r in rows:
            assert r.status is ResultStatus.completed, r.error
            assert r.samples is not None and [s.index for s in r.samples] == list(range(N))
            assert r.text == r.samples[0].text and r.generate_token_len == sum(s.generate_token_len for s in r.samples)
            assert all(s.text and s.generate_token_len > 0 for s in r.samples)
            distinct.append(len({s.text for s in r.samples}))
        prompt_tokens = sum(r.input_token_len for r in rows)
        separate = N * prompt_tokens  # what 8 separate requests per prompt prefill without any sharing
        assert all(r.prefill_token_len is not None for r in rows), "the engine reported no prefill counts"
        prefilled = sum(r.prefill_token_len or 0 for r in rows)
        print(f"\n[samples-gpu] backend={engine.backend} prompts={PROMPTS} n={N} prompt_tokens={prompt_tokens} "
              f"prefilled={prefilled} separate_8x={separate} saving={separate / max(prefilled, 1):.2f}x "
              f"counter={counter:.0f} distinct_per_prompt={distinct}")
        assert counter == float(prefilled), "the worker's counter and the results disagree"
        assert sum(distinct) >= 0.75 * N * PROMPTS, f"samples are mostly identical: {distinct}"
        assert separate >= 2 * prefilled, f"prefill not shared: {prefilled} vs {separate} for 8 separate requests"

        again, _ = _run_batch(engine, srv, f, params)  # seed + i: the same 8 samples
        same = sum(a.samples == b.samples for a, b in zip(rows, again))  # type: ignore[misc]
        texts = sum([s.text for s in a.samples or []] == [s.text for s in b.samples or []] for a, b in zip(rows, again))
        print(f"[samples-gpu] second batch: {texts}/{PROMPTS} prompts with the same 8 sample texts ({same} identical)")
        # lmdq can only repeat what the engine repeats: the same 128 seeded requests, twice, straight to the
        # engine (one pipe() call each, no queue). Session 14: TurboMind gave other samples through lmdq for
        # 16/16 prompts; this tells an lmdq fault (engine alone repeats) from the engine's own behaviour.
        alone = _engine_alone_repeats(engine, params)
        print(f"[samples-gpu] engine alone, two identical calls: {alone}/{PROMPTS} prompts with the same 8 texts")
        if alone < PROMPTS - 1:
            pytest.xfail(f"{engine.backend} alone gave other samples for the same seeds in {PROMPTS - alone} of "
                         f"{PROMPTS} prompts: a re-run cannot repeat them (lmdq: {texts}/{PROMPTS})")
        assert texts >= PROMPTS - 1, "a re-run with the same seed gave other samples (the engine alone repeats them)"
    finally:
        srv.cleanup()


def test_n8_greedy_gives_8_identical_samples_from_one_decode(engine: Any, tmp_path: Path) -> None:
    """Decision (worker/samples.py): greedy n > 1 is n copies of ONE greedy decode (vLLM returns n identical)."""
    srv = RedisServer().start()
    try:
        f = tmp_path / "g.jsonl"
        f.write_text(json.dumps({"custom_id": "g", "messages": [
            {"role": "user", "content": "What is the capital of France?"}]}) + "\n")
        rows, _ = _run_batch(engine, srv, f, GenerationParams(n=N, max_new_tokens=16))
        [r] = rows
        assert r.samples is not None and len({s.text for s in r.samples}) == 1 and "Paris" in r.text
        assert [s.prefill_token_len for s in r.samples][1:] == [0] * (N - 1)
    finally:
        srv.cleanup()


def test_engine_alone_reports_cached_tokens_for_shared_prompts(engine: Any) -> None:
    """The engine level: 8 copies of one prompt in ONE stream call; copies 1..7 report most of the prompt
    as served from the prefix cache (LMDeploy's cached_tokens)."""
    from lmdq.worker.engines.base import EngineRequest

    reqs = [EngineRequest(index=i, prompt=_prompt(99), params=GenerationParams(
        max_new_tokens=8, do_sample=True, random_seed=7 + i)) for i in range(N)]
    finals = {ev.index: ev for ev in engine.stream(reqs, threading.Event()) if ev.finish_reason is not None}
    counts = [finals[i].prefill_token_len for i in range(N)]
    prompt = finals[0].input_token_len
    print(f"\n[samples-gpu] engine: prompt={prompt} prefilled per copy={counts}")
    assert all(c is not None for c in counts)
    assert sum(c or 0 for c in counts) * 2 <= N * prompt
