"""The production engine: one long-lived ``lmdeploy.pipeline`` driven through ``stream_infer``.

Each job in flight calls :meth:`LMDeployEngine.stream` from its own thread; all calls share the
pipeline's ``max_batch_size`` slots, so while one job's last sequences decode the next job's
prefills already run (measured on an H200: 8-32 concurrent stream_infer callers fill the engine
as well as one big call). Abort goes through LMDeploy sessions: breaking out of a stream_infer
loop would NOT cancel its requests.

Engine death (issue 13). LMDeploy reports a dead engine as a per-request error: when the engine process
(``enable_mp_engine``) is killed, every request in flight and every later one ends with
``finish_reason='error'``, ``error_code='internal_error'`` (a ``RequestError`` wrapping the ZMQ client's
``RPCServerDeadError``), and the pipeline looks usable. Failing those requests would drain a whole queue
into failures, so an engine-level error is checked against the engine before it is handed up: a dead
engine process, LMDeploy's RPC marked dead, the backend's own health check, or every request in flight
failing at once (engine_health.py) → ``stream`` raises ``EngineDead`` and ``alive()`` is False from then on.
The engine's processes are guarded against outliving the worker (orphan_guard.py).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import structlog

from lmdq.contract import Endpoint, ErrorCode, FinishReason, GenerationParams
from lmdq.guided import to_lmdeploy
from lmdq.worker.engine_config import LMDeployConfig
from lmdq.worker.engines import orphan_guard
from lmdq.worker.engines.base import EngineDead, EngineError, EngineEvent, EngineRequest, error_code
from lmdq.worker.engines.engine_health import EngineHealth
from lmdq.worker.engines.registry import BenchEntry, EngineSpec, EngineTarget, model_folder_name
from lmdq.worker.engines.request_errors import BadRequest
from lmdq.worker.engines.scoring import LOGIT_BUDGET, continuation_score, reward_text

__all__ = [
    "SPEC",
    "LMDeployEngine",
    "build_backend_config",
    "build_gen_config",
    "build_pipeline",
    "embedding_unsupported",
    "resolve_chat_template",
]

log = logging.getLogger("lmdq.lmdeploy")
#: lifecycle events (engine death) go to the worker's structured log
slog = structlog.get_logger("lmdq.lmdeploy")

#: LMDeploy error codes that can mean "the engine is gone" rather than "this request is wrong"
#: (serve/core/exceptions.py ErrorCode: INTERNAL_ERROR, ENGINE_UNAVAILABLE); checked, never assumed.
ENGINE_LEVEL_ERRORS = frozenset({ErrorCode.internal_error, ErrorCode.engine_unavailable})
#: the architectures ``pipe.get_reward_score`` serves (lmdeploy/pipeline.py, supported_reward_models)
REWARD_ARCHS = ("InternLM2ForRewardModel", "Qwen2ForRewardModel")
#: how long the backend's health check may take before it counts as no answer (not as dead)
HEALTH_PROBE_TIMEOUT_S = 5.0
#: one health check answers for every engine-level error within this window (an error wave, one probe)
HEALTH_PROBE_REUSE_S = 2.0
#: how long held engine-level errors wait for the verdict (trip or a request finishing well) at the end of
#: a stream call, before they are handed up as the requests' own errors
BURST_SETTLE_S = 30.0
#: how long ``close()`` waits for LMDeploy's own shutdown of a DEAD engine (its RPC/ZMQ teardown talks to a
#: process that is gone and is not known to be bounded); the worker must still exit and be restarted
DEAD_CLOSE_TIMEOUT_S = 15.0


def build_backend_config(config: LMDeployConfig, adapters: dict[str, str] | None = None) -> Any:
    """The worker's LMDeploy settings → LMDeploy's engine config (the real classes).

    'auto' returns a TurbomindEngineConfig, which LMDeploy itself falls back from to PyTorch
    when TurboMind can't serve the model; 'pytorch' pins the PyTorch engine. Values were checked
    when ``config`` was built (LMDeployConfig declares their types, bounds and defaults).
    """
    import dataclasses

    from lmdeploy import PytorchEngineConfig, TurbomindEngineConfig

    def same_named(cls: type) -> dict[str, Any]:
        """The settings LMDeploy's config class takes under the same name (tp, dtype, session_len, ...).
        Unset (None) = LMDeploy's own default, left to LMDeploy: TurbomindEngineConfig refuses an explicit
        max_batch_size=None although None is its default (lmdeploy 0.18)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return {k: v for k, v in config.model_dump().items() if k in names and v is not None}

    tp = config.tp
    if config.runs_pytorch(bool(adapters)):
        lora: dict[str, Any] = {"adapters": dict(adapters)} if adapters else {}
        # tp > 1 on one host: multiprocessing executor (LMDeploy's default for tp > 1 wants ray).
        extra: dict[str, Any] = {"distributed_executor_backend": "mp"} if tp > 1 else {}
        # logprobs_mode: without it the PyTorch engine returns no logprobs at all (found on the GPU); it costs
        # nothing for requests that don't ask (the engine computes them only when a request in the step does).
        # enable_mp_engine: the engine's scheduler runs in its own process (what LMDeploy's own api_server
        # always does), so it never waits for the GIL behind the worker's threads and their per-token work.
        return PytorchEngineConfig(**same_named(PytorchEngineConfig), logprobs_mode="raw_logprobs",
                                   enable_mp_engine=config.mp_engine, **extra, **lora)
    return TurbomindEngineConfig(**same_named(TurbomindEngineConfig))


def build_gen_config(p: dict[str, Any]) -> Any:
    """lmdq's resolved params (``GenerationParams.resolved()``) → LMDeploy ``GenerationConfig``.

    Field for field by name (GenerationParams mirrors GenerationConfig, and is the one declaration of
    the parameters); ``response_format`` is translated to LMDeploy's spelling."""
    import dataclasses

    from lmdeploy import GenerationConfig

    known = {f.name for f in dataclasses.fields(GenerationConfig)}
    unknown = sorted(set(p) - known)
    if unknown:  # a parameter LMDeploy does not have must fail loudly, never be dropped
        raise EngineError(f"LMDeploy's GenerationConfig has no {', '.join(unknown)}")
    p = dict(p)
    if (p.pop("n", None) or 1) != 1:  # LMDeploy ignores n > 1: the worker fans a request out (worker/samples.py)
        raise EngineError("an engine request has n > 1: the worker sends one request per sample")
    return GenerationConfig(n=1, **{**p, "response_format": to_lmdeploy(p.get("response_format"))})


def _logprob_rows(token_ids: list[int], rows: list[dict[int, float]], k: int) -> list[tuple[int, float, list[Any]]]:
    """LMDeploy's per-token ``{token_id: logprob}`` dicts (top-k plus the chosen token) → lmdq's
    (chosen id, chosen logprob, top-k sorted by logprob) rows; ``token_ids`` are the generated ids."""
    out: list[tuple[int, float, list[Any]]] = []
    for tok, row in zip(token_ids, rows):
        top = sorted(((int(t), float(v)) for t, v in row.items()), key=lambda kv: -kv[1])[:k]
        out.append((int(tok), float(row.get(tok, float("nan"))), top))
    return out


def _prefilled(out: Any) -> int | None:
    """Prompt tokens a finished request really prefilled: its input minus LMDeploy's ``cached_tokens``
    (prefix-cache hits, e.g. the later samples of an n-sample request); None when the Response has no
    such count (then the worker counts the whole prompt)."""
    cached = getattr(out, "cached_tokens", None)
    if not isinstance(cached, int) or isinstance(cached, bool) or not out.input_token_len:
        return None
    return max(0, int(out.input_token_len) - cached)


def _plus(a: int | None, b: int | None) -> int | None:
    return None if a is None else a + (b or 0)


def _unsupported(backend_config: Any, p: dict[str, Any]) -> str | None:
    """Rich outputs this worker's engine would silently drop or refuse, checked per request up front so the
    request fails clearly (lmdq can't know the worker's backend at submit time).

    LMDeploy 0.18's PyTorch engine logs a warning and returns nothing for ``output_last_hidden_state``,
    and returns logits only for ``output_logits='all'`` with ``max_new_tokens=0`` (lmdeploy/pytorch/
    messages.py); TurboMind returns both. Either backend refuses 'all' when prefix caching is on."""
    pytorch = type(backend_config).__name__.startswith("Pytorch")
    if not pytorch and p.get("response_format"):
        # lmdeploy 0.18's TurboMind sets the grammar on the model instance (``set_grammar``), not per request:
        # on the H200 100 concurrent json_schema requests all stalled at '{"name":' and ran to max_new_tokens.
        return ("response_format (guided decoding) is not reliable on LMDeploy 0.18's TurboMind (its grammar is "
                "per model instance, not per request: concurrent requests stall); serve this batch with "
                "--backend pytorch")
    if pytorch and p.get("output_last_hidden_state"):
        return ("output_last_hidden_state is not supported by LMDeploy 0.18's PyTorch engine (it drops it with a "
                "warning); serve this batch with --backend turbomind or --engine transformers")
    if pytorch and p.get("output_logits"):
        return ("output_logits is not supported by LMDeploy 0.18's PyTorch engine during generation (only 'all' with "
                "max_new_tokens=0); ask for logprobs (top-k per token) or serve with --backend turbomind or "
                "--engine transformers")
    if getattr(backend_config, "enable_prefix_caching", False) and "all" in (
        p.get("output_logits"), p.get("output_last_hidden_state")
    ):
        return ("output_logits/output_last_hidden_state 'all' is not supported when prefix caching is on "
                "(this worker's engine has enable_prefix_caching); ask for 'generation' instead")
    return None


def resolve_chat_template(chat_template: str | None) -> Any:
    """``--chat-template``: an LMDeploy template name, or a path to a JSON ChatTemplateConfig."""
    if not chat_template:
        return None
    from lmdeploy import ChatTemplateConfig

    path = Path(chat_template)
    if path.suffix == ".json" and path.is_file():
        return ChatTemplateConfig.from_json(str(path))
    return ChatTemplateConfig(model_name=chat_template)


# Models served in float16 when --dtype is auto: SmolLM2-135M-Instruct. Its answer to "What is the capital
# of France?" hangs on a 0.098-logit margin at the first token, below bf16's step (0.125) at that logit, so
# bf16 rounding (LMDeploy's) flips it; fp16 is ~10x more accurate and its activations fit fp16's range.
# Not an LMDeploy bug: transformers-bf16 leaves fp32's greedy path on 7 of 24 prompts too (docs/gpu-validation.md).
_BF16_AFFECTED = [
    {"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
     "num_hidden_layers": 30, "tie_word_embeddings": True},
]


def _local_config(model_path: str) -> dict[str, Any]:
    """A local model folder's config.json, or {} (a hub id resolves only after LMDeploy downloads it;
    an unreadable file is LMDeploy's to report)."""
    import json

    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def resolve_dtype(model_path: str, dtype: str) -> tuple[str, str | None]:
    """``--dtype auto`` → float16 for shapes known to go wrong in bf16; returns (dtype, warning)."""
    if dtype not in ("auto", "bfloat16"):
        return dtype, None
    cfg = _local_config(model_path)
    if not cfg or not any(all(cfg.get(k) == v for k, v in shape.items()) for shape in _BF16_AFFECTED):
        return dtype, None
    if dtype == "auto":
        return "float16", ("SmolLM2-135M-shaped model: bf16 rounding flips near-tie greedy answers here (e.g. the "
                           "first token of 'What is the capital of France?'); --dtype auto resolved to float16 "
                           "(see docs/gpu-validation.md)")
    return dtype, ("--dtype bfloat16 on a SmolLM2-135M-shaped model: bf16 rounding flips near-tie greedy answers "
                   "here; --dtype float16 is ~10x more accurate for it (see docs/gpu-validation.md)")


def _check_tp(tp: int, model_path: str = "") -> None:
    """Fail early and clearly when tp exceeds the GPUs this process can see, or does not divide the
    model's attention heads (LMDeploy asserts it, with no message)."""
    if tp <= 1:
        return
    cfg = _local_config(model_path) if model_path else {}
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if isinstance(heads, int) and heads % tp:
        raise EngineError(f"--tp {tp} must divide the model's num_attention_heads ({heads}); "
                          f"use a tp that divides {heads}")
    if isinstance(kv, int) and kv >= tp and kv % tp:  # fewer KV heads than tp: LMDeploy replicates them
        raise EngineError(f"--tp {tp} must divide the model's num_key_value_heads ({kv})")
    try:
        import torch

        n = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch/CUDA means zero GPUs
        n = 0
    if tp > n:
        raise EngineError(f"--tp {tp} needs {tp} GPUs but {n} are visible (CUDA_VISIBLE_DEVICES / nvidia.com/gpu)")


def _rpc_dead_in(e: BaseException) -> str | None:
    """LMDeploy's ``RPCServerDeadError`` (mp_engine/zmq_rpc.py: the engine process is gone) anywhere in an
    exception's chain, matched by name: the class lives in a module that needs the PyTorch engine."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if type(cur).__name__ == "RPCServerDeadError":
            return f"LMDeploy engine RPC is dead: {cur}"
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def _exit_description(code: int | None) -> str:
    """multiprocessing's exitcode (negative: the signal that killed it) in words."""
    if isinstance(code, int) and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def build_pipeline(config: LMDeployConfig, model_path: str, log_level: str = "WARNING",
                   adapters: dict[str, str] | None = None) -> tuple[Any, frozenset[int]]:
    """The real ``lmdeploy.pipeline`` for ``config`` (the factory :meth:`LMDeployEngine.load` uses), and
    the process groups LMDeploy started for it (killed at close, whatever is left of them)."""
    from lmdeploy import pipeline

    orphan_guard.install()  # before LMDeploy starts any process: they all die with this one
    groups_before = orphan_guard.tracked_groups()
    pipe = pipeline(
        model_path,
        backend_config=build_backend_config(config, adapters),
        chat_template_config=resolve_chat_template(config.chat_template),
        log_level=log_level,
    )
    pil_image_processor(pipe, model_path)
    return pipe, frozenset(orphan_guard.tracked_groups() - groups_before)


#: LMDeploy's vision models that call their transformers image processor as
#: ``processor(image, input_data_format='channels_last')`` on a PIL image (lmdeploy/vl/model/llava_hf.py, llava_next.py)
CHANNELS_LAST_VISION_MODELS = frozenset({"LlavaHfVisionModel", "LlavaNextVisionModel"})


def pil_image_processor(pipe: Any, model_path: str) -> bool:
    """Give a LLaVA pipeline the PIL image processor instead of the torchvision one.

    Why: transformers 5 picks its torchvision processors whenever torchvision is installed, and those read
    LMDeploy 0.18's ``input_data_format='channels_last'`` on a PIL image as the wrong axis: every image
    request fails ``preprocess_failed`` ("size of tensor a (336) must match the size of tensor b (3)", H200,
    transformers 5.17). The PIL processor (``use_fast=False``) reads the same config the way LMDeploy means
    it. The raw side of ``lmdq-bench e2e`` builds its pipeline here too, so both sides preprocess alike.
    Returns whether the processor was replaced."""
    model: Any = getattr(getattr(getattr(pipe, "async_engine", None), "vl_encoder", None), "model", None)
    if type(model).__name__ not in CHANNELS_LAST_VISION_MODELS or getattr(model, "processor", None) is None:
        return False
    from transformers import AutoImageProcessor

    model.processor = AutoImageProcessor.from_pretrained(model_path, use_fast=False)  # type: ignore[no-untyped-call]
    slog.info("image processor: PIL backend (LMDeploy passes channels_last images)", model=type(model).__name__,
              processor=type(model.processor).__name__)
    return True


#: Image sides (pixels) the warm-up of a vision-language model sends: its processor resizes them, and a
#: dynamic-resolution model (Qwen2-VL, InternVL tiles) meets several vision shapes
WARMUP_IMAGE_SIDES = (224, 336, 448, 640)


def warmup_requests(n: int, session_len: int, *, vision: bool) -> list[EngineRequest]:
    """The ``n`` requests of :meth:`LMDeployEngine.warm_up`: prompts of 8 to 2,048 tokens, chat and raw,
    8 to 36 new tokens; with ``vision`` every fourth is a chat question about a JPEG (a ``data:`` URL, as
    the worker hands images over: worker/images.py).

    Why images: the first image batch of a fresh VLM engine paid what its text warm-up never met -- the
    vision tower's kernels, the image processor and LMDeploy's image-token path -- and ran ~10 % slower
    than the next (H200, session 23: raw 6.72 s then 6.05, 5.86 s for 512 images; the lmdq side likewise).
    The raw side of ``lmdq-bench e2e`` runs this warm-up too, so both sides start warm."""

    lengths = [min(x, max(8, session_len - 64)) for x in (8, 32, 128, 512, 2048)]
    reqs = []
    for i in range(n):
        words = " ".join(f"w{(i * 31 + j) % 997}" for j in range(lengths[i % len(lengths)] // 2))
        params = GenerationParams(max_new_tokens=8 + (i % 8) * 4, ignore_eos=True)
        if vision and i % 4 == 3:
            side = WARMUP_IMAGE_SIDES[(i // 4) % len(WARMUP_IMAGE_SIDES)]
            content = [{"type": "image_url", "image_url": {"url": _warmup_jpeg(side, i)}},
                       {"type": "text", "text": "Describe this picture. " + words[:200]}]
            reqs.append(EngineRequest(index=i, messages=[{"role": "user", "content": content}],
                                      endpoint=Endpoint.chat, params=params))
        elif i % 2:
            reqs.append(EngineRequest(index=i, messages=[{"role": "user", "content": words}],
                                      endpoint=Endpoint.chat, params=params))
        else:
            reqs.append(EngineRequest(index=i, prompt=words, endpoint=Endpoint.completion, params=params))
    return reqs


def _warmup_jpeg(side: int, seed: int) -> str:
    """A ``side`` x ``side`` JPEG of coloured blocks as a ``data:`` URL (PIL: LMDeploy's VL path needs it)."""
    import io

    from PIL import Image

    from lmdq.images.refs import data_url

    img = Image.new("RGB", (side, side), ((seed * 67) % 256, (seed * 131) % 256, (seed * 29) % 256))
    for k in range(4):
        x = (seed * 17 + k * 53) % max(1, side - 32)
        img.paste(((k * 80) % 256, (seed + k * 40) % 256, 200), (x, x, x + 32, x + 32))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=85)
    return data_url(buf.getvalue(), "image/jpeg")


EMBEDDING_UNSUPPORTED = ("LMDeploy 0.18 computes no embeddings (its own server answers /v1/embeddings with "
                         "'Unsupported by turbomind.', and its pipeline has no pooling call): serve the embedding "
                         "model on a transformers worker (lmdq-worker --engine transformers --model DIR)")
"""What an ``embedding`` request sent to an LMDeploy worker is told (docs/outputs.md, "Embeddings")."""


def embedding_unsupported(index: int) -> EngineEvent:
    """The final event of an ``embedding`` request on LMDeploy: ``unsupported_feature``, saying where it runs."""
    return EngineEvent(index=index, finish_reason=FinishReason.error, error_code=ErrorCode.unsupported_feature,
                       error_message=EMBEDDING_UNSUPPORTED)

class AbortWatch:
    """One thread that aborts the sessions of every stream call whose ``abort`` event is set.

    Why one for the engine and not one per call: a call's requests still waiting for a slot have no handle
    yet, so an abort must be re-sent until all of them end, which means polling; a thread per call (64 calls
    in flight: 64 threads waking 5 times a second) takes the GIL from the engine's event loop 320 times a
    second for nothing. The thread starts with the first watched call and ends when none is left."""

    POLL_S = 0.2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[int, tuple[threading.Event, list[Any], set[int]]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, abort: threading.Event, sessions: list[Any], open_: set[int]) -> int:
        """Watch one call: while ``abort`` is set, ``sessions[i].abort()`` for each ``i`` still in ``open_``."""
        with self._lock:
            key = next(self._ids)
            self._calls[key] = (abort, sessions, open_)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="lmdq-abort-watch")
                self._thread.start()
        return key

    def unwatch(self, key: int) -> None:
        with self._lock:
            self._calls.pop(key, None)

    def watching(self) -> int:
        with self._lock:
            return len(self._calls)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._calls:
                    self._thread = None
                    return
                fired = [(sessions, list(open_)) for abort, sessions, open_ in self._calls.values() if abort.is_set()]
            for sessions, open_now in fired:
                for i in open_now:
                    try:
                        sessions[i].abort()
                    except Exception:  # noqa: BLE001 - a session that just finished
                        pass
            time.sleep(self.POLL_S)


class LMDeployEngine:
    """The :class:`~lmdq.worker.engines.base.Engine` contract on one LMDeploy pipeline.

    The pipeline is injected: :meth:`load` builds the real one (:func:`build_pipeline`); tests hand in a
    stand-in with the part of ``lmdeploy.Pipeline`` the engine uses (``stream_infer``, ``session``,
    ``backend_config``, ``close``), through this same constructor."""

    #: result reuse (issue 47): LMDeploy's sampling is not checked to repeat a seeded draw across batch
    #: compositions, so only its greedy requests are reused
    repeats_seeds = False

    name: str = "lmdeploy"
    backend: str
    model_name: str
    capacity: int
    engine_pid: int | None = None

    def __init__(
        self,
        pipe: Any,
        config: LMDeployConfig,
        /,
        *,
        model_name: str,
        groups: frozenset[int] = frozenset(),
        emit_interval_s: float = 0.5,
        adapters: dict[str, str] | None = None,
    ) -> None:
        """``pipe``: an ``lmdeploy.Pipeline`` built for ``config`` (whose ``dtype`` is resolved);
        ``groups``: the process groups it started (killed at close); ``adapters``: the LoRA adapters it
        was built with (``--adapter``), by name: each a model this worker serves, a request's adapter_name."""
        self.adapters: dict[str, str] = dict(adapters or {})
        self.pipe = pipe
        self.config = config
        self.dtype = config.dtype
        self.model_name = model_name
        bc = pipe.backend_config
        self.backend = "pytorch" if type(bc).__name__.startswith("Pytorch") else "turbomind"
        self.capacity = int(getattr(bc, "max_batch_size", None) or 128)
        self.raw = config.raw
        #: a vision-language pipeline (LMDeploy built a VLAsyncEngine: it has an image encoder): image_url parts
        #: go to its VL prompt path as they are (the worker made each a data: URL: worker/images.py). LMDeploy
        #: turns prefix caching off for these models itself (VLAsyncEngine, 0.18)
        self.vision: bool = hasattr(getattr(pipe, "async_engine", None), "vl_encoder")
        #: TurboMind pays per streamed token in this process (see ``streams``); the PyTorch engine's loop runs in
        #: its own process and measured no gain from whole responses (0.886 in-process in session 2; 0.916 with
        #: the mp engine in session 5, against 0.948-1.001 streamed): it streams everything unless told otherwise
        self.stream_from_new_tokens = (config.stream_from_new_tokens if config.stream_from_new_tokens is not None
                                       else 1024 if self.backend == "turbomind" else 0)
        self.emit_interval_s = emit_interval_s
        self._closed = False
        self._hf_lock = threading.RLock()  # the transformers tokenizer reward chats are rendered with
        #: the process groups LMDeploy started for this engine (killed at close, whatever is left of them)
        self._groups = frozenset(groups)
        # engine-death state
        self._dead: str | None = None
        self._health = EngineHealth()
        self._aborts = AbortWatch()
        self._probe_lock = threading.Lock()
        self._probe_at = float("-inf")
        self._probe_reason: str | None = None
        proc = self._engine_process()
        #: the engine process (``enable_mp_engine``), None when the engine runs in this process
        self.engine_pid = proc.pid if proc is not None else None
        if config.occupancy_log_s > 0:
            threading.Thread(target=self._log_occupancy, args=(config.occupancy_log_s,), daemon=True,
                             name="lmdq-occupancy").start()

    def _log_occupancy(self, every_s: float) -> None:
        """``occupancy_log_s``: how many requests are inside the engine, sampled 20 times a second, logged as
        min/mean/max per ``every_s`` while it holds any. LMDeploy hands each request one handle of a pool of
        ``max_batch_size`` for its whole life in the engine (AsyncEngine's RequestHandlePool), so the handles
        out are the requests it has; a raw ``pipe()`` keeps it full, a starved engine shows here first."""
        pool = getattr(getattr(self.pipe, "session_mgr", None), "request_handle_pool", None)
        if pool is None:
            return
        samples: list[int] = []
        next_at = time.monotonic() + every_s
        while not self._closed:
            samples.append(int(pool.num_dispatched))
            if time.monotonic() >= next_at:
                if any(samples):
                    slog.info("engine occupancy", in_engine_min=min(samples), in_engine_max=max(samples),
                              in_engine_mean=round(sum(samples) / len(samples), 1), capacity=self.capacity,
                              samples=len(samples), window_s=every_s, t=round(time.time(), 3))
                samples = []
                next_at = time.monotonic() + every_s
            time.sleep(0.05)

    @classmethod
    def load(
        cls,
        config: LMDeployConfig | None = None,
        /,
        *,
        model_path: str,
        served_model_name: str | None = None,
        log_level: str = "WARNING",
        emit_interval_s: float = 0.5,
        adapters: dict[str, str] | None = None,
        **overrides: Any,
    ) -> LMDeployEngine:
        """The engine on a real pipeline: ``config`` (default: :class:`LMDeployConfig`'s defaults) with
        ``overrides`` over it, by name (``backend="pytorch"``): the settings are declared once, in
        LMDeployConfig."""
        config = LMDeployConfig.from_values(config, **overrides)
        _check_tp(config.tp, model_path)
        dtype, warning = resolve_dtype(model_path, config.dtype)
        if warning:
            log.warning(warning)
        config = config.model_copy(update={"dtype": dtype})
        pipe, groups = build_pipeline(config, model_path, log_level, adapters)
        return cls(pipe, config, model_name=served_model_name or Path(model_path.rstrip("/")).name,
                   groups=groups, emit_interval_s=emit_interval_s, adapters=adapters)

    def count_tokens(self, text: str) -> int:
        return len(self.pipe.async_engine.tokenizer.encode(text, add_bos=False))

    def warm_up(self) -> dict[str, Any]:
        """Run ``warmup_requests`` requests through :meth:`stream` before the worker reports ready.

        Why: a fresh engine's first batch ran at 0.90 of a raw ``pipe()`` on the H200 (issue 27), while
        its second ran at full speed. What a batch meets first, and pays once: Triton kernels compiled
        for the prefill and decode shapes it sees (LMDeploy's PyTorch engine captures CUDA graphs at
        start, but compiles its attention/KV/rotary kernels on first use), the chat template's Jinja
        compile, the detokenizer and the per-request Python paths of this adapter. So the warm-up meets
        what the scheduler will: prompts of 8 to 2,048 tokens (chunked prefill past
        ``max_prefill_token_num``), chat and raw, many requests in one call so decoding steps run at every
        batch size from ``warmup_requests`` down to 1 as they finish at different lengths (8-36 tokens);
        on a vision-language model a quarter of them carry an image too (:func:`warmup_requests`).
        Returns what it cost (logged by the worker, in ``docs/performance.md``)."""
        n = int(self.config.warmup_requests)
        if n <= 0:
            return {"warmup_requests": 0}
        session_len = int(getattr(self.pipe.backend_config, "session_len", None) or 4096)
        reqs = warmup_requests(n, session_len, vision=self.vision)
        t0 = time.monotonic()
        tokens = finished = 0
        for ev in self.stream(reqs, threading.Event()):
            if ev.finish_reason is not None:
                finished += 1
                tokens += ev.generate_token_len
        return {"warmup_requests": n, "warmup_finished": finished, "warmup_tokens": tokens,
                "warmup_s": round(time.monotonic() - t0, 2)}

    @staticmethod
    def _prompt(r: EngineRequest, preprocess: bool) -> Any:
        """What stream_infer gets. It refuses a list mixing strings and message lists, so with
        the chat template on, a plain prompt becomes one user message (what LMDeploy itself does
        with a str prompt)."""
        if r.messages is not None:
            return r.messages
        if preprocess:
            return [{"role": "user", "content": r.prompt}]
        return r.prompt

    # --- engine death ---------------------------------------------------------------------------------

    def _engine_process(self) -> Any:
        """LMDeploy's engine process (``ZMQMPEngine.proc``, a multiprocessing Process), or None."""
        return getattr(getattr(getattr(self.pipe, "async_engine", None), "engine", None), "proc", None)

    def _death_reason(self) -> str | None:
        """Why the engine is gone, from cheap checks (no I/O): its process has exited, or LMDeploy's RPC
        client has marked the engine dead. None when neither says so."""
        if self._dead:
            return self._dead
        engine = getattr(getattr(self.pipe, "async_engine", None), "engine", None)
        proc = getattr(engine, "proc", None)
        if proc is not None:
            try:
                alive = proc.is_alive()
            except ValueError:  # Process.close()d: LMDeploy has shut the engine down
                alive = False
            if not alive:
                how = _exit_description(getattr(proc, "exitcode", None))
                return f"LMDeploy engine process {getattr(proc, 'pid', '?')} died ({how})"
        liveness = getattr(getattr(engine, "rpc_client", None), "_server_liveness", None)
        dead_msg = getattr(liveness, "dead_msg", None)
        if dead_msg:
            # LMDeploy's own waitpid (its loop thread) may have reaped the process a moment ago; its exit
            # status is the more useful reason, and it lands within a moment.
            code = None
            for _ in range(20):
                try:
                    code = getattr(proc, "exitcode", None)
                except ValueError:
                    break
                if code is not None or proc is None:
                    break
                time.sleep(0.05)
            how = f" ({_exit_description(code)})" if code is not None else ""
            return f"LMDeploy engine RPC is dead: {dead_msg}{how}"
        return None

    def _probe_health(self) -> str | None:
        """The backend's own health check (PyTorch: engine loop tasks alive; mp engine: process alive and
        answering over RPC; TurboMind: its engine created). One probe per error wave; no answer within
        ``HEALTH_PROBE_TIMEOUT_S`` is no verdict (a busy engine is not a dead one)."""
        with self._probe_lock:
            if time.monotonic() - self._probe_at < HEALTH_PROBE_REUSE_S:
                return self._probe_reason
            reason = None
            engine = getattr(getattr(self.pipe, "async_engine", None), "engine", None)
            loop = getattr(getattr(self.pipe, "internal_thread", None), "loop", None)
            if engine is not None and loop is not None and hasattr(engine, "get_health_status"):
                fut = None
                try:
                    fut = asyncio.run_coroutine_threadsafe(engine.get_health_status(), loop)
                    status = fut.result(HEALTH_PROBE_TIMEOUT_S)
                    if isinstance(status, dict) and status.get("alive") is False:
                        reason = f"LMDeploy engine unhealthy: {status.get('message')}"
                except concurrent.futures.TimeoutError:
                    if fut is not None:
                        fut.cancel()
                except Exception as e:  # noqa: BLE001 - e.g. RPCServerDeadError: re-checked below
                    slog.warning("engine health check failed", error=repr(e))
            reason = reason or self._death_reason()
            self._probe_at, self._probe_reason = time.monotonic(), reason
            return reason

    def _dead_error(self, reason: str) -> EngineDead:
        """Record the engine as dead (``alive()`` is False from now on) and build the error to raise."""
        if not self._dead:
            self._dead = reason
            slog.error("engine dead", reason=reason, engine_pid=self.engine_pid)
        return EngineDead(self._dead)

    def stream(self, requests: Sequence[EngineRequest], abort: threading.Event) -> Iterator[EngineEvent]:
        if self._dead:
            raise EngineDead(self._dead)
        if self._closed:
            raise EngineError("engine is closed")
        for r in (r for r in requests if r.endpoint is Endpoint.embedding):
            yield embedding_unsupported(r.index)
        requests = [r for r in requests if r.endpoint is not Endpoint.embedding]
        pictured = [r for r in requests if _has_images(r) and (not self.vision or not r.endpoint.generates)]
        for r in pictured:  # what this engine cannot look at: each such request fails alone
            why = ("image parts need a vision-language model" if not self.vision
                   else f"endpoint {r.endpoint.value!r} with image parts: LMDeploy scores text only")
            yield EngineEvent(index=r.index, finish_reason=FinishReason.error, error_code=ErrorCode.unsupported_feature,
                              error_message=f"{self.model_name}: {why}")
        if pictured:
            refused = {id(r) for r in pictured}
            requests = [r for r in requests if id(r) not in refused]
        scoring = [r for r in requests if not r.endpoint.generates]
        for r in (r for r in scoring if r.adapter is not None):  # no adapter_name for scoring
            yield EngineEvent(index=r.index, finish_reason=FinishReason.error, error_code=ErrorCode.unsupported_feature,
                              error_message=f"endpoint {r.endpoint.value!r} with a LoRA adapter ({r.adapter!r}): "
                              "LMDeploy scores with the base model only; score on the base model's name")
        scoring = [r for r in scoring if r.adapter is None]
        if scoring:  # score / reward: no generation (all logits / get_reward_score)
            yield from self._score_group(scoring, abort)
            requests = [r for r in requests if r.endpoint.generates]
        # stream_infer takes one do_preprocess for the whole call: raw and chat prompts go in
        # separate calls (rare in practice: a batch is usually one endpoint).
        # and adapter_name is one per call too: requests of different adapters (or the base) go in separate calls
        chat = [r for r in requests if not (r.raw or self.raw)]
        raw = [r for r in requests if r.raw or self.raw]
        for part, preprocess in ((chat, True), (raw, False)):
            for adapter in dict.fromkeys(r.adapter for r in part):
                group = [r for r in part if r.adapter == adapter]
                if group:
                    yield from self._stream_group(group, abort, preprocess, adapter)

    def _score_ids(self, r: EngineRequest) -> tuple[list[int], list[list[int]]]:
        """A score request's prompt ids as the engine would tokenize them (``messages``: LMDeploy's chat
        template, its generation prompt included; ``prompt``: raw, with BOS) and each continuation's ids
        tokenized alone without BOS (:mod:`worker.engines.scoring`)."""
        tok = self.pipe.async_engine.tokenizer
        if r.messages is not None and not self.raw:
            text = self.pipe.async_engine.chat_template.messages2prompt(r.messages)
        elif r.messages is not None:
            raise BadRequest("messages need the chat template (do not combine with --raw)")
        else:
            text = r.prompt or ""
        prompt_ids = [int(t) for t in tok.encode(text, add_bos=True)]
        conts = [[int(t) for t in tok.encode(c, add_bos=False, add_special_tokens=False)]
                 for c in r.continuations or ()]
        if not prompt_ids:
            raise BadRequest("the prompt encodes to zero tokens")
        for i, c in enumerate(conts):
            if not c:
                raise BadRequest(f"continuations[{i}] encodes to zero tokens")
        return prompt_ids, conts

    def _reward_ids(self, r: EngineRequest) -> list[int]:
        """The chat as the reward model reads it: the HF template without a generation prompt, with
        special tokens (the transformers engine renders it identically)."""
        # lmdeploy.Tokenizer -> HuggingFaceTokenizer -> the transformers tokenizer it loaded from the model folder
        hf = getattr(getattr(self.pipe.async_engine.tokenizer, "model", None), "model", None)
        if hf is None or not hasattr(hf, "apply_chat_template"):
            raise BadRequest("this engine's tokenizer is not a transformers tokenizer: reward chats cannot be rendered")
        lock = self._hf_lock
        text = reward_text(hf, lock, r.messages or [], getattr(hf, "chat_template", None))
        with lock:
            ids = [int(t) for t in hf.encode(text, add_special_tokens=True)]
        if not ids:
            raise BadRequest("the chat encodes to zero tokens")
        return ids

    def _score_group(self, group: list[EngineRequest], abort: threading.Event) -> Iterator[EngineEvent]:
        """``score`` from every position's logits of prompt + continuation (one forward each, no
        sampling): sum logprob, token count and ``is_greedy`` in float32 (:meth:`_score_call`).
        ``reward`` through ``pipe.get_reward_score``. One engine call for the whole
        group; if it fails, each request again alone, so only the requests at fault fail. Abort is checked
        before the call (a scoring forward cannot be cancelled, and it takes one forward)."""
        if getattr(self.pipe.backend_config, "enable_prefix_caching", False) and any(
                r.endpoint is Endpoint.score for r in group):
            for r in [r for r in group if r.endpoint is Endpoint.score]:
                yield EngineEvent(index=r.index, finish_reason=FinishReason.error,
                                  error_code=ErrorCode.unsupported_feature,
                                  error_message="endpoint 'score' reads every position's logits (output_logits='all'), "
                                  "which LMDeploy refuses with prefix caching on: serve score batches on a worker "
                                  "without enable_prefix_caching")
            group = [r for r in group if r.endpoint is not Endpoint.score]
        arch = getattr(self.pipe.async_engine, "arch", None)
        if arch not in REWARD_ARCHS and any(r.endpoint is Endpoint.reward for r in group):
            for r in [r for r in group if r.endpoint is Endpoint.reward]:
                yield EngineEvent(index=r.index, finish_reason=FinishReason.error,
                                  error_code=ErrorCode.unsupported_feature,
                                  error_message=f"endpoint 'reward' needs a reward model LMDeploy serves "
                                  f"({', '.join(REWARD_ARCHS)}); this worker's model is {arch}")
            group = [r for r in group if r.endpoint is not Endpoint.reward]
        prepared: list[tuple[EngineRequest, Any]] = []
        for r in group:
            if abort.is_set():
                yield EngineEvent(index=r.index, finish_reason=FinishReason.abort)
                continue
            try:
                prepared.append((r, self._reward_ids(r) if r.endpoint is Endpoint.reward else self._score_ids(r)))
            except BadRequest as e:
                yield EngineEvent(index=r.index, finish_reason=FinishReason.error, error_code=ErrorCode.bad_request,
                                  error_message=str(e))
            except Exception as e:  # noqa: BLE001 - a template or tokenizer failure is this request's
                yield EngineEvent(index=r.index, finish_reason=FinishReason.error, error_code=ErrorCode.bad_request,
                                  error_message=f"{type(e).__name__}: {e}")
        if not prepared:
            return
        try:
            yield from self._score_call(prepared)
            return
        except EngineDead:
            raise
        except Exception as e:  # noqa: BLE001 - which request was it? ask again one by one
            if len(prepared) == 1:
                r = prepared[0][0]
                reason = self._death_reason()
                if reason:
                    raise self._dead_error(reason) from e
                yield EngineEvent(index=r.index, finish_reason=FinishReason.error, error_code=ErrorCode.internal_error,
                                  error_message=f"{type(e).__name__}: {e}")
                return
        for one in prepared:
            yield from self._score_group_one(one)

    def _score_group_one(self, one: tuple[EngineRequest, Any]) -> Iterator[EngineEvent]:
        try:
            yield from self._score_call([one])
        except EngineDead:
            raise
        except Exception as e:  # noqa: BLE001
            reason = self._death_reason()
            if reason:
                raise self._dead_error(reason) from e
            yield EngineEvent(index=one[0].index, finish_reason=FinishReason.error, error_code=ErrorCode.internal_error,
                              error_message=f"{type(e).__name__}: {e}")

    def _all_logits(self, seqs: list[list[int]]) -> list[Any]:
        """Every position's logits of each sequence, from ONE prefill per sequence and no sampling:
        LMDeploy's own ``AsyncEngine.async_get_logits`` (GenerationConfig(max_new_tokens=0 on PyTorch,
        output_logits='all')), run on the pipeline's event loop exactly as ``Pipeline.get_reward_score``
        runs it (lmdeploy/pipeline.py). Cut into calls of at most LOGIT_BUDGET logits (a long prompt times
        a big vocabulary is hundreds of MB per sequence; a sequence over it goes alone)."""
        vocab = int(getattr(getattr(self.pipe.async_engine, "hf_cfg", None), "vocab_size", 0) or 0) or 1
        out: list[Any] = []
        start = 0
        while start < len(seqs):
            end, used = start, 0
            while end < len(seqs) and (end == start or used + len(seqs[end]) * vocab <= 4 * LOGIT_BUDGET):
                used += len(seqs[end]) * vocab
                end += 1
            got = self.pipe._run(coro=self.pipe.async_engine.async_get_logits(input_ids=seqs[start:end])).result()
            out.extend(got)
            start = end
        return out

    def _score_call(self, prepared: list[tuple[EngineRequest, Any]]) -> Iterator[EngineEvent]:
        """One forward per (prompt + continuation), the continuation's positions only turned into float32
        log-probabilities (sum, count, is_greedy: :mod:`worker.engines.scoring`), one get_reward_score call
        for every chat. (Session 9: ``get_ppl``'s difference of two totals — prompt alone vs prompt +
        continuation, two forwards — carried every prompt position's fp16 noise into the difference.)"""
        seqs: list[list[int]] = []
        for r, ids in prepared:
            if r.endpoint is Endpoint.score:
                prompt_ids, conts = ids
                seqs.extend(prompt_ids + c for c in conts)
        chats = [ids for r, ids in prepared if r.endpoint is Endpoint.reward]
        logits = self._all_logits(seqs) if seqs else []
        rewards = [float(x) for x in self.pipe.get_reward_score(chats)] if chats else []
        if len(logits) != len(seqs) or len(rewards) != len(chats):
            raise EngineError(f"LMDeploy answered {len(logits)} of {len(seqs)} logit rows and {len(rewards)} of "
                              f"{len(chats)} reward scores")
        k = j = 0
        for r, ids in prepared:
            if r.endpoint is Endpoint.reward:
                yield EngineEvent(index=r.index, input_token_len=len(ids), finish_reason=FinishReason.stop,
                                  reward=rewards[j],
                                  whole=True)
                j += 1
                continue
            prompt_ids, conts = ids
            scores: list[tuple[float, int, bool | None]] = []
            for c in conts:
                scores.append(continuation_score(logits[k], len(prompt_ids), c))
                k += 1
            yield EngineEvent(index=r.index, input_token_len=len(prompt_ids), finish_reason=FinishReason.stop,
                              scores=scores,
                              whole=True)

    def _stream_group(
        self, group: list[EngineRequest], abort: threading.Event, preprocess: bool, adapter: str | None = None
    ) -> Iterator[EngineEvent]:
        if any(r.messages is not None for r in group) and not preprocess:
            raise EngineError("messages need the chat template (do not combine with --raw)")
        kept, params = [], []
        for r in group:
            p = r.params.resolved()
            conflict = _unsupported(self.pipe.backend_config, p)
            if conflict:
                yield EngineEvent(index=r.index, finish_reason=FinishReason.error,
                                  error_code=ErrorCode.unsupported_feature, error_message=conflict)
            else:
                kept.append(r)
                params.append(p)
        group = kept
        if not group:
            return
        prompts = [self._prompt(r, preprocess) for r in group]
        gens = [build_gen_config(p) for p in params]
        streamed = self.streams(params)
        sessions = [self.pipe.session() for _ in group]
        open_ = set(range(len(group)))
        burst = self._health
        held: list[tuple[int, EngineEvent]] = []  # engine-level errors waiting for the verdict
        watched = self._aborts.watch(abort, sessions, open_)
        burst.begin(len(group))
        try:
            # LMDeploy yields one chunk per token per request. Handing each one up costs GIL time
            # the engine's own loop needs, so deltas are coalesced here: an event goes up for the
            # first token (time to first token), then at most every ``emit_interval_s``, and at the end.
            pending: dict[int, list[str]] = {}
            # Rich outputs (final event only). Per chunk, Response.token_ids and .logprobs are DELTAS
            # (async_engine.generate slices both per chunk), so they are accumulated; .logits and
            # .last_hidden_state are cumulative views (TurboMind: rows[:step - offset - 1]; PyTorch: on the
            # finishing chunk), and the terminal chunk carries None: the latest non-None one is kept.
            want_lp = [p["logprobs"] for p in params]
            want_t = [bool(p["output_logits"] or p["output_last_hidden_state"]) for p in params]
            primed = self._prime_shared(prompts, params, preprocess)
            gen_ids: dict[int, list[int]] = {}
            lp_rows: dict[int, list[dict[int, float]]] = {}
            tensors: dict[int, dict[str, Any]] = {}
            last_emit: dict[int, float] = {}
            interval = self.emit_interval_s
            lora = {"adapter_name": adapter} if adapter is not None else {}
            for out in self.pipe.stream_infer(prompts, sessions=sessions, gen_config=gens,
                                              do_preprocess=preprocess, stream_response=streamed, **lora):
                if held:  # errors whose streak is over: the requests' own, unless the engine died
                    if burst.tripped:
                        raise self._dead_error("every request in flight failed with an engine-level error")
                    ready = [ev for ep, ev in held if burst.settled(ep)]
                    held = [(ep, ev) for ep, ev in held if not burst.settled(ep)]
                    yield from ready
                i = out.index
                if out.text:
                    pending.setdefault(i, []).append(out.text)
                if want_lp[i] is not None and out.logprobs:
                    gen_ids.setdefault(i, []).extend(out.token_ids or [])
                    lp_rows.setdefault(i, []).extend(out.logprobs)
                if want_t[i]:  # (this loop runs once per token per request: skip what no one asked for)
                    for key in ("logits", "last_hidden_state"):
                        value = getattr(out, key, None)
                        if value is not None:
                            tensors.setdefault(i, {})[key] = value
                if out.finish_reason is None:
                    if not out.generate_token_len or not streamed:
                        continue
                    now = time.monotonic()
                    if i in last_emit and now - last_emit[i] < interval:
                        continue
                    last_emit[i] = now
                else:
                    open_.discard(i)
                    code = error_code(getattr(out, "error_code", None))
                    if out.finish_reason == FinishReason.error and code in ENGINE_LEVEL_ERRORS:
                        reason = self._death_reason() or self._probe_health()
                        if reason:
                            raise self._dead_error(reason)
                        epoch = burst.end_engine_error()
                        if burst.tripped:
                            raise self._dead_error("every request in flight failed with an engine-level error")
                        held.append((epoch, EngineEvent(
                            index=group[i].index, text="".join(pending.pop(i, ())),
                            input_token_len=out.input_token_len or 0, generate_token_len=out.generate_token_len or 0,
                            finish_reason=FinishReason.error, error_code=error_code(out.error_code),
                            error_message=getattr(out, "error_message", None))))
                        continue
                    if out.finish_reason in ("stop", "length"):
                        burst.end_ok()
                    else:
                        burst.end_neutral()
                final = out.finish_reason is not None
                rich_lp = (_logprob_rows(gen_ids.pop(i, []), lp_rows.pop(i, []), int(want_lp[i]))
                           if final and want_lp[i] is not None and out.finish_reason != "error" else None)
                rich_t = {k: v.float().cpu() if hasattr(v, "float") else v for k, v in tensors.pop(i, {}).items()
                          } if final and out.finish_reason != "error" else None
                yield EngineEvent(index=group[i].index, text="".join(pending.pop(i, ())),
                                  input_token_len=out.input_token_len or 0,
                                  generate_token_len=out.generate_token_len or 0,
                                  finish_reason=FinishReason(out.finish_reason) if final else None,
                                  error_code=error_code(getattr(out, "error_code", None)),
                                  error_message=getattr(out, "error_message", None),
                                  logprobs=rich_lp, tensors=rich_t or None, whole=not streamed,
                                  prefill_token_len=_plus(_prefilled(out), primed.get(i)) if final else None)
            for epoch, ev in held:  # the call is over: wait for the verdict on its held errors
                if burst.wait_verdict(epoch, BURST_SETTLE_S):
                    raise self._dead_error("every request in flight failed with an engine-level error")
                yield ev
        except EngineDead:
            raise
        except Exception as e:
            reason = self._death_reason() or _rpc_dead_in(e)
            if reason:
                raise self._dead_error(reason) from e
            raise EngineError(f"stream_infer failed: {e!r}") from e
        finally:
            burst.end_neutral(len(open_))
            self._aborts.unwatch(watched)
            # A session still in flight closes through an abort sent to the engine, which waits for an answer:
            # from a dead engine none comes (an in-process engine's loop may never answer), so skip it then.
            # A finished one was removed by LMDeploy's generate() itself: closing it too would be one more
            # blocking round trip to the engine's event loop per request (8,192 a batch of SmolLM2 chat).
            for i in sorted(open_) if not self._dead else ():
                try:
                    sessions[i].close()
                except Exception:  # noqa: BLE001
                    pass

    def _prime_shared(self, prompts: list[Any], params: list[dict[str, Any]], preprocess: bool) -> dict[int, int]:
        """Prefill each prompt that occurs more than once in this call (the n samples of a request, repeated
        lines) ONCE, before the call, so the prefix cache holds its blocks when the copies are scheduled.

        Why not just send the copies side by side: LMDeploy's PyTorch scheduler enters a sequence's blocks
        in its prefix trie only once it runs (``BlockTrie.allocate`` in the decode schedule, lmdeploy 0.18
        pytorch/paging/scheduler.py), so copies prefilled in the same step share nothing. The priming
        request decodes 2 tokens (one decode schedule) and is dropped; its prefilled tokens are added to
        the first copy's count. Only with ``enable_prefix_caching`` (else nothing could be reused): returns
        {position in ``prompts``: tokens the priming prefilled}."""
        if not getattr(self.pipe.backend_config, "enable_prefix_caching", False):
            return {}
        import json

        first: dict[str, int] = {}
        dup: list[int] = []
        for i, prompt in enumerate(prompts):
            key = json.dumps(prompt, sort_keys=True)
            if key in first:
                if first[key] not in dup:
                    dup.append(first[key])
            else:
                first[key] = i
        if not dup:
            return {}
        gens = [build_gen_config({**params[i], "max_new_tokens": 2, "min_new_tokens": None, "logprobs": None,
                                  "output_logits": None, "output_last_hidden_state": None, "response_format": None,
                                  "stop_words": None, "ignore_eos": True}) for i in dup]
        primed: dict[int, int] = {}
        for out in self.pipe.stream_infer([prompts[i] for i in dup], gen_config=gens, do_preprocess=preprocess,
                                          stream_response=False):
            if out.finish_reason is not None:
                got = _prefilled(out)
                primed[dup[out.index]] = got if got is not None else int(out.input_token_len or 0)
        return primed

    def streams(self, params: Sequence[dict[str, Any]]) -> bool:
        """Whether one stream_infer call streams per token (``stream_response``), decided per call.

        Streaming is what lets a long answer reach the results store while it is generated (partials, the
        first-token time), but LMDeploy pays for it per token per request in this process: TurboMind's
        engine thread takes the GIL to signal every step of every request (``async_signal_cb``), and each
        chunk is detokenized incrementally and queued. With 1,024 requests in flight that is ~70k GIL
        round trips a second, and on the H200 lmdq ran TurboMind at 0.60x a raw ``pipe()`` call, which
        does not stream. So a call streams only if one of its requests may be long: ``max_new_tokens`` of at
        least ``stream_from_new_tokens`` (or unset). Shorter requests come back whole, which a reader of
        the results cannot tell apart except by the missing partials and first-token time."""
        floor = self.stream_from_new_tokens
        return any(p.get("max_new_tokens") is None or p["max_new_tokens"] >= floor for p in params)

    def infer_all(self, requests: Sequence[EngineRequest]) -> list[Any]:
        """One plain ``pipe(prompts)`` call: the raw-pipeline baseline benchmarks compare against."""
        raw = all(r.raw or self.raw for r in requests)
        return list(self.pipe([self._prompt(r, not raw) for r in requests],
                              gen_config=[build_gen_config(r.params.resolved()) for r in requests],
                              do_preprocess=not raw))

    def alive(self) -> bool:
        """False once closed or dead: the engine process has exited, LMDeploy's RPC to it is dead, or
        ``stream`` found the engine dead. Cheap (a ``waitpid(WNOHANG)`` and attribute reads): the worker
        asks before every claim."""
        if self._closed or self._dead:
            return False
        reason = self._death_reason()
        if reason:
            self._dead_error(reason)
            return False
        return True

    def _close_dead(self) -> None:
        """LMDeploy's shutdown, bounded. Its ZMQ client still holds sockets to the dead process: with the
        default linger, terminating their context waits forever for messages no one will take, so linger
        goes to 0 first (on the pipeline's loop thread, which owns the async socket). Should the shutdown
        still not return, LMDeploy's own atexit hooks for it are dropped: they would block the exit."""
        engine = getattr(getattr(self.pipe, "async_engine", None), "engine", None)
        rpc = getattr(engine, "rpc_client", None)
        internal: Any = getattr(self.pipe, "internal_thread", None)

        def no_linger() -> None:
            for name in ("async_socket", "sync_socket"):
                try:
                    getattr(rpc, name).linger = 0
                except Exception:  # noqa: BLE001 - already closed, or not a zmq socket
                    pass

        if rpc is not None and getattr(internal, "loop", None) is not None:
            try:
                internal.loop.call_soon_threadsafe(no_linger)
            except RuntimeError:  # the loop is closed
                pass
        t = threading.Thread(target=self.pipe.close, daemon=True, name="lmdq-engine-close")
        t.start()
        t.join(DEAD_CLOSE_TIMEOUT_S)
        if t.is_alive():
            slog.warning("LMDeploy's shutdown of the dead engine did not return; going on",
                         timeout_s=DEAD_CLOSE_TIMEOUT_S)
            for hook in (getattr(engine, "close", None), getattr(internal, "close", None)):
                if hook is not None:
                    atexit.unregister(hook)

    def close(self) -> None:
        """Close the pipeline, then SIGKILL whatever is left in the engine's process groups (a compile
        worker, a tp worker that missed the shutdown): the GPU memory is free when this returns."""
        if not self._closed:
            self._closed = True
            try:
                if self._dead:
                    self._close_dead()
                else:
                    self.pipe.close()
            finally:
                orphan_guard.kill_groups(self._groups)


def _has_images(r: EngineRequest) -> bool:
    return any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") == "image_url"
                                                          for p in m["content"]) for m in r.messages or [])


def _build(config: LMDeployConfig, target: EngineTarget) -> LMDeployEngine:
    if target.model is None:
        raise ValueError("--engine lmdeploy needs --model (a model folder or hub id)")
    return LMDeployEngine.load(config, model_path=target.model, served_model_name=target.served_model_name,
                               adapters=dict(target.adapters))


SPEC = EngineSpec(
    name="lmdeploy", settings=LMDeployConfig, factory=_build, engine=LMDeployEngine,
    served_name=model_folder_name, bench=BenchEntry(needs_model=True),
    summary="LMDeploy's pipeline: TurboMind or PyTorch backend (GPU)",
)
