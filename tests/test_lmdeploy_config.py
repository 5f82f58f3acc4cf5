"""LMDeploy config translation against LMDeploy's REAL classes (lmdeploy imports on CPU).

TurboMind cannot run on the CPU or on the GPU host (its binary needs CUDA 12 cuBLAS), so its
side is covered here: the flags must reach TurbomindEngineConfig exactly.
"""

from __future__ import annotations

import pytest

lmdeploy = pytest.importorskip("lmdeploy")

from lmdeploy import GenerationConfig, PytorchEngineConfig, TurbomindEngineConfig  # noqa: E402

from lmdq.contract import GenerationParams  # noqa: E402
from lmdq.worker.engine_config import LMDeployConfig  # noqa: E402
from lmdq.worker.engines.base import EngineError  # noqa: E402
from lmdq.worker.engines.lmdeploy_engine import (  # noqa: E402
    _check_tp,
    build_backend_config,
    build_gen_config,
    resolve_chat_template,
    resolve_dtype,
)


def test_pytorch_backend_flags_reach_pytorch_engine_config() -> None:
    c = build_backend_config(LMDeployConfig(backend="pytorch", tp=2, dtype="float16", session_len=4096,
                                            max_batch_size=256, cache_max_entry_count=0.5, quant_policy=8,
                                            eager_mode=True))
    assert isinstance(c, PytorchEngineConfig)
    assert (c.tp, c.dtype, c.session_len, c.max_batch_size, c.cache_max_entry_count, c.eager_mode) == (
        2, "float16", 4096, 256, 0.5, True)
    assert int(c.quant_policy) == 8
    # the engine loop runs in its own process unless asked not to (as LMDeploy's own api_server does)
    assert c.enable_mp_engine is True
    assert build_backend_config(LMDeployConfig(backend="pytorch", mp_engine=False)).enable_mp_engine is False


@pytest.mark.parametrize("backend", ["turbomind", "auto"])
def test_turbomind_and_auto_give_turbomind_config(backend: str) -> None:
    c = build_backend_config(LMDeployConfig(backend=backend, tp=4, dtype="bfloat16", session_len=8192,
                                            max_batch_size=128, cache_max_entry_count=0.9, quant_policy=4))
    assert isinstance(c, TurbomindEngineConfig)
    assert (c.tp, c.dtype, c.session_len, c.max_batch_size, c.cache_max_entry_count, c.quant_policy) == (
        4, "bfloat16", 8192, 128, 0.9, 4)


def test_defaults_leave_lmdeploy_defaults() -> None:
    c = build_backend_config(LMDeployConfig(backend="pytorch"))
    ref = PytorchEngineConfig()
    assert (c.tp, c.dtype, c.session_len, c.max_batch_size, c.cache_max_entry_count) == (
        ref.tp, ref.dtype, ref.session_len, ref.max_batch_size, ref.cache_max_entry_count)


def test_worker_defaults_build_a_turbomind_config() -> None:
    """The worker's defaults (--backend auto, no --max-batch-size): TurboMind's config used to refuse the
    explicit max_batch_size=None lmdq passed; unset values are now left to LMDeploy."""
    c = build_backend_config(LMDeployConfig())
    assert isinstance(c, TurbomindEngineConfig) and c.max_batch_size == TurbomindEngineConfig().max_batch_size


@pytest.mark.parametrize("kw, msg", [
    ({"backend": "vllm"}, "--backend"),
    ({"dtype": "float32"}, "--dtype"),
    ({"quant_policy": 2}, "--quant-policy"),
    ({"backend": "pytorch", "cache_max_entry_count": 1.5}, "--cache-max-entry-count"),
    ({"num_gpu_blocks": 100}, "--num-gpu-blocks"),  # TurboMind would drop it
])
def test_bad_flags_are_clear_errors(kw: dict, msg: str) -> None:
    """Checked where the settings are declared (LMDeployConfig), worded with the flag's name."""
    with pytest.raises(ValueError, match=msg):
        build_backend_config(LMDeployConfig.from_values(**kw))


def test_generation_params_map_field_for_field() -> None:
    p = GenerationParams(max_new_tokens=77, min_new_tokens=3, do_sample=True, temperature=0.3, top_p=0.9, top_k=7,
                         min_p=0.05, repetition_penalty=1.1, random_seed=42, stop_words=["\n\n"],
                         stop_token_ids=[2], ignore_eos=True, skip_special_tokens=False, logprobs=5)
    g = build_gen_config(p.resolved())
    assert isinstance(g, GenerationConfig)
    for f in ("max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p",
              "repetition_penalty", "random_seed", "stop_words", "stop_token_ids", "ignore_eos",
              "skip_special_tokens", "logprobs"):
        assert getattr(g, f) == getattr(p, f), f


def test_lmdq_defaults_equal_lmdeploy_defaults() -> None:
    """GenerationParams.resolved() promises LMDeploy's defaults: check against the real class."""
    ours = build_gen_config(GenerationParams().resolved())
    ref = GenerationConfig()
    for f in ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
              "ignore_eos", "skip_special_tokens"):
        assert getattr(ours, f) == getattr(ref, f), f


def test_chat_template_name() -> None:
    assert resolve_chat_template(None) is None
    assert resolve_chat_template("llama3").model_name == "llama3"


def test_tp_above_visible_gpus_is_a_clear_error() -> None:
    import torch

    n = torch.cuda.device_count()
    tp = max(n + 1, 2)
    with pytest.raises(EngineError, match=f"--tp {tp} needs {tp} GPUs but {n} are visible"):
        _check_tp(tp)
    _check_tp(1)


def test_worker_flags_reach_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """lmdq-worker flags/env → WorkerSettings → the config LMDeployEngine would build."""
    monkeypatch.setenv("LMDQ_QUANT_POLICY", "8")
    monkeypatch.setenv("LMDQ_MP_ENGINE", "false")
    from lmdq.worker.settings import WorkerSettings

    s = WorkerSettings(model="/m", engine="lmdeploy", backend="pytorch", tp=1, dtype="float16", session_len=2048,
                       max_batch_size=64, eager_mode=True)
    c = build_backend_config(s.engine_config)
    assert isinstance(c, PytorchEngineConfig) and int(c.quant_policy) == 8 and c.max_batch_size == 64
    assert c.enable_mp_engine is False


# Every LMDeployConfig field, with a value that is NOT its default, and where it lands: the attribute of
# LMDeploy's engine config it must reach, or (None) the part of LMDeployEngine that consumes it instead.
# A new field fails test_every_config_field_is_accounted_for until it is wired and listed here.
NON_DEFAULT = {
    "session_len": (4096, "session_len"),
    "dtype": ("float16", "dtype"),
    "tp": (2, "tp"),
    "max_batch_size": (96, "max_batch_size"),
    "cache_max_entry_count": (0.55, "cache_max_entry_count"),
    "quant_policy": (4, "quant_policy"),
    "eager_mode": (True, "eager_mode"),            # pytorch only
    "mp_engine": (False, "enable_mp_engine"),      # pytorch only
    "enable_prefix_caching": (True, "enable_prefix_caching"),
    "num_gpu_blocks": (300, "num_gpu_blocks"),     # pytorch only
    "backend": ("pytorch", None),                  # picks the class (checked below)
    "chat_template": ("llama3", None),             # pipeline's chat_template_config (resolve_chat_template)
    "raw": (True, None),                           # LMDeployEngine.raw: stream_infer's do_preprocess
    "stream_from_new_tokens": (0, None),            # LMDeployEngine.streams: stream_infer's stream_response
    "warmup_requests": (0, None),                  # LMDeployEngine.warm_up, before the worker reports ready
    "occupancy_log_s": (1.0, None),                # LMDeployEngine._log_occupancy, a thread of its own
}
PYTORCH_ONLY = {"eager_mode", "mp_engine", "num_gpu_blocks"}


def test_every_config_field_is_accounted_for() -> None:
    assert set(NON_DEFAULT) == set(LMDeployConfig.model_fields)
    for name, (value, _) in NON_DEFAULT.items():
        assert value != LMDeployConfig.model_fields[name].default, name


@pytest.mark.parametrize("backend", ["pytorch", "turbomind"])
@pytest.mark.parametrize("field", [f for f, (_, attr) in NON_DEFAULT.items() if attr])
def test_every_engine_field_reaches_build_backend_config(backend: str, field: str) -> None:
    """One field at a time set away from its default: the LMDeploy config object carries exactly that value
    (and the others stay what build_backend_config gives for the defaults)."""
    value, attr = NON_DEFAULT[field]
    if backend == "turbomind" and field in PYTORCH_ONLY:
        # Not a skip (bd9ca4b skipped these three with "a PyTorch-engine setting"): TurboMind has no such knob,
        # so --num-gpu-blocks is refused by name and the two "pytorch:" switches leave TurboMind's config as is.
        if field == "num_gpu_blocks":
            with pytest.raises(ValueError, match=r"--num-gpu-blocks: a PyTorch-engine setting; pass --backend "):
                LMDeployConfig(backend=backend, **{field: value})
            return
        assert LMDeployConfig.model_fields[field].description.startswith("pytorch: ")  # its --help says so
        c = build_backend_config(LMDeployConfig(backend=backend, **{field: value}))
        assert isinstance(c, TurbomindEngineConfig) and not hasattr(c, attr)
        assert c == build_backend_config(LMDeployConfig(backend=backend))
        return
    base = build_backend_config(LMDeployConfig(backend=backend))
    c = build_backend_config(LMDeployConfig(backend=backend, **{field: value}))
    assert isinstance(c, PytorchEngineConfig if backend == "pytorch" else TurbomindEngineConfig)
    got = getattr(c, attr)
    assert (int(got) if field == "quant_policy" else got) == value
    assert getattr(base, attr) != value  # the default did not already produce it


def test_engine_constructor_hands_every_field_on(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """LMDeployEngine.load(config): the backend fields reach the pipeline's backend_config, chat_template its
    chat_template_config, raw the engine (LMDeploy's pipeline replaced by a recorder: no GPU here)."""
    from lmdq.worker.engines.lmdeploy_engine import LMDeployEngine

    seen: dict = {}

    def fake_pipeline(model_path, backend_config, chat_template_config, log_level):  # type: ignore[no-untyped-def]
        seen.update(model_path=model_path, backend_config=backend_config, chat_template_config=chat_template_config)
        pipe = _FakePipe(backend="pytorch")
        pipe.backend_config = backend_config
        return pipe

    monkeypatch.setattr(lmdeploy, "pipeline", fake_pipeline)
    values = {f: v for f, (v, _) in NON_DEFAULT.items() if f != "tp"}  # tp > 1 needs that many GPUs
    eng = LMDeployEngine.load(LMDeployConfig(**values), model_path=str(tmp_path), served_model_name="m")
    bc = seen["backend_config"]
    for field, (value, attr) in NON_DEFAULT.items():
        if attr and field != "tp":
            got = getattr(bc, attr)
            assert (int(got) if field == "quant_policy" else got) == value, field
    assert isinstance(bc, PytorchEngineConfig) and eng.backend == "pytorch"  # backend
    assert seen["chat_template_config"].model_name == NON_DEFAULT["chat_template"][0]  # chat_template
    assert eng.raw is True and eng.capacity == NON_DEFAULT["max_batch_size"][0]  # raw
    assert eng.config == LMDeployConfig(**values)


SMOLLM2_135M = {"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
                "num_hidden_layers": 30, "tie_word_embeddings": True, "vocab_size": 49152}


def test_dtype_guard_for_bf16_affected_shape(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_135M))
    assert resolve_dtype(str(tmp_path), "auto")[0] == "float16"
    d, warn = resolve_dtype(str(tmp_path), "bfloat16")
    assert d == "bfloat16" and warn and "float16" in warn
    assert resolve_dtype(str(tmp_path), "float16") == ("float16", None)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**SMOLLM2_135M, "hidden_size": 4096}))
    assert resolve_dtype(str(other), "auto") == ("auto", None)
    assert resolve_dtype("org/hub-id", "auto") == ("auto", None)


# ------------------------------------------------------------------ rich outputs / guided decoding

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def test_rich_output_params_reach_generation_config() -> None:
    p = GenerationParams(logprobs=3, output_logits="generation", output_last_hidden_state="all",
                         response_format={"type": "json_schema",
                                          "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    g = build_gen_config(p.resolved())
    assert isinstance(g, GenerationConfig)
    assert (g.logprobs, g.output_logits, g.output_last_hidden_state) == (3, "generation", "all")
    assert g.response_format == {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    plain = build_gen_config(GenerationParams().resolved())
    assert (plain.logprobs, plain.output_logits, plain.output_last_hidden_state, plain.response_format) == (
        None, None, None, None)


@pytest.mark.parametrize("rf", [
    {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    {"type": "json_schema", "json_schema": SCHEMA},
    {"type": "json_object"},
    {"type": "regex", "regex": "[0-9]{3}"},
])
def test_response_format_is_what_lmdeploy_compiles(rf: dict) -> None:
    """The mapped dict goes through LMDeploy's OWN guided-decoding front door (needs xgrammar)."""
    pytest.importorskip("xgrammar")
    from lmdeploy._guided_decoding import ensure_response_format_compilable

    g = build_gen_config(GenerationParams(response_format=rf).resolved())
    ensure_response_format_compilable(g.response_format)
    if rf["type"] == "regex":
        assert g.response_format == {"type": "regex_schema", "regex_schema": "[0-9]{3}"}


def test_logprob_rows_from_lmdeploy_dicts() -> None:
    from lmdq.worker.engines.lmdeploy_engine import _logprob_rows

    rows = _logprob_rows([5, 9], [{5: -0.1, 7: -2.5, 8: -3.0}, {7: -0.2, 8: -1.0, 9: -4.0}], 2)
    assert rows == [(5, -0.1, [(5, -0.1), (7, -2.5)]), (9, -4.0, [(7, -0.2), (8, -1.0)])]


class _FakePipe:
    """Just enough of ``lmdeploy.pipeline`` for LMDeployEngine._stream_group: scripted Response chunks,
    shaped as lmdeploy 0.18's async_engine yields them (token_ids/logprobs deltas, cumulative tensors,
    a terminal chunk with none of them)."""

    def __init__(self, prefix_caching: bool = False, backend: str = "turbomind") -> None:
        cfg = PytorchEngineConfig if backend == "pytorch" else TurbomindEngineConfig
        self.backend_config = cfg(enable_prefix_caching=prefix_caching)
        self.calls = 0

    def session(self) -> object:
        class _S:
            def abort(self) -> None: ...
            def close(self) -> None: ...
        return _S()

    def stream_infer(self, prompts, sessions, gen_config, do_preprocess, stream_response):  # type: ignore[no-untyped-def]
        import torch
        from lmdeploy.messages import Response

        self.calls += 1
        self.streamed = stream_response
        logits = torch.arange(3 * 4, dtype=torch.float16).reshape(3, 4)
        yield Response(text="a", generate_token_len=1, input_token_len=5, index=0, token_ids=[11],
                       logprobs=[{11: -0.5, 12: -1.5}], logits=logits[:1])
        yield Response(text="b", generate_token_len=3, input_token_len=5, index=0, token_ids=[12, 13],
                       logprobs=[{12: -0.25, 11: -2.0}, {14: -0.1, 13: -0.9}], logits=logits[:3])
        yield Response(text="", generate_token_len=3, input_token_len=5, index=0, finish_reason="length")


def _engine(pipe: _FakePipe) -> object:
    from lmdq.worker.engines.lmdeploy_engine import LMDeployEngine

    # the stand-in goes in through the constructor, as the real pipeline does (LMDeployEngine.load)
    return LMDeployEngine(pipe, LMDeployConfig(stream_from_new_tokens=0), model_name="m", emit_interval_s=0.0)


def test_stream_carries_rich_outputs_on_the_final_event() -> None:
    import threading

    from lmdq.worker.engines.base import EngineRequest

    params = GenerationParams(logprobs=1, output_logits="generation")
    events = list(_engine(_FakePipe()).stream([EngineRequest(index=4, prompt="x", params=params)],  # type: ignore[attr-defined]
                                               threading.Event()))
    final = events[-1]
    assert final.finish_reason == "length" and final.index == 4
    assert all(e.logprobs is None and e.tensors is None for e in events[:-1])
    assert final.logprobs == [(11, -0.5, [(11, -0.5)]), (12, -0.25, [(12, -0.25)]), (13, -0.9, [(14, -0.1)])]
    assert final.tensors is not None and tuple(final.tensors["logits"].shape) == (3, 4)
    assert str(final.tensors["logits"].dtype) == "torch.float32"


def test_all_outputs_refused_when_the_engine_has_prefix_caching() -> None:
    import threading

    from lmdq.worker.engines.base import EngineRequest

    pipe = _FakePipe(prefix_caching=True)
    reqs = [EngineRequest(index=0, prompt="x", params=GenerationParams(output_logits="all")),
            EngineRequest(index=1, prompt="y", params=GenerationParams(output_last_hidden_state="all"))]
    events = list(_engine(pipe).stream(reqs, threading.Event()))  # type: ignore[attr-defined]
    assert [(e.index, e.finish_reason, e.error_code) for e in events] == [
        (0, "error", "unsupported_feature"), (1, "error", "unsupported_feature")]
    assert "prefix caching" in (events[0].error_message or "") and pipe.calls == 0


def test_pytorch_backend_refuses_what_it_would_drop() -> None:
    """LMDeploy 0.18's PyTorch engine drops hidden states and generation logits with a warning: lmdq fails
    those requests clearly instead of returning a result without the tensors; logprobs still go through."""
    import threading

    from lmdq.worker.engines.base import EngineRequest

    pipe = _FakePipe(backend="pytorch")
    reqs = [EngineRequest(index=0, prompt="x", params=GenerationParams(output_last_hidden_state="generation")),
            EngineRequest(index=1, prompt="y", params=GenerationParams(output_logits="generation")),
            EngineRequest(index=2, prompt="z", params=GenerationParams(logprobs=1))]
    events = list(_engine(pipe).stream(reqs, threading.Event()))  # type: ignore[attr-defined]
    refused = [(e.index, e.error_code) for e in events if e.finish_reason == "error"]
    assert refused == [(0, "unsupported_feature"), (1, "unsupported_feature")]
    msg = events[0].error_message or ""
    assert "PyTorch engine" in msg and "--backend turbomind" in msg
    assert pipe.calls == 1 and events[-1].finish_reason == "length"


def test_tp_must_divide_attention_heads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """LMDeploy asserts heads % tp == 0 with no message (seen on the GPU with SmolLM2's 9 heads, tp=2)."""
    import json

    from lmdq.worker.engines.lmdeploy_engine import _check_tp

    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9}))
    with pytest.raises(EngineError, match=r"--tp 2 must divide the model's num_attention_heads \(9\)"):
        _check_tp(2, str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 12, "num_key_value_heads": 6}))
    with pytest.raises(EngineError, match=r"num_key_value_heads \(6\)"):
        _check_tp(4, str(tmp_path))


def test_short_requests_come_back_whole_and_long_ones_stream() -> None:
    """Per-token streaming costs GIL time per token in the worker's process (TurboMind: 0.60x raw on the
    H200): a call streams only if one of its requests may be long (``stream_from_new_tokens``)."""
    import threading

    from lmdq.worker.engines.base import EngineRequest

    pipe = _FakePipe()
    eng = _engine(pipe)
    eng.stream_from_new_tokens = 1024  # type: ignore[attr-defined]
    short = EngineRequest(index=0, prompt="x", params=GenerationParams(max_new_tokens=256))
    events = list(eng.stream([short], threading.Event()))  # type: ignore[attr-defined]
    assert pipe.streamed is False
    assert [(e.text, e.finish_reason, e.whole) for e in events] == [("ab", "length", True)]

    long_ = EngineRequest(index=1, prompt="y", params=GenerationParams(max_new_tokens=1024))
    events = list(eng.stream([long_], threading.Event()))  # type: ignore[attr-defined]
    assert pipe.streamed is True and not any(e.whole for e in events)
    assert [(e.text, e.generate_token_len) for e in events] == [("a", 1), ("b", 3), ("", 3)]
    list(eng.stream([short, long_], threading.Event()))  # type: ignore[attr-defined]
    assert pipe.streamed is True  # one long request: the whole call streams

    eng.stream_from_new_tokens = 0  # type: ignore[attr-defined]
    list(eng.stream([short], threading.Event()))  # type: ignore[attr-defined]
    assert pipe.streamed is True


def test_turbomind_refuses_guided_decoding_and_pytorch_takes_it() -> None:
    """LMDeploy 0.18's TurboMind keeps one grammar per model instance: concurrent json_schema requests
    stalled on the H200, so lmdq fails them clearly (unsupported_feature) instead of returning junk."""
    import threading

    from lmdq.contract import ResponseFormat
    from lmdq.worker.engines.base import EngineRequest

    rf = ResponseFormat(type="json_schema", json_schema={"name": "p", "schema": {"type": "object"}})
    req = EngineRequest(index=0, prompt="x", params=GenerationParams(response_format=rf))
    tm = _FakePipe(backend="turbomind")
    events = list(_engine(tm).stream([req], threading.Event()))  # type: ignore[attr-defined]
    assert [(e.finish_reason, e.error_code) for e in events] == [("error", "unsupported_feature")]
    assert "--backend pytorch" in (events[0].error_message or "") and tm.calls == 0
    pt = _FakePipe(backend="pytorch")
    events = list(_engine(pt).stream([req], threading.Event()))  # type: ignore[attr-defined]
    assert events[-1].finish_reason == "length" and pt.calls == 1
