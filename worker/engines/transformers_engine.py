"""CPU-capable reference engine on plain transformers, with LMDeploy's request semantics.

This engine exists so lmdq runs (and is tested) end to end without a GPU or LMDeploy. Requests of a
``stream`` call are decoded together, up to ``max_batch_rows`` (the engine setting) at a time, in one
hand-written padded KV-cache
loop (left padding, attention mask, explicit position ids; a finished row leaves the cache at once):
decoding is memory-bound at batch 1, so one forward over many rows costs far less than as many forwards
over one (numbers in docs/performance.md, CPU section). Every row keeps its own stop ids/words,
min/max tokens, sampling settings and seeded
generator (:mod:`worker.engines.decode_row`), so greedy rows give the same tokens as alone. Requests that
need guided decoding, hidden states or prompt-position logits run alone, one after another, in the
one-at-a-time loop (:meth:`TransformersEngine._generate`). One lock serialises every forward pass
across threads (concurrent ``stream`` calls interleave step by step instead of competing for the same
cores). The hand-written loops give exact, per-step control over stop words, abort and min/max token
limits.

Semantics mirror ``lmdeploy.pipeline`` (v0.18, ``AsyncEngine`` + ``GenerationConfig``):

* chat requests go through the chat template with ``add_generation_prompt=True``; a plain ``prompt``
  on the chat endpoint becomes one user message (LMDeploy's ``do_preprocess=True`` for a str);
  completion requests are tokenized raw.
* a prompt of ``>= session_len`` tokens fails alone with ``context_length_exceeded``; otherwise
  ``max_new_tokens`` is trimmed to fit ``session_len``.
* stop token ids = request ``stop_token_ids`` + tokenizer eos + generation_config eos; the stop token
  is neither emitted nor counted. ``ignore_eos`` bans those ids instead (LMDeploy turns them into bad
  words) and also disables stop words, so generation runs to ``max_new_tokens``.
* ``min_new_tokens`` bans the stop ids, and ignores stop words, until that many tokens exist.
* greedy (``do_sample=False``) is argmax and, like LMDeploy, ignores temperature/top-k/top-p and
  repetition_penalty. Sampling applies repetition penalty, temperature, top-k, top-p, min-p in that
  order with a per-request seeded ``torch.Generator`` (random seed when none is given).

Rich outputs (GenerationConfig ``logprobs`` / ``output_logits`` / ``output_last_hidden_state``) are
collected by :mod:`worker.engines.rich_outputs`; guided decoding (``response_format``, on xgrammar) lives
in :mod:`worker.engines.guided_decoding`. Both modules document their semantics. The token pick is in
:mod:`worker.engines.sampling`, the stop-word and hold-back rules of streamed text in
:mod:`worker.engines.stop_words`; this module keeps the request preparation and the decode loop.

One deliberate difference: LMDeploy stops on the *token ids* whose text contains a stop word, while
this engine stops on the exact string (the stop word is cut from the output). For stop words that are
single tokens, the two agree.
"""

from __future__ import annotations

import gc
import inspect
import logging
import os
import random
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lmdq.contract import ChatMessage, Endpoint, ErrorCode, FinishReason
from lmdq.worker.engine_config import TransformersConfig
from lmdq.worker.engines.base import EngineError, EngineEvent, EngineRequest
from lmdq.worker.engines.decode_row import EVENT_EVERY_TOKENS, DecodeRow, batchable
from lmdq.worker.engines.embedding import EmbeddingLayout, EmbeddingModelError, embed_batch, read_pooling
from lmdq.worker.engines.guided_decoding import GrammarCache, GuidedMatcher
from lmdq.worker.engines.registry import BenchEntry, EngineSpec, EngineTarget
from lmdq.worker.engines.request_errors import BadRequest, error_event
from lmdq.worker.engines.rich_outputs import RichOutputs
from lmdq.worker.engines.sampling import Sampling, next_token
from lmdq.worker.engines.scoring import continuation_ids, reward_text, score_continuations
from lmdq.worker.engines.stop_words import REPLACEMENT_CHAR, find_stop, safe_text_end

__all__ = ["SPEC", "TransformersEngine", "find_stop", "safe_text_end"]

#: The old private name, kept importable (tests use it).
_BadRequest = BadRequest

log = logging.getLogger(__name__)

#: Emit an (empty-delta) progress event at least this often, even while text is held back.
_EVENT_EVERY_TOKENS = EVENT_EVERY_TOKENS


class _BaseByDefault:
    """A peft model whose forward is the BASE model's unless ``adapter_names`` says otherwise.

    Why: peft runs its active adapter (the first loaded) on a call that names none, so any forward
    that does not know about adapters (warm-up, a score) would answer base-model requests with an
    adapter's weights. Forwards run under the engine's model lock, so ``disable_adapter`` (a context
    manager on the shared model) cannot race another forward."""

    def __init__(self, model: Any) -> None:
        self.peft_model = model

    def __call__(self, *args: Any, adapter_names: list[str] | None = None, **kwargs: Any) -> Any:
        if adapter_names is None:
            with self.peft_model.disable_adapter():
                return self.peft_model(*args, **kwargs)
        return self.peft_model(*args, adapter_names=adapter_names, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.peft_model, name)


class TransformersEngine:
    """The :class:`~worker.engines.base.Engine` protocol on transformers (CPU or one GPU)."""

    name: str = "transformers"
    backend: str = "transformers"
    model_name: str
    capacity: int
    #: result reuse (issue 47): each request samples with its own seeded generator, whatever runs beside it
    repeats_seeds = True

    def __init__(
        self,
        config: TransformersConfig | None = None,
        /,
        *,
        model_path: str | Path,
        served_model_name: str | None = None,
        adapters: dict[str, str] | None = None,
        **overrides: Any,
    ) -> None:
        """Load tokenizer and model once. Raises EngineError when the model cannot be served at all.

        ``config`` (default: :class:`TransformersConfig`'s defaults) with ``overrides`` over it, by name
        (``session_len=64``): the settings are declared once, in TransformersConfig."""
        try:
            cfg = TransformersConfig.from_values(config, **overrides)
        except ValueError as exc:
            raise EngineError(str(exc)) from exc
        self.config = cfg
        device, dtype, chat_template, session_len = cfg.device, cfg.dtype, cfg.chat_template, cfg.session_len
        # Workers are offline by design; a missing local file must fail, not trigger a download.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import torch
            from transformers import (
                AutoConfig,
                AutoModel,
                AutoModelForCausalLM,
                AutoModelForSequenceClassification,
                AutoTokenizer,
            )
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise EngineError(f"the transformers engine needs `pip install 'lmdq[cpu]'`: {exc}") from exc
        self._torch = torch

        path = Path(model_path).expanduser()
        self.model_path = path
        self.model_name = served_model_name or (path.stem if path.suffix == ".gguf" else path.name)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise EngineError(f"bad device {device!r}: {exc}") from exc
        self.dtype = self._resolve_dtype(dtype)

        load_kw: dict[str, Any] = {"local_files_only": True}
        source = str(path)
        if path.is_file() and path.suffix == ".gguf":
            source, load_kw["gguf_file"] = str(path.parent), path.name
        try:
            # A sentence-transformers folder (modules.json with a Pooling module) is an embedding model: it serves
            # only endpoint 'embedding', pooled as its config says (docs/outputs.md, "Embeddings").
            self.embedding: EmbeddingLayout | None = None if "gguf_file" in load_kw else read_pooling(path)
        except EmbeddingModelError as exc:
            raise EngineError(f"could not load embedding model from {path}: {exc}") from exc
        if self.embedding is not None:
            if adapters:
                raise EngineError(f"{path} is an embedding model: LoRA adapters (--adapter) are not supported on it")
            source = str(self.embedding.encoder_dir)
        try:
            self._tokenizer: Any = AutoTokenizer.from_pretrained(source, **load_kw)
            # A checkpoint whose architecture is a sequence-classification head with ONE label is a reward
            # model: it serves only endpoint 'reward' (docs/outputs.md, "Scores"); anything else is a causal LM.
            hf_cfg = None if "gguf_file" in load_kw else AutoConfig.from_pretrained(source, **load_kw)
            archs = list(getattr(hf_cfg, "architectures", None) or [])
            self.reward_model: bool = any(a.endswith("ForSequenceClassification") for a in archs)
            if self.reward_model and getattr(hf_cfg, "num_labels", 1) != 1:
                raise EngineError(f"{path} is a sequence classifier with {hf_cfg.num_labels} labels; a reward "
                                  "model has exactly one (num_labels=1)")
            auto: Any = AutoModelForSequenceClassification if self.reward_model else AutoModelForCausalLM
            #: a vision-language model (its config has a vision tower): image parts go through its processor
            #: (issue 48); text-only requests decode as on any causal LM
            self.vision: bool = getattr(hf_cfg, "vision_config", None) is not None
            self._processor: Any = None
            if self.vision:
                from transformers import AutoModelForImageTextToText, AutoProcessor

                self._processor = AutoProcessor.from_pretrained(source, **load_kw)
                auto = AutoModelForImageTextToText
            if self.embedding is not None:
                self.reward_model = self.vision = False
                auto = AutoModel  # the encoder alone: its last hidden state is what the pooling reads
            model = auto.from_pretrained(source, dtype=self.dtype, **load_kw)
            model.to(self.device)
            model.eval()
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"could not load model from {path}: {exc}") from exc
        forward_params = inspect.signature(model.forward).parameters  # the base model's: peft passes them on
        #: LoRA adapters by name (``--adapter``), loaded through peft; each forward names every row's adapter
        #: (peft's mixed-adapter batches: ``adapter_names``, "__base__" for the base model)
        self.adapters: dict[str, str] = dict(adapters or {})
        if self.adapters:
            model = self._load_adapters(model)
        self._model: Any = model
        self._chat_template = self._load_chat_template(chat_template)
        self._accepts_logits_to_keep = "logits_to_keep" in forward_params
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"  # transformers 5.2x: cache
        # transformers >= 5.2x renamed ``past_key_values`` to ``cache``; the old name still works but goes
        # through a deprecation shim on every step.
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"

        max_pos = getattr(model.config, "max_position_embeddings", None)
        default_len = max_pos if isinstance(max_pos, int) and max_pos > 0 else 4096
        if self.embedding is not None and self.embedding.max_seq_length is not None:
            default_len = min(default_len, self.embedding.max_seq_length)  # what the model was trained to embed
        self.session_len: int = session_len if session_len is not None else default_len
        if self.session_len < 2:
            raise EngineError(f"session_len must be >= 2, got {self.session_len}")
        self.eos_token_ids: frozenset[int] = frozenset(self._eos_ids())
        self._vocab_size = int(getattr(model.config, "vocab_size", 0) or len(self._tokenizer))
        self.max_batch: int = cfg.max_batch_rows
        #: the Engine contract's capacity: the rows it decodes at once
        self.capacity = self.max_batch
        pad = getattr(self._tokenizer, "pad_token_id", None)
        # The pad id only fills masked positions, so any valid id does.
        self._pad_id: int = pad if isinstance(pad, int) else min(self.eos_token_ids, default=0)

        # One lock serialises forward passes (each request owns its KV cache, but concurrent forwards would
        # only fight for the same cores, or race for GPU memory); a separate one guards the Rust tokenizer,
        # whose concurrent use can raise "Already borrowed".
        self._model_lock = threading.Lock()
        self._row_adapter: dict[int, str | None] = {}  # a batched row's adapter, by the row's id()
        self._tok_lock = threading.RLock()
        self._closed = False
        self._grammars = GrammarCache(self._tokenizer, self._tok_lock, self._vocab_size, sorted(self.eos_token_ids))
        self._warm_up()
        log.info(
            "transformers engine ready: model=%s device=%s dtype=%s session_len=%d eos=%s",
            self.model_name,
            self.device,
            self.dtype,
            self.session_len,
            sorted(self.eos_token_ids),
        )

    # ------------------------------------------------------------------ setup helpers

    def _load_adapters(self, model: Any) -> Any:
        """The base model wrapped by peft with every adapter loaded (EngineError naming one that fails)."""
        try:
            from peft import PeftModel
        except ImportError as exc:
            raise EngineError(f"--adapter: the transformers engine serves adapters through peft: pip install "
                              f"'lmdq[lora]' ({exc})") from exc
        wrapped: Any = None
        for name, path in self.adapters.items():
            try:
                if wrapped is None:
                    wrapped = PeftModel.from_pretrained(model, path, adapter_name=name, is_trainable=False)
                else:
                    wrapped.load_adapter(path, adapter_name=name, is_trainable=False)
            except Exception as exc:
                raise EngineError(f"--adapter {name}={path}: could not load the adapter: {exc}") from exc
        wrapped.to(self.device)
        wrapped.eval()
        return _BaseByDefault(wrapped)

    def _adapter_kwargs(self, adapters: list[str | None]) -> dict[str, Any]:
        """The forward's ``adapter_names`` (one per row) when adapters are loaded; nothing otherwise."""
        if not self.adapters:
            return {}
        return {"adapter_names": [a if a is not None else "__base__" for a in adapters]}

    def _resolve_dtype(self, dtype: str) -> Any:
        """'auto' = float32 on CPU (bf16/fp16 matmuls are slow and less exact there), bf16 on GPU."""
        torch = self._torch
        if dtype == "auto":
            if self.device.type == "cuda":
                return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
            return torch.float32
        return getattr(torch, dtype)

    def _load_chat_template(self, chat_template: str | None) -> str | None:
        """The override (a file path or a Jinja string) wins over the tokenizer's own template."""
        if chat_template is None:
            return getattr(self._tokenizer, "chat_template", None) or None
        candidate = Path(chat_template).expanduser()
        if "{" not in chat_template and len(chat_template) < 4096:
            try:
                if candidate.is_file():
                    return candidate.read_text(encoding="utf-8")
            except OSError as exc:
                raise EngineError(f"cannot read chat template {candidate}: {exc}") from exc
            raise EngineError(f"chat_template {chat_template!r} is neither a file nor a Jinja template")
        return chat_template

    def _eos_ids(self) -> set[int]:
        """Tokenizer eos + generation_config eos (int or list), as LMDeploy's update_from_hf_gen_cfg."""
        ids: set[int] = set()
        tok_eos = getattr(self._tokenizer, "eos_token_id", None)
        if isinstance(tok_eos, int):
            ids.add(tok_eos)
        gen_cfg = getattr(self._model, "generation_config", None)
        eos = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(i) for i in eos)
        return ids

    def _warm_up(self) -> None:
        """One tiny forward at load time: safetensors are mmapped, so the first forward pages in the whole
        model (seconds on a cold disk) and would otherwise be billed to the first request's latency."""
        torch = self._torch
        try:
            with torch.inference_mode():
                if self.embedding is not None:  # an encoder has no KV cache to switch off
                    self._model(input_ids=torch.tensor([[0, 1]], device=self.device))
                    return
                self._model(input_ids=torch.tensor([[0, 1]], device=self.device), use_cache=False)
        except Exception as exc:
            raise EngineError(f"the model failed its warm-up forward pass: {exc}") from exc

    # ------------------------------------------------------------------ public API

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` encodes to without special tokens (what generate_token_len counts)."""
        self._require_open()
        with self._tok_lock:
            return len(self._tokenizer.encode(text, add_special_tokens=False))

    def alive(self) -> bool:
        """In-process engine: alive until closed."""
        return not self._closed

    def close(self) -> None:
        """Free the model (waits for an in-flight step). Idempotent; later stream calls raise EngineError."""
        with self._model_lock:
            if self._closed:
                return
            self._closed = True
            self._model = None
        gc.collect()
        if self.device.type == "cuda":
            self._torch.cuda.empty_cache()

    def stream(self, requests: Sequence[EngineRequest], abort: threading.Event) -> Iterator[EngineEvent]:
        """Run ``requests`` in padded batches of up to ``max_batch`` (those that cannot batch run alone as they
        come), yielding deltas and exactly one final event per request."""
        self._require_open()
        if self.embedding is not None or any(r.endpoint is Endpoint.embedding for r in requests):
            yield from self._embed(requests, abort)
            requests = [r for r in requests if r.endpoint is not Endpoint.embedding and self.embedding is None]
        batch: list[DecodeRow] = []
        for req in requests:
            if abort.is_set():
                yield EngineEvent(index=req.index, finish_reason=FinishReason.abort)
                continue
            if self.reward_model or not req.endpoint.generates:
                yield self._score(req)
                continue
            if _has_images(req):
                yield from self._generate_with_images(req, abort)
                continue
            prepared = self._prepare(req)
            if isinstance(prepared, EngineEvent):
                yield prepared
                continue
            input_ids, sampling = prepared
            if req.adapter is not None and req.adapter not in self.adapters:
                yield error_event(req.index, ErrorCode.bad_request, f"no adapter {req.adapter!r} on this worker")
                continue
            if not batchable(sampling):
                yield from self._generate(req.index, input_ids, sampling, abort, adapter=req.adapter)
                continue
            row = self._row(req.index, input_ids, sampling)
            self._row_adapter[id(row)] = req.adapter
            batch.append(row)
            if len(batch) >= self.max_batch:
                yield from self._generate_batch(batch, abort)
                batch = []
        if batch:
            yield from self._generate_batch(batch, abort)

    # ------------------------------------------------------------------ per request

    def _require_open(self) -> None:
        if self._closed:
            raise EngineError("the transformers engine is closed")

    def _generate_with_images(self, req: EngineRequest, abort: threading.Event) -> Iterator[EngineEvent]:
        """A request with image parts (the worker made each a data: URL: worker/images.py): the processor
        turns the template's text and the images into input ids (each image's tokens expanded) and pixel
        values, which go into the prefill step of the same decode loop text requests use. Runs alone (not
        in a padded batch): pixel values do not pad."""
        if not self.vision or self._processor is None:
            yield error_event(req.index, ErrorCode.unsupported_feature,
                              f"{self.model_name} is a text-only model: image parts need a vision-language model")
            return
        if req.adapter is not None and req.adapter not in self.adapters:
            yield error_event(req.index, ErrorCode.bad_request, f"no adapter {req.adapter!r} on this worker")
            return
        try:
            text, images = self._vision_prompt(req)
            with self._tok_lock:
                enc = self._processor(text=[text], images=images, return_tensors="pt")
            input_ids = [int(t) for t in enc["input_ids"][0]]
            sampling = self._sampling(req, len(input_ids))
        except BadRequest as exc:
            yield error_event(req.index, ErrorCode.bad_request, str(exc))
            return
        except Exception as exc:  # an image the processor cannot take: this request fails, the call goes on
            log.exception("preparing image request %d failed", req.index)
            yield error_event(req.index, ErrorCode.invalid_image, f"{type(exc).__name__}: {exc}")
            return
        if len(input_ids) >= self.session_len:
            yield error_event(req.index, ErrorCode.context_length_exceeded,
                              f"Input length ({len(input_ids)}) must be smaller than the model context length "
                              f"({self.session_len}).", input_token_len=len(input_ids))
            return
        extra = {k: v.to(self.device, dtype=self.dtype) if k == "pixel_values" else v.to(self.device)
                 for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
        yield from self._generate(req.index, input_ids, sampling, abort, adapter=req.adapter, prefill_kwargs=extra)

    def _vision_prompt(self, req: EngineRequest) -> tuple[str, list[Any]]:
        """The templated text (each image part as the template's image placeholder) and the images, in order."""
        import base64
        import io

        from PIL import Image

        if not self._chat_template:
            raise BadRequest("this model has no chat template: image requests need one (--chat-template)")
        messages: list[dict[str, Any]] = []
        images: list[Any] = []
        for raw in req.messages or []:
            try:
                msg = ChatMessage.model_validate(raw)
                msg.check_parts()
            except ValueError as exc:
                raise BadRequest(f"invalid message: {exc}") from exc
            if not isinstance(msg.content, list):
                messages.append({"role": msg.role, "content": msg.content or ""})
                continue
            parts: list[dict[str, Any]] = []
            for part in msg.content:
                if part.get("type") != "image_url":
                    parts.append({"type": "text", "text": part["text"]})
                    continue
                url = part["image_url"]["url"]
                head, _, payload = url.partition(",")
                if not head.lower().startswith("data:") or ";base64" not in head.lower():
                    raise BadRequest("image parts reach the engine as base64 data: URLs (the worker reads them)")
                img = Image.open(io.BytesIO(base64.b64decode(payload)))
                images.append(img.convert("RGB"))
                parts.append({"type": "image"})
            messages.append({"role": msg.role, "content": parts})
        return self._apply_template(messages), images

    def _prepare(self, req: EngineRequest) -> tuple[list[int], Sampling] | EngineEvent:
        """Prompt ids and settings of one request, or its final error event; failures never escape."""
        try:
            input_ids = self._prompt_ids(req)
            sampling = self._sampling(req, len(input_ids))
        except BadRequest as exc:
            return error_event(req.index, ErrorCode.bad_request, str(exc))
        except Exception as exc:  # a bug or an odd tokenizer: this request fails, the call goes on
            log.exception("preparing request %d failed", req.index)
            return error_event(req.index, ErrorCode.internal_error, f"{type(exc).__name__}: {exc}")
        input_len = len(input_ids)
        if input_len >= self.session_len:
            return error_event(
                req.index,
                ErrorCode.context_length_exceeded,
                f"Input length ({input_len}) must be smaller than the model context length ({self.session_len}).",
                input_token_len=input_len,
            )
        return input_ids, sampling

    def _score(self, req: EngineRequest) -> EngineEvent:
        """The one final event of a ``score`` or ``reward`` request (:mod:`worker.engines.scoring`)."""
        if req.adapter is not None:  # scoring's batched forwards run the base model (_BaseByDefault)
            return error_event(req.index, ErrorCode.unsupported_feature,
                               f"endpoint {req.endpoint.value!r} with a LoRA adapter ({req.adapter!r}) is not "
                               "supported; score on the base model's name")
        try:
            if req.endpoint is Endpoint.reward:
                if not self.reward_model:
                    raise BadRequest("endpoint 'reward' needs a reward model (a *ForSequenceClassification "
                                     "checkpoint with one label); this worker serves a causal LM")
                return self._reward(req)
            if self.reward_model:
                raise BadRequest("this worker serves a reward model: only endpoint 'reward', not "
                                 f"{req.endpoint.value!r}")
            prompt_ids = self._prompt_ids(req)
            conts = continuation_ids(self._tokenizer, self._tok_lock, req.continuations or ())
        except EngineError:
            raise
        except BadRequest as exc:
            return error_event(req.index, ErrorCode.bad_request, str(exc))
        except Exception as exc:
            log.exception("preparing score request %d failed", req.index)
            return error_event(req.index, ErrorCode.internal_error, f"{type(exc).__name__}: {exc}")
        longest = len(prompt_ids) + max(len(c) for c in conts)
        if longest > self.session_len:
            return error_event(req.index, ErrorCode.context_length_exceeded,
                               f"prompt + continuation is {longest} tokens, over the model context length "
                               f"({self.session_len})", input_token_len=len(prompt_ids))
        try:
            with self._model_lock:
                if self._model is None:
                    raise EngineError("the transformers engine was closed during scoring")
                with self._torch.inference_mode():
                    scores = score_continuations(
                        self._torch, self._model, prompt_ids, conts, device=self.device, pad_id=self._pad_id,
                        vocab_size=self._vocab_size, accepts_logits_to_keep=self._accepts_logits_to_keep,
                        budget_bytes=self.config.score_logits_mb * 1024 * 1024,
                        logit_bytes=self._torch.tensor([], dtype=self.dtype).element_size(),
                        cache_kwarg=self._cache_kwarg)
        except EngineError:
            raise
        except Exception as exc:
            log.exception("scoring request %d failed", req.index)
            return error_event(req.index, ErrorCode.internal_error, f"{type(exc).__name__}: {exc}",
                               input_token_len=len(prompt_ids))
        return EngineEvent(index=req.index, input_token_len=len(prompt_ids), finish_reason=FinishReason.stop,
                           scores=[(lp, n, g) for lp, n, g in scores], whole=True)

    def _embed(self, requests: Sequence[EngineRequest], abort: threading.Event) -> Iterator[EngineEvent]:
        """Every ``embedding`` request of the call (an embedding model answers nothing else): tokenized as
        sentence-transformers does (stripped, special tokens, ``do_lower_case``), sorted by length so a padded forward
        of up to ``max_batch`` rows wastes little, pooled by :mod:`worker.engines.embedding`. A text over the
        model's ``max_seq_length`` (or ``--session-len``) fails alone with ``context_length_exceeded``."""
        layout = self.embedding
        todo: list[tuple[EngineRequest, list[int]]] = []
        for req in requests:
            if layout is None:
                if req.endpoint is Endpoint.embedding:
                    yield error_event(req.index, ErrorCode.bad_request,
                                      "endpoint 'embedding' needs an embedding model (a sentence-transformers folder: "
                                      "modules.json with a Pooling module); this worker serves a causal LM")
                continue
            if req.endpoint is not Endpoint.embedding:
                yield error_event(req.index, ErrorCode.bad_request, "this worker serves an embedding model: only "
                                  f"endpoint 'embedding', not {req.endpoint.value!r}")
                continue
            if abort.is_set():
                yield EngineEvent(index=req.index, finish_reason=FinishReason.abort)
                continue
            text = (req.prompt or "").strip()  # sentence-transformers strips each text before tokenizing
            with self._tok_lock:
                ids = list(self._tokenizer.encode(text.lower() if layout.lower_case else text, add_special_tokens=True))
            if len(ids) > self.session_len:
                yield error_event(req.index, ErrorCode.context_length_exceeded,
                                  f"the text is {len(ids)} tokens, over the model's maximum of {self.session_len} "
                                  "(max_seq_length)", input_token_len=len(ids))
                continue
            todo.append((req, ids))
        if layout is None or not todo:
            return
        todo.sort(key=lambda t: len(t[1]))
        torch = self._torch
        for start in range(0, len(todo), self.max_batch):
            chunk = todo[start : start + self.max_batch]
            if abort.is_set():
                for req, _ in chunk:
                    yield EngineEvent(index=req.index, finish_reason=FinishReason.abort)
                continue
            try:
                with self._model_lock:
                    if self._model is None:
                        raise EngineError("the transformers engine was closed during embedding")
                    with torch.inference_mode():
                        vectors = embed_batch(torch, self._model, [ids for _, ids in chunk], layout,
                                              device=self.device, pad_id=self._pad_id)
            except EngineError:
                raise
            except Exception as exc:  # this forward's rows fail; the call goes on
                log.exception("embedding %d requests failed", len(chunk))
                for req, ids in chunk:
                    yield error_event(req.index, ErrorCode.internal_error, f"{type(exc).__name__}: {exc}",
                                      input_token_len=len(ids))
                continue
            for (req, ids), vec in zip(chunk, vectors, strict=True):
                yield EngineEvent(index=req.index, input_token_len=len(ids), finish_reason=FinishReason.stop,
                                  embedding=vec, whole=True)

    def _reward(self, req: EngineRequest) -> EngineEvent:
        """A reward model's score of the chat: its one logit, pooled at the last token by the head."""
        text = reward_text(self._tokenizer, self._tok_lock, _normalise_messages(req.messages or []),
                           self._chat_template)
        with self._tok_lock:
            ids = list(self._tokenizer.encode(text, add_special_tokens=True))
        bos = getattr(self._tokenizer, "bos_token_id", None)
        if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        if not ids:
            raise BadRequest("the chat encodes to zero tokens")
        if len(ids) > self.session_len:
            return error_event(req.index, ErrorCode.context_length_exceeded,
                               f"the chat is {len(ids)} tokens, over the model context length ({self.session_len})",
                               input_token_len=len(ids))
        torch = self._torch
        with self._model_lock:
            if self._model is None:
                raise EngineError("the transformers engine was closed during scoring")
            with torch.inference_mode():
                logits = self._model(input_ids=torch.tensor([ids], device=self.device)).logits
        return EngineEvent(index=req.index, input_token_len=len(ids), finish_reason=FinishReason.stop,
                           reward=float(logits[0, 0].float().item()), whole=True)

    def _row(self, index: int, input_ids: list[int], s: Sampling) -> DecodeRow:
        """A batched loop's row for one prepared request, sharing this engine's tokenizer and its lock."""
        return DecodeRow(
            index,
            input_ids,
            s,
            torch=self._torch,
            device=self.device,
            vocab_size=self._vocab_size,
            tokenizer=self._tokenizer,
            tok_lock=self._tok_lock,
        )

    def _generate_batch(self, rows: list[DecodeRow], abort: threading.Event) -> Iterator[EngineEvent]:
        """The padded decode loop: one forward per step for every unfinished row, under the model lock.

        Prompts are left-padded to one width so every row's last position is its last prompt token;
        the attention mask hides the padding and explicit position ids count only real tokens, so each
        row sees exactly what it would see alone. A row that finishes is dropped from the KV cache
        (``batch_select_indices``) so the remaining rows stop paying for it. A row whose token pick fails
        fails alone; a failed forward fails the rows still running (internal_error)."""
        torch = self._torch
        active = list(rows)
        adapter_of = {id(r): self._row_adapter.pop(id(r), None) for r in rows}
        # Rows with the same prompt ids (the n samples of one request, params.n) are prefilled ONCE: the
        # prefill runs over the distinct prompts, then the KV cache, mask and logits fan out to every row.
        # (A LoRA adapter is part of the key: the same prompt under two adapters is two prefills.)
        first_of: dict[tuple[Any, ...], int] = {}
        fan: list[int] = []
        for r in active:
            key = (adapter_of[id(r)], *r.history.tolist())
            if key in first_of:
                r.prefilled = 0
            fan.append(first_of.setdefault(key, len(first_of)))
        uniq = [active[fan.index(u)] for u in range(len(first_of))]
        width = max(r.input_len for r in active)
        step_input = torch.full((len(uniq), width), self._pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((len(uniq), width), dtype=torch.long, device=self.device)
        for i, r in enumerate(uniq):
            step_input[i, width - r.input_len :] = r.history
            mask[i, width - r.input_len :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        spread = None if len(uniq) == len(active) else torch.tensor(fan, dtype=torch.long, device=self.device)
        cache: Any = None
        try:
            while active:
                if abort.is_set():
                    for r in active:
                        yield r.final_event(FinishReason.abort)
                    return
                picks: list[int | Exception] = []
                with self._model_lock:
                    if self._model is None:
                        raise EngineError("the transformers engine was closed during generation")
                    kwargs: dict[str, Any] = {
                        self._cache_kwarg: cache,
                        "use_cache": True,
                        "attention_mask": mask,
                        "position_ids": positions,
                    }
                    if self._accepts_logits_to_keep:
                        kwargs["logits_to_keep"] = 1
                    forwarded = uniq if spread is not None else active  # the shared prefill runs the distinct rows
                    kwargs.update(self._adapter_kwargs([adapter_of[id(r)] for r in forwarded]))
                    with torch.inference_mode():
                        out = self._model(input_ids=step_input, **kwargs)
                        cache = out.get("cache") if self._cache_kwarg == "cache" else out.past_key_values
                        logits = out.logits[:, -1].float()
                        if spread is not None:  # after the shared prefill: one cache row per request row
                            cache.batch_select_indices(spread)
                            logits, mask, spread = logits[spread], mask[spread], None
                        for i, r in enumerate(active):
                            try:
                                picks.append(r.pick(logits[i]))
                            except Exception as exc:  # this row's settings broke the pick: it fails alone
                                picks.append(exc)
                keep: list[int] = []
                for i, (r, pick) in enumerate(zip(active, picks)):
                    event = None
                    try:
                        if isinstance(pick, Exception):
                            raise pick
                        event = r.advance(pick)
                    except Exception as exc:  # this row's pick or text broke: it fails alone
                        log.error("generation of request %d failed: %r", r.index, exc)
                        r.finish = FinishReason.error
                        yield self._row_error(r, exc)
                        continue
                    if r.finish is not None:
                        yield r.final_event()
                        continue
                    keep.append(i)
                    if event is not None:
                        yield event
                if len(keep) < len(active):
                    active = [active[i] for i in keep]
                    if not active:
                        break
                    index = torch.tensor(keep, dtype=torch.long, device=self.device)
                    cache.batch_select_indices(index)
                    mask = mask[index]
                mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)
                step_input = torch.tensor([[r.gen_ids[-1]] for r in active], dtype=torch.long, device=self.device)
                positions = torch.tensor(
                    [[r.input_len + len(r.gen_ids) - 1] for r in active], dtype=torch.long, device=self.device
                )
        except EngineError:
            raise
        except Exception as exc:
            log.exception("batched generation of %d requests failed", len(active))
            for r in active:
                if r.finish is None:  # rows that already sent their final event keep it
                    yield self._row_error(r, exc)
        finally:
            del cache

    @staticmethod
    def _row_error(r: DecodeRow, exc: BaseException) -> EngineEvent:
        """The final internal_error event of a row that failed mid-generation (the others go on)."""
        return error_event(
            r.index,
            ErrorCode.internal_error,
            f"{type(exc).__name__}: {exc}",
            input_token_len=r.input_len,
            generate_token_len=len(r.gen_ids),
        )

    def _prompt_ids(self, req: EngineRequest) -> list[int]:
        """Template (chat) or take verbatim (completion), then tokenize as LMDeploy does (with BOS)."""
        if req.raw:
            if req.prompt is None:
                raise BadRequest("completion requests need 'prompt'")
            text = req.prompt
        else:
            if req.messages is not None:
                messages = _normalise_messages(req.messages)
            elif req.prompt is not None:
                messages = [{"role": "user", "content": req.prompt}]
            else:
                raise BadRequest("a request needs 'prompt' or 'messages'")
            if not self._chat_template:
                raise BadRequest("this model has no chat template: use the completion endpoint or --chat-template")
            text = self._apply_template(messages)
        with self._tok_lock:
            ids: list[int] = list(self._tokenizer.encode(text, add_special_tokens=True))
        bos = getattr(self._tokenizer, "bos_token_id", None)
        # A template that writes BOS itself plus a tokenizer that adds one would double it.
        if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        if not ids:
            raise BadRequest("the prompt encodes to zero tokens")
        return ids

    def _apply_template(self, messages: list[dict[str, Any]]) -> str:
        """Render messages; anything the template rejects is the request's fault (bad_request)."""
        from jinja2 import TemplateError

        try:
            with self._tok_lock:
                text = self._tokenizer.apply_chat_template(
                    messages, chat_template=self._chat_template, add_generation_prompt=True, tokenize=False
                )
        except (TemplateError, TypeError, ValueError, KeyError) as exc:
            raise BadRequest(f"the chat template rejected the messages: {exc}") from exc
        if not isinstance(text, str):
            raise BadRequest("the chat template did not render to text")
        return text

    def _sampling(self, req: EngineRequest, input_len: int) -> Sampling:
        """Resolve params with LMDeploy defaults and trim max_new_tokens to the session."""
        p = req.params.resolved()
        ignore_eos = bool(p["ignore_eos"])
        stop_ids = self.eos_token_ids | set(p["stop_token_ids"] or [])
        stop_words = [] if ignore_eos else [w for w in (p["stop_words"] or []) if w]
        temperature = float(p["temperature"])
        seed = p["random_seed"]
        return Sampling(
            max_new_tokens=max(1, min(int(p["max_new_tokens"]), self.session_len - input_len)),
            min_new_tokens=int(p["min_new_tokens"] or 0),
            greedy=not p["do_sample"] or temperature == 0.0,
            temperature=temperature,
            top_p=float(p["top_p"]),
            top_k=int(p["top_k"]),
            min_p=float(p["min_p"]),
            repetition_penalty=float(p["repetition_penalty"]),
            seed=int(seed) if seed is not None else random.getrandbits(63),
            stop_words=stop_words,
            stop_ids=set() if ignore_eos else stop_ids,
            banned_ids=sorted(i for i in stop_ids if i < self._vocab_size) if ignore_eos else [],
            skip_special_tokens=bool(p["skip_special_tokens"]),
            logprobs=p["logprobs"],
            output_logits=p["output_logits"],
            output_hidden=p["output_last_hidden_state"],
            grammar=self._grammars.compile(p["response_format"]),
        )

    def _generate(self, index: int, input_ids: list[int], s: Sampling, abort: threading.Event,
                  adapter: str | None = None, prefill_kwargs: dict[str, Any] | None = None) -> Iterator[EngineEvent]:
        """The decode loop: one forward per token under the model lock, streaming stable text.
        ``prefill_kwargs``: what the first forward takes besides the ids (a VLM's ``pixel_values``)."""
        torch = self._torch
        input_len = len(input_ids)
        min_ban = sorted(i for i in s.stop_ids if i < self._vocab_size)
        generator = None if s.greedy else torch.Generator(device=self.device).manual_seed(s.seed)
        history = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        step_input = history.unsqueeze(0)
        cache: Any = None
        rich = RichOutputs(torch, s.logprobs, s.output_logits, s.output_hidden)
        matcher: GuidedMatcher | None = None if s.grammar is None else self._grammars.matcher(s.grammar)
        gen_ids: list[int] = []
        text, emitted, last_event_at = "", 0, 0
        finish: FinishReason | None = None
        try:
            while finish is None:
                if abort.is_set():
                    finish = FinishReason.abort
                    break
                with self._model_lock:
                    if self._model is None:
                        raise EngineError("the transformers engine was closed during generation")
                    kwargs: dict[str, Any] = {self._cache_kwarg: cache, "use_cache": True}
                    prefill = cache is None
                    if self._accepts_logits_to_keep and not (prefill and s.output_logits == "all"):
                        kwargs["logits_to_keep"] = 1
                    if rich.want_hidden:
                        kwargs["output_hidden_states"] = True
                    kwargs.update(self._adapter_kwargs([adapter]))
                    if prefill and prefill_kwargs:
                        kwargs.update(prefill_kwargs)
                    with torch.inference_mode():
                        out = self._model(input_ids=step_input, **kwargs)
                        cache = out.get("cache") if self._cache_kwarg == "cache" else out.past_key_values
                        raw = out.logits[0, -1].float()
                        hidden = out.hidden_states[-1][0].float() if rich.want_hidden else None
                        if prefill and rich.want_all:
                            rich.add_prompt(out.logits, hidden)
                        logits = raw.clone()
                        if matcher is not None:
                            matcher.mask(logits)
                        banned = s.banned_ids + (min_ban if len(gen_ids) < s.min_new_tokens else [])
                        if matcher is not None and matcher.exhausted(logits, banned):
                            finish = FinishReason.stop  # the grammar (with the bans) leaves no token: it is done
                            break
                        token = next_token(torch, logits, history, s, banned, generator)
                if token in s.stop_ids:
                    finish = FinishReason.stop
                    break
                if matcher is not None and not matcher.accept(token):
                    raise RuntimeError(f"the grammar rejected token {token}")
                rich.add_token(token, raw, hidden)
                gen_ids.append(token)
                history = torch.cat([history, history.new_tensor([token])])
                step_input = history[-1:].unsqueeze(0)
                stable_before = len(text.rstrip(REPLACEMENT_CHAR))
                with self._tok_lock:
                    text = self._tokenizer.decode(
                        gen_ids, skip_special_tokens=s.skip_special_tokens, clean_up_tokenization_spaces=False
                    )
                if s.stop_words and len(gen_ids) > s.min_new_tokens:
                    # Stop words ending inside the first min_new_tokens tokens don't count (LMDeploy bans
                    # stop tokens there); stable_before keeps U+FFFD-completed characters searchable.
                    pos = find_stop(text, s.stop_words, stable_before)
                    if pos is not None:
                        text, finish = text[:pos], FinishReason.stop
                        break
                if matcher is not None and matcher.is_terminated():
                    finish = FinishReason.stop
                    break
                if len(gen_ids) >= s.max_new_tokens:
                    finish = FinishReason.length
                    break
                end = safe_text_end(text, s.stop_words)
                if end > emitted or len(gen_ids) - last_event_at >= _EVENT_EVERY_TOKENS:
                    delta = text[emitted:end] if end > emitted else ""
                    emitted = max(emitted, end)
                    last_event_at = len(gen_ids)
                    yield EngineEvent(
                        index=index, text=delta, input_token_len=input_len, generate_token_len=len(gen_ids)
                    )
        except EngineError:
            raise
        except Exception as exc:
            log.exception("generation of request %d failed", index)
            yield error_event(
                index,
                ErrorCode.internal_error,
                f"{type(exc).__name__}: {exc}",
                input_token_len=input_len,
                generate_token_len=len(gen_ids),
            )
            return
        finally:
            del cache
        hidden_size = 0
        if s.output_hidden is not None and self._model is not None:
            hidden_size = int(getattr(self._model.config, "hidden_size", 0))
        tensors = rich.tensors(self._vocab_size, hidden_size)
        yield EngineEvent(
            index=index,
            text=text[emitted:] if len(text) > emitted else "",
            input_token_len=input_len,
            generate_token_len=len(gen_ids),
            finish_reason=finish,
            logprobs=rich.logprob_rows(),
            tensors=tensors or None,
            prefill_token_len=input_len,
        )


def _has_images(req: EngineRequest) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"])
               for m in req.messages or [])


def _normalise_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validate roles and flatten text parts to a string, as lmdq serves text-only models."""
    out: list[dict[str, Any]] = []
    for raw in messages:
        if not isinstance(raw, dict):
            raise BadRequest("each message must be an object")
        try:
            msg = ChatMessage.model_validate(raw)
            content = msg.text()
        except ValueError as exc:
            raise BadRequest(f"invalid message: {exc}") from exc
        out.append({**raw, "role": msg.role, "content": content})
    return out


def _served_name(model: str | None) -> str:
    if not model:
        from lmdq.worker.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return Path(model.rstrip("/")).name


def _build(config: TransformersConfig, target: EngineTarget) -> TransformersEngine:
    """No ``--model`` means the embedded default: SmolLM2-135M-Instruct."""
    from lmdq.worker.default_model import ensure_default_model

    path = Path(target.model) if target.model else ensure_default_model()
    return TransformersEngine(config, model_path=path, served_model_name=target.served_model_name,
                              adapters=dict(target.adapters))


SPEC = EngineSpec(
    name="transformers", settings=TransformersConfig, factory=_build, engine=TransformersEngine,
    served_name=_served_name,
    bench=BenchEntry(label=lambda config, engine, label: str(getattr(engine, "model_path", label)),
                     needs_model=False),
    summary="plain transformers on CPU or one GPU; the embedded SmolLM2 when no --model",
)
