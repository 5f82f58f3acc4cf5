"""Rich outputs (logprobs, logits, last hidden states) and guided decoding (response_format).

The transformers engine runs the real embedded SmolLM2 on CPU (``@pytest.mark.model``); the sim engine
checks the shapes fast and carries 100 guided requests through the whole lmdq path (producer CLI →
Redis → worker → results). 100 guided requests on the CPU model would take minutes on 2 cores
(~15-20 decode steps each at batch size 1), so the model side runs 20 of them (~25 s).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from lmdq.contract import GenerationParams, ResponseFormat, Result, ResultStatus
from lmdq.guided import check, schema_of, to_lmdeploy
from lmdq.submission.formats import InputError, InputFormat, iter_lines
from lmdq.worker.engines.base import EngineEvent, EngineRequest
from lmdq.worker.engines.sim import SimEngine, minimal_instance
from tests.conftest import run_cli
from tests.helpers import PERSON_SCHEMA, sim_batch_results, write_jsonl

jsonschema = pytest.importorskip("jsonschema")

SCHEMA: dict[str, Any] = PERSON_SCHEMA
RF = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def _run(engine: Any, reqs: list[EngineRequest]) -> tuple[dict[int, EngineEvent], dict[int, str]]:
    finals: dict[int, EngineEvent] = {}
    texts: dict[int, str] = {}
    for ev in engine.stream(reqs, threading.Event()):
        texts[ev.index] = texts.get(ev.index, "") + ev.text
        if ev.finish_reason is not None:
            assert ev.index not in finals
            finals[ev.index] = ev
    assert sorted(finals) == [r.index for r in reqs]
    return finals, texts


def _check_logprobs(ev: EngineEvent, k: int) -> None:
    assert ev.logprobs is not None and len(ev.logprobs) == ev.generate_token_len
    for token_id, lp, top in ev.logprobs:
        assert isinstance(token_id, int) and lp <= 0.0
        assert len(top) == k
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert not top or top[0][1] >= lp - 1e-6  # nothing beats the best alternative


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


# ---------------------------------------------------------------------------------------- sim engine


@pytest.fixture
def sim() -> Iterator[SimEngine]:
    e = SimEngine(step_ms=0.5, sim_vocab=1000, sim_hidden=64)
    yield e
    e.close()


def test_sim_rich_outputs_shapes(sim: SimEngine) -> None:
    gen = GenerationParams(max_new_tokens=7, logprobs=3, output_logits="generation",
                           output_last_hidden_state="generation")
    all_ = GenerationParams(max_new_tokens=5, logprobs=1, output_logits="all", output_last_hidden_state="all")
    finals, _ = _run(sim, [EngineRequest(index=0, prompt="one two three", params=gen),
                           EngineRequest(index=1, prompt="four five", params=all_),
                           EngineRequest(index=2, prompt="plain", params=GenerationParams(max_new_tokens=3))])
    a, b, c = finals[0], finals[1], finals[2]
    _check_logprobs(a, 3)
    _check_logprobs(b, 1)
    assert a.tensors is not None and _shape(a.tensors["logits"]) == (7, 1000)
    assert _shape(a.tensors["last_hidden_state"]) == (7, 64)
    assert a.tensors["logits"].dtype.name == "float32"
    assert b.tensors is not None and _shape(b.tensors["logits"]) == (b.input_token_len + 5 - 1, 1000)
    assert _shape(b.tensors["last_hidden_state"]) == (b.input_token_len + 5 - 1, 64)
    assert c.logprobs is None and c.tensors is None
    again, _ = _run(sim, [EngineRequest(index=0, prompt="one two three", params=gen)])
    assert again[0].logprobs == a.logprobs  # deterministic


def test_sim_guided_json_is_a_valid_minimal_instance(sim: SimEngine) -> None:
    reqs = [EngineRequest(index=i, prompt=f"person {i}", params=GenerationParams(max_new_tokens=50,
                                                                                response_format=RF))
            for i in range(5)]
    reqs.append(EngineRequest(index=5, prompt="x", params=GenerationParams(
        max_new_tokens=4, response_format=ResponseFormat(type="json_object"))))
    finals, texts = _run(sim, reqs)
    for i in range(5):
        assert finals[i].finish_reason == "stop"
        jsonschema.validate(json.loads(texts[i]), SCHEMA)
    assert json.loads(texts[5]) == {}


def test_minimal_instance_common_keywords() -> None:
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "minLength": 2}, "minItems": 2},
        "kind": {"enum": ["a", "b"]}, "score": {"type": "number", "exclusiveMinimum": 0.5},
        "ok": {"type": "boolean"}, "maybe": {"type": ["null", "integer"], "minimum": 3},
        "nested": {"anyOf": [{"type": "object", "properties": {"c": {"const": 7}}}, {"type": "null"}]}}}
    value = minimal_instance(schema)
    jsonschema.validate(value, schema)
    assert value["tags"] == ["aa", "aa"] and value["nested"] == {"c": 7}


# ----------------------------------------------------------------------------- mapping and validation


def test_response_format_helpers() -> None:
    rf = ResponseFormat.model_validate(RF)
    assert schema_of(rf) == SCHEMA
    assert to_lmdeploy(rf) == {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    bare = ResponseFormat(type="json_schema", json_schema=SCHEMA)  # the schema itself, no wrapper
    assert schema_of(bare) == SCHEMA
    assert to_lmdeploy(ResponseFormat(type="regex", regex="[a-z]+")) == {"type": "regex_schema",
                                                                      "regex_schema": "[a-z]+"}
    assert to_lmdeploy(ResponseFormat(type="json_object")) == {"type": "json_object"}
    check(rf)
    with pytest.raises(ValueError, match="invalid JSON schema"):
        check(ResponseFormat(type="json_schema", json_schema={"schema": {"type": "objekt"}}))
    with pytest.raises(ValueError, match="invalid regex"):
        check(ResponseFormat(type="regex", regex="a(b"))


def test_openai_response_format_mapped_and_refused_with_file_line(tmp_path: Path) -> None:
    def line(i: int, rf: Any) -> dict[str, Any]:
        return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": rf}}

    rows = [line(1, RF), line(2, {"type": "json_object"}), line(3, {"type": "text"}),
            line(4, {"type": "regex_schema", "regex_schema": "[0-9]{3}"}),
            line(5, {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
            line(6, {"type": "regex_schema", "regex_schema": "a(b"}),
            line(7, {"type": "json_schema", "json_schema": {"name": "x"}}),
            line(8, {"type": "yaml"}),
            {"custom_id": "c9", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                      "top_logprobs": 4}}]
    f = write_jsonl(tmp_path / "in.jsonl", rows)
    out = list(iter_lines(f, fmt=InputFormat.openai))
    ok = [x for x in out if not isinstance(x, InputError)]
    errs = {x.line: x for x in out if isinstance(x, InputError)}
    assert [p.params.response_format.type if p.params and p.params.response_format else None for p in ok[:4]] == [
        "json_schema", "json_object", None, "regex"]
    assert ok[0].params is not None and ok[0].params.response_format is not None
    assert schema_of(ok[0].params.response_format) == SCHEMA
    assert ok[4].params is not None and ok[4].params.logprobs == 4
    assert sorted(errs) == [5, 6, 7, 8]
    assert errs[5].field == "body.response_format.json_schema.schema" and "objekt" in errs[5].message
    assert errs[6].field == "body.response_format.regex_schema"
    assert errs[7].field == "body.response_format.json_schema.schema"
    assert errs[8].field == "body.response_format.type"
    assert f"{f}:5" in str(errs[5])


def test_native_jsonl_params_response_format_checked(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", [
        {"prompt": "a", "params": {"response_format": RF, "logprobs": 2, "output_logits": "generation"}},
        {"prompt": "b", "params": {"response_format": {"type": "regex", "regex": "(("}}},
        {"prompt": "c", "params": {"output_last_hidden_state": "everything"}},
    ])
    out = list(iter_lines(f, fmt=InputFormat.jsonl))
    assert not isinstance(out[0], InputError) and out[0].params is not None
    assert out[0].params.output_logits == "generation"
    assert isinstance(out[1], InputError) and out[1].field == "params.response_format"
    assert isinstance(out[2], InputError) and out[2].field == "params.output_last_hidden_state"


# ------------------------------------------------------------------------- whole lmdq path, sim engine


def test_100_guided_requests_through_lmdq_on_sim(tmp_path: Path, env: dict[str, str],
                                                 client: redis.Redis) -> None:
    rows = [{"custom_id": f"g{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "sim", "messages": [{"role": "user", "content": f"Person {i} as JSON"}],
                      "max_tokens": 64, "response_format": RF}} for i in range(100)]
    f = write_jsonl(tmp_path / "guided.jsonl", rows)
    _, results = sim_batch_results(f, env, "--batch-size", "25")
    assert len(results) == 100
    for r in results:
        assert r.status is ResultStatus.completed and r.finish_reason is not None
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_bad_schema_refused_at_submit_with_file_line(tmp_path: Path, env: dict[str, str]) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    rows = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "sim", "messages": [{"role": "user", "content": "hi"}],
                      "response_format": bad if i == 1 else RF}} for i in range(3)]
    f = write_jsonl(tmp_path / "bad.jsonl", rows)
    p = run_cli("producer", "submit", str(f), "--allow-unknown-model", env=env)
    assert p.returncode != 0
    err = p.stderr.decode() + p.stdout.decode()
    assert "bad.jsonl:2" in err and "response_format" in err


# ------------------------------------------------------------------------------ transformers engine


@pytest.mark.model
def test_transformers_logprobs_logits_hidden_states(tf_engine: Any) -> None:
    torch = pytest.importorskip("torch")
    vocab = tf_engine._vocab_size
    hidden = int(tf_engine._model.config.hidden_size)
    gen = GenerationParams(max_new_tokens=6, ignore_eos=True, logprobs=5, output_logits="generation",
                           output_last_hidden_state="generation")
    all_ = GenerationParams(max_new_tokens=4, ignore_eos=True, logprobs=0, output_logits="all",
                            output_last_hidden_state="all")
    finals, texts = _run(tf_engine, [EngineRequest(index=0, prompt="The capital of France is", params=gen),
                                     EngineRequest(index=1, prompt="Count: one, two,", params=all_)])
    a, b = finals[0], finals[1]
    assert a.generate_token_len == 6 and b.generate_token_len == 4
    _check_logprobs(a, 5)
    _check_logprobs(b, 0)
    # greedy: the chosen token is the top-1 of the raw distribution
    assert all(tok == top[0][0] and abs(lp - top[0][1]) < 1e-5 for tok, lp, top in a.logprobs or [])
    assert a.tensors is not None and _shape(a.tensors["logits"]) == (6, vocab)
    assert _shape(a.tensors["last_hidden_state"]) == (6, hidden)
    assert a.tensors["logits"].dtype == torch.float32
    # the logprobs are the log_softmax of the returned logits
    lps = torch.log_softmax(a.tensors["logits"], dim=-1)
    assert all(abs(float(lps[i, tok]) - lp) < 1e-4 for i, (tok, lp, _) in enumerate(a.logprobs or []))
    # last_hidden_state is the final-norm state: the LM head maps it onto the logits
    head = tf_engine._model.get_output_embeddings().weight.float()
    assert torch.allclose(a.tensors["last_hidden_state"] @ head.T, a.tensors["logits"], atol=1e-3)
    n_all = b.input_token_len + 4 - 1
    assert b.tensors is not None and _shape(b.tensors["logits"]) == (n_all, vocab)
    assert _shape(b.tensors["last_hidden_state"]) == (n_all, hidden)
    # the generation rows of 'all' are the tail; 'generation' alone gives exactly those rows
    tail, _ = _run(tf_engine, [EngineRequest(index=0, prompt="Count: one, two,", params=GenerationParams(
        max_new_tokens=4, ignore_eos=True, output_logits="generation"))])
    assert tail[0].tensors is not None
    assert torch.allclose(tail[0].tensors["logits"], b.tensors["logits"][-4:], atol=1e-3)


@pytest.mark.model
def test_transformers_guided_json_schema_valid(tf_engine: Any) -> None:
    names = ["Ann", "Bob", "Carla", "Dmitri", "Eve", "Farid"]
    reqs = [EngineRequest(index=i, prompt=f"Give {names[i % 6]}'s profile as JSON with name and age.",
                          params=GenerationParams(max_new_tokens=40, response_format=RF,
                                                  do_sample=i >= 6, temperature=0.9, random_seed=i))
            for i in range(20)]
    finals, texts = _run(tf_engine, reqs)
    for i in range(20):
        assert finals[i].finish_reason == "stop", (finals[i], texts[i])
        jsonschema.validate(json.loads(texts[i]), SCHEMA)


@pytest.mark.model
def test_transformers_guided_regex_and_json_object(tf_engine: Any) -> None:
    import re

    finals, texts = _run(tf_engine, [
        EngineRequest(index=0, prompt="Pick a three digit number.", params=GenerationParams(
            max_new_tokens=10, response_format=ResponseFormat(type="regex", regex="[0-9]{3}"))),
        EngineRequest(index=1, prompt="Describe a cat as a JSON object.", params=GenerationParams(
            max_new_tokens=80, response_format=ResponseFormat(type="json_object"))),
        EngineRequest(index=2, prompt="x", params=GenerationParams(
            max_new_tokens=5, response_format=ResponseFormat(type="json_schema", json_schema={"schema": {
                "type": "objekt"}}))),
    ])
    assert finals[0].finish_reason == "stop" and re.fullmatch("[0-9]{3}", texts[0])
    if finals[1].finish_reason == "stop":
        assert isinstance(json.loads(texts[1]), dict)
    else:  # a long object may hit max_new_tokens: still a valid prefix start
        assert texts[1].lstrip().startswith("{")
    assert finals[2].finish_reason == "error" and finals[2].error_code == "bad_request"


@pytest.mark.model
def test_hidden_state_generation_lands_in_a_safetensors_file(tf_engine: Any, tmp_path: Path, client: redis.Redis,
                                                             redis_url: str, prefix: str) -> None:
    """The real transformers engine through the worker: output_last_hidden_state='generation' ends as a
    safetensors file of shape [generated tokens, hidden size], read back from the URI the result carries."""
    from safetensors.numpy import load_file

    from lmdq.redis.keys import Keys
    from lmdq.results.blobs import read_tensor
    from lmdq.results.store import ResultStore
    from lmdq.submission.submit import SubmitOptions, submit_file
    from lmdq.worker.engines.base import Borrowed
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    f = write_jsonl(tmp_path / "p.jsonl", [{"custom_id": "h", "prompt": "Name a colour."}])
    opts = SubmitOptions(model=tf_engine.model_name, allow_unknown_model=True, blob_url=str(tmp_path / "blobs"),
                         params=GenerationParams(max_new_tokens=6, ignore_eos=True,
                                                 output_last_hidden_state="generation"))
    batch, _ = submit_file(f, opts, client=client, keys=Keys(prefix), ttl_s=3600)
    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, burst=True, health_port=0,
                       allowed_output_urls=str(tmp_path))  # issue 14: the batch's blob_url must be allowed
    Worker(engine=Borrowed(tf_engine), client=client, settings=s).run()
    raw = next(ResultStore(client, keys=Keys(prefix)).iter_results(batch.id, 1, partial=False))[1]
    r = Result.model_validate_json(raw)  # type: ignore[arg-type]
    assert r.status is ResultStatus.completed and r.generate_token_len == 6
    ref = r.tensors["last_hidden_state"]  # type: ignore[index]
    hidden = tf_engine._model.config.hidden_size  # 576 for SmolLM2-135M
    assert ref.shape == [6, hidden] and ref.dtype == "float32" and ref.nbytes == 6 * hidden * 4
    assert ref.uri.endswith(".safetensors") and Path(ref.uri).is_file()
    assert read_tensor(ref).shape == (6, hidden)
    assert load_file(ref.uri)[ref.key].shape == (6, hidden)  # any safetensors reader, straight from the URI
