"""``params.n`` (issue 24): n samples of one prompt, prefilled once, in ONE result, exactly once.

Fast tests drive the pieces (fan-out, gathering, the OpenAI line, the Arrow row, the input formats) and
the sim engine through a real worker; ``@pytest.mark.model`` tests run the real embedded SmolLM2 on CPU
(transformers engine): n = 4 with a seed gives 4 samples, the same 4 in a second batch and after the
worker is SIGKILLed mid-batch (frozen at a chosen final event by tests/samples_child.py, not by a sleep).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from lmdq.contract import (
    Endpoint,
    FinishReason,
    GenerationParams,
    Request,
    Result,
    ResultStatus,
    Sample,
)
from lmdq.redis.keys import Keys
from lmdq.results.store import ResultStore
from lmdq.worker.engines.base import EngineEvent, EngineRequest
from lmdq.worker.samples import SampleSet, engine_rows, fan_out, sample_seed
from tests.conftest import ROOT
from tests.faultkit import wait_for
from tests.helpers import results_of, write_jsonl

# --------------------------------------------------------------------------- contract and formats


def test_n_is_bounded_1_to_128() -> None:
    assert GenerationParams(n=128).n == 128 and GenerationParams().resolved()["n"] == 1
    for bad in (0, 129):
        with pytest.raises(ValueError):
            GenerationParams(n=bad)


def test_openai_body_n_becomes_params_n(tmp_path: Path) -> None:
    from lmdq.submission.formats import ParsedLine, iter_lines

    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "x"}], "n": 4, "temperature": 0.7, "seed": 3}}
    [item] = list(iter_lines(write_jsonl(tmp_path / "o.jsonl", [line])))
    assert isinstance(item, ParsedLine) and item.params is not None
    assert item.params.n == 4 and item.params.random_seed == 3
    assert item.params.do_sample is True


def test_cli_and_python_api_take_n() -> None:
    from lmdq.client.options import GENERATION_FLAGS, option_names

    assert "n" in option_names()
    [flag] = [f for f in GENERATION_FLAGS if f.key == "n"]
    assert flag.flat == "n"  # the CLI's --n (derived from the one declaration in src/lmdq/contract.py)


# --------------------------------------------------------------------------- fan-out and gathering


def _request(i: int, **params: Any) -> Request:
    return Request(index=i, custom_id=f"r{i}", prompt=f"p{i}", params=GenerationParams(**params) if params else None)


def test_fan_out_seeds_sample_i_with_seed_plus_i_side_by_side() -> None:
    base = GenerationParams(do_sample=True, random_seed=100)
    todo = [_request(0), _request(1, n=3), _request(2, n=2, random_seed=2**63 - 1)]
    ereqs, slots, sets, refused = fan_out(todo, base)
    assert not refused and [e.index for e in ereqs] == list(range(6))
    assert slots == [(0, 0), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]
    assert [e.params.random_seed for e in ereqs] == [100, 100, 101, 102, 2**63 - 1, 0]  # wraps in [0, 2**63)
    assert all(e.params.n is None for e in ereqs) and all(e.prompt == todo[p].prompt for e, (p, _) in zip(ereqs, slots))
    assert set(sets) == {1, 2} and sets[1].runs == 3
    assert sample_seed(None, 5) is None  # no seed: every sample draws its own random one


def test_greedy_n_runs_once_and_copies() -> None:
    """Decision: n > 1 with greedy gives n identical samples (vLLM's answer) from ONE decode."""
    ereqs, slots, sets, _ = fan_out([_request(0, n=4)], GenerationParams())
    assert len(ereqs) == 1 and sets[0].runs == 1 and sets[0].n == 4
    assert engine_rows_of([_request(0, n=4), _request(1, n=4, do_sample=True), _request(2)]) == 1 + 4 + 1
    ss = sets[0]
    ev = EngineEvent(index=0, text="hi", generate_token_len=2, finish_reason="stop", prefill_token_len=9)
    ss.delta(0, ev)
    assert ss.end(0, ev, FinishReason.stop, ResultStatus.completed, None, None)
    got = ss.samples()
    assert [s.index for s in got] == [0, 1, 2, 3] and {s.text for s in got} == {"hi"}
    assert [s.prefill_token_len for s in got] == [9, 0, 0, 0]


def engine_rows_of(reqs: list[Request]) -> int:
    from lmdq.contract import JobPayload

    return engine_rows(JobPayload(batch_id="batch_" + "0" * 24, model="m", job_no=0, requests=reqs))


def test_tensor_outputs_with_n_are_refused_per_request() -> None:
    _, _, _, refused = fan_out([_request(0, n=2, do_sample=True, output_logits="generation"), _request(1)],
                               GenerationParams())
    assert list(refused) == [0] and "n > 1" in refused[0]


def test_sample_set_status_rules() -> None:
    ss = SampleSet(n=2, runs=2)
    ok = EngineEvent(index=0, text="a", generate_token_len=1, finish_reason="stop")
    assert not ss.end(0, ok, FinishReason.stop, ResultStatus.completed, None, None)
    from lmdq.contract import ErrorInfo

    err = ErrorInfo(code="internal_error", message="boom")
    assert ss.end(1, ok, FinishReason.error, ResultStatus.failed, err, None)
    status, error = ss.outcome(ss.samples())
    assert status is ResultStatus.failed and error == err


# --------------------------------------------------------------------------- exports


def _result(**kw: Any) -> Result:
    base: dict[str, Any] = {"batch_id": "batch_" + "0" * 24, "custom_id": "c", "index": 0, "model": "m",
                            "status": ResultStatus.completed, "input_token_len": 7}
    base.update(kw)
    return Result(**base)


def test_openai_export_has_one_choice_per_sample() -> None:
    from lmdq.results.openai import to_openai

    samples = [Sample(index=i, text=f"t{i}", finish_reason=FinishReason.stop, generate_token_len=i + 1)
               for i in range(3)]
    r = _result(samples=samples, text="t0", generate_token_len=6, finish_reason=FinishReason.stop)
    body = to_openai(r)["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == ["t0", "t1", "t2"]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13}  # prompt once
    comp = to_openai(r.model_copy(update={"endpoint": Endpoint.completion}))["response"]["body"]
    assert [c["text"] for c in comp["choices"]] == ["t0", "t1", "t2"]
    one = to_openai(_result(text="x"))["response"]["body"]
    assert len(one["choices"]) == 1 and one["choices"][0]["message"]["content"] == "x"


def test_arrow_row_nests_samples() -> None:
    pytest.importorskip("pyarrow")
    from lmdq.results.export import record_batches

    samples = [Sample(index=i, text=f"t{i}", finish_reason=FinishReason.length, generate_token_len=2)
               for i in range(2)]
    raws = [_result(samples=samples, text="t0", prefill_token_len=7).model_dump_json().encode(),
            _result(index=1, custom_id="d", text="solo").model_dump_json().encode()]
    [rb] = list(record_batches(raws))
    rows = rb.to_pylist()
    assert [s["text"] for s in rows[0]["samples"]] == ["t0", "t1"] and rows[0]["prefill_token_len"] == 7
    assert rows[1]["samples"] is None and rows[1]["text"] == "solo"


# --------------------------------------------------------------------------- the worker (sim engine)


def _run_worker(engine: Any, client: redis.Redis, redis_url: str, prefix: str) -> None:
    from lmdq.worker.engines.base import Borrowed
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, burst=True, health_port=0)
    Worker(engine=Borrowed(engine), client=client, settings=s).run()


def _submit(path: Path, model: str, client: redis.Redis, prefix: str, **params: Any) -> str:
    from lmdq.submission.submit import SubmitOptions, submit_file

    opts = SubmitOptions(model=model, allow_unknown_model=True, batch_size=1, params=GenerationParams(**params))
    batch, _ = submit_file(path, opts, client=client, keys=Keys(prefix), ttl_s=3600)
    return batch.id


def _samples(client: redis.Redis, prefix: str, bid: str) -> dict[str, list[str]]:
    res = results_of(client, prefix, bid)
    out = {}
    for r in res:
        assert r.status is ResultStatus.completed and r.samples is not None
        assert [s.index for s in r.samples] == list(range(len(r.samples)))
        assert r.text == r.samples[0].text and r.generate_token_len == sum(s.generate_token_len for s in r.samples)
        out[r.custom_id] = [s.text for s in r.samples]
    return out


def test_sim_worker_writes_one_result_with_n_samples(tmp_path: Path, client: redis.Redis, redis_url: str,
                                                     prefix: str) -> None:
    from lmdq.worker.engines.sim import SimEngine

    rows = [{"custom_id": f"q{i}", "prompt": f"question {i}"} for i in range(5)]
    rows.append({"custom_id": "solo", "prompt": "one", "params": {"n": 1}})
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    engine = SimEngine(model_name="sim", step_ms=0.0)
    bid = _submit(f, "sim", client, prefix, n=3, do_sample=True, random_seed=7, max_new_tokens=6)
    _run_worker(engine, client, redis_url, prefix)
    res = {r.custom_id: r for r in results_of(client, prefix, bid)}
    assert len(res) == 6 and client.hlen(Keys(prefix).results(bid)) == 6
    assert res["solo"].samples is None
    for i in range(5):
        r = res[f"q{i}"]
        assert r.status is ResultStatus.completed and r.samples is not None and len(r.samples) == 3
        assert r.generate_token_len == sum(s.generate_token_len for s in r.samples)
    assert ResultStore(client, keys=Keys(prefix)).batches.get(bid).request_counts.completed == 6


# --------------------------------------------------------------------------- the embedded model (CPU)


def _finals(engine: Any, reqs: list[EngineRequest]) -> dict[int, tuple[str, EngineEvent]]:
    texts: dict[int, str] = {}
    out: dict[int, tuple[str, EngineEvent]] = {}
    for ev in engine.stream(reqs, threading.Event()):
        texts[ev.index] = texts.get(ev.index, "") + ev.text
        if ev.finish_reason is not None:
            out[ev.index] = (texts[ev.index], ev)
    return out


@pytest.mark.model
def test_transformers_prefills_identical_prompts_once(tf_engine: Any) -> None:
    """4 rows with one prompt: ONE prefill (the others report 0 prefilled tokens), and the fanned-out KV
    cache decodes exactly what the prompt decodes alone (greedy), while a different prompt is unaffected."""
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    greedy = GenerationParams(max_new_tokens=8)
    alone = _finals(tf_engine, [EngineRequest(index=0, messages=msgs, params=greedy)])[0]
    other = [{"role": "user", "content": "Name a fruit."}]
    reqs = [EngineRequest(index=i, messages=msgs, params=greedy) for i in range(4)]
    reqs.append(EngineRequest(index=4, messages=other, params=greedy))
    got = _finals(tf_engine, reqs)
    prompt_len = alone[1].input_token_len
    assert alone[1].prefill_token_len == prompt_len
    assert [got[i][1].prefill_token_len for i in range(4)] == [prompt_len, 0, 0, 0]
    assert got[4][1].prefill_token_len == got[4][1].input_token_len
    assert {got[i][0] for i in range(4)} == {alone[0]} and "Paris" in alone[0]
    # seeded samples through the shared prefill are reproducible and differ from each other
    sampled = [EngineRequest(index=i, messages=msgs, params=GenerationParams(
        max_new_tokens=8, do_sample=True, temperature=1.0, random_seed=11 + i)) for i in range(4)]
    a, b = _finals(tf_engine, sampled), _finals(tf_engine, sampled)
    assert [a[i][0] for i in range(4)] == [b[i][0] for i in range(4)]
    assert len({a[i][0] for i in range(4)}) > 1


PROMPTS = [{"custom_id": f"q{i}", "messages": [{"role": "user", "content": f"Say a word about the number {i}."}]}
           for i in range(6)]
#: every sample runs to max_new_tokens (ignore_eos): the engine's final events come in row order
PARAMS: dict[str, Any] = {"n": 4, "do_sample": True, "temperature": 1.0, "random_seed": 1234, "max_new_tokens": 8,
                          "ignore_eos": True}


@pytest.mark.model
def test_n4_seeded_same_samples_in_a_second_batch_and_after_sigkill(
        tf_engine: Any, tmp_path: Path, client: redis.Redis, redis_url: str, prefix: str,
        procs: list[subprocess.Popen[bytes]]) -> None:
    from lmdq.jobs.queue import JobQueue

    f = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    model = tf_engine.model_name
    first = _submit(f, model, client, prefix, **PARAMS)
    _run_worker(tf_engine, client, redis_url, prefix)
    a = _samples(client, prefix, first)
    assert sorted(a) == [p["custom_id"] for p in PROMPTS] and all(len(s) == 4 for s in a.values())
    assert all(len(set(s)) > 1 for s in a.values()), "4 seeded samples of one prompt came out identical"
    for r in results_of(client, prefix, first):  # the prompt was prefilled once per request
        assert r.samples is not None and [s.prefill_token_len for s in r.samples] == [r.input_token_len, 0, 0, 0]
        assert r.prefill_token_len == r.input_token_len

    second = _submit(f, model, client, prefix, **PARAMS)
    _run_worker(tf_engine, client, redis_url, prefix)
    assert _samples(client, prefix, second) == a

    # Third batch: a worker that freezes at the 10th sample's end (jobs of one request, one job at a time:
    # q0 and q1 answered, q2 with 1 of its 4 samples handed up), SIGKILLed there.
    third = _submit(f, model, client, prefix, **PARAMS)
    marker = tmp_path / "frozen"
    log = (tmp_path / "child.log").open("wb")
    child = subprocess.Popen([sys.executable, "-m", "tests.samples_child", redis_url, prefix, str(marker), "10"],
                             cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    procs.append(child)

    def frozen() -> bool:
        assert child.poll() is None, (tmp_path / "child.log").read_text()[-3000:]
        return marker.exists()

    wait_for(frozen, 300, "the worker to freeze at the 10th sample")
    store = ResultStore(client, keys=Keys(prefix))
    wait_for(lambda: store.batches.get(third).request_counts.done >= 2, 60, "q0 and q1's results")
    stored = results_of(client, prefix, third)  # finals, and the partial (progress) record of q2 if one was written
    before = {r.custom_id: [s.text for s in r.samples or []] for r in stored if r.final}
    assert sorted(before) == ["q0", "q1"], before  # mid-batch: q2 has part of its samples, and no result
    assert all(r.status is ResultStatus.in_progress and r.samples is None for r in stored if not r.final)
    assert all(len(s) == 4 for s in before.values())
    child.send_signal(signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL
    jq = JobQueue(client, keys=Keys(prefix))
    reaped: list[tuple[str, str]] = []
    wait_for(lambda: reaped.extend(jq.reap()) or reaped, 60, "the dead worker's lease to expire")
    assert [dead for _, dead in reaped] == ["frozen"]
    _run_worker(tf_engine, client, redis_url, prefix)
    after = _samples(client, prefix, third)
    assert after == a  # no duplicate, no missing sample: each request once, with the same 4 samples
    assert client.hlen(Keys(prefix).results(third)) == len(PROMPTS)
    assert store.batches.get(third).request_counts.completed == len(PROMPTS)
    assert {k: after[k] for k in before} == before  # what was answered before the kill is unchanged
    print(f"\n[samples] n=4 x {len(PROMPTS)} prompts: batch 2 and the SIGKILLed batch 3 equal batch 1; "
          f"answered before the kill: {sorted(before)}; reaped: {len(reaped)} job")
    json.dumps(a)  # the samples are plain text


# --------------------------------------------------------------------------- LMDeploy (a stand-in pipeline)


def test_lmdeploy_primes_shared_prompts_then_streams_all_samples() -> None:
    """With prefix caching, a prompt sent several times in one call (the n samples) is prefilled once by a
    short priming request first; the samples then report LMDeploy's cached_tokens as not prefilled, and
    the first one carries the priming's prefill. Without prefix caching nothing is primed."""
    pytest.importorskip("lmdeploy")
    from types import SimpleNamespace

    from lmdeploy import PytorchEngineConfig
    from lmdeploy.messages import Response

    from lmdq.worker.engine_config import LMDeployConfig
    from lmdq.worker.engines.lmdeploy_engine import LMDeployEngine

    class Pipe:
        def __init__(self, caching: bool) -> None:
            self.backend_config = PytorchEngineConfig(max_batch_size=64, enable_prefix_caching=caching)
            self.async_engine = SimpleNamespace(engine=SimpleNamespace(proc=None))
            self.internal_thread = SimpleNamespace(loop=None)
            self.calls: list[tuple[list[Any], list[Any]]] = []

        def session(self) -> Any:
            return SimpleNamespace(abort=lambda: None, close=lambda: None)

        def stream_infer(self, prompts: list[Any], gen_config: list[Any], **_: Any) -> Iterator[Response]:
            self.calls.append((prompts, gen_config))
            cached = 64 if len(self.calls) > 1 else 0  # the fake prefix cache holds what the first call prefilled
            for i, _p in enumerate(prompts):
                yield Response(text="x", generate_token_len=gen_config[i].max_new_tokens, input_token_len=100,
                               finish_reason="length", index=i, cached_tokens=cached)

    def engine(pipe: Pipe) -> LMDeployEngine:
        return LMDeployEngine(pipe, LMDeployConfig(backend="pytorch"), model_name="m", emit_interval_s=0.0)

    todo = [_request(0, n=3, do_sample=True, random_seed=5, max_new_tokens=9), _request(1, max_new_tokens=9)]
    ereqs, _, _, _ = fan_out(todo, GenerationParams())
    pipe = Pipe(caching=True)
    finals = {ev.index: ev for ev in engine(pipe).stream(ereqs, threading.Event()) if ev.finish_reason}
    (prime_prompts, prime_gens), (main_prompts, main_gens) = pipe.calls
    assert len(prime_prompts) == 1 and prime_gens[0].max_new_tokens == 2 and len(main_prompts) == 4
    assert [g.random_seed for g in main_gens[:3]] == [5, 6, 7] and all(g.n == 1 for g in main_gens)
    # first sample: 100 - 64 in the main call + 100 in the priming; the other two: 36; the n = 1 request: 36
    assert [finals[i].prefill_token_len for i in range(4)] == [136, 36, 36, 36]
    pipe = Pipe(caching=False)
    finals = {ev.index: ev for ev in engine(pipe).stream(ereqs, threading.Event()) if ev.finish_reason}
    assert len(pipe.calls) == 1 and [finals[i].prefill_token_len for i in range(4)] == [100] * 4  # nothing primed


def test_bench_samples_runs_both_sides_on_the_sim(tmp_path: Path) -> None:
    """``lmdq-bench samples`` (the GPU bench's CPU check): both sides drain, same sequences and tokens, and the
    JSON line holds the side-by-side numbers."""
    out = tmp_path / "b.json"
    p = subprocess.run([sys.executable, "-m", "lmdq_bench", "samples", "--prompts", "12", "--n", "4", "--input-len",
                        "24", "--output-len", "6", "--sim-step-ms", "1", "--raw-baseline", "-o", str(out)], cwd=ROOT,
                       capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    res = json.loads(out.read_text())
    runs = res["detail"]["runs"]
    assert runs["n"]["requests"] == 12 and runs["lines"]["requests"] == 48
    assert runs["n"]["sequences"] == runs["lines"]["sequences"] == 48
    assert runs["n"]["tokens"] == runs["lines"]["tokens"] == 48 * 6
    assert res["n_tok_s"] > 0 and res["lines_tok_s"] > 0 and res["n_prefilled"] <= runs["n"]["prompt_tokens_unshared"]
    # --raw-baseline: the same 48 requests in one engine call beside them, the same tokens
    assert runs["raw"]["requests"] == 48 and runs["raw"]["tokens"] == 48 * 6 and res["raw_tok_s"] > 0
    assert p.stdout.decode().splitlines()[-2].startswith("raw ")
