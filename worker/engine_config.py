"""One typed configuration per engine, each setting declared ONCE (vLLM's EngineArgs habit).

Every engine setting's name, type, bounds, default and help live in exactly one pydantic field below.
Everything else derives from these declarations: the worker's ``LMDQ_*`` env vars and ``--flags``
(:func:`flat_names`, :mod:`lmdq.cli.options`), ``WorkerSettings.engine_config``, the engine
constructors (they take the config object), ``build_backend_config`` and the bench. A new setting is
one new field here, nothing more. Which engine takes which config class is said once, by its
:class:`~lmdq.worker.engines.registry.EngineSpec` (:data:`ENGINE_CONFIGS` reads the registry).

A setting shared by several engines (``session_len``, ``dtype``, ``chat_template``) is declared on a
base class they inherit, so it still has one declaration and one flag. Each setting has a *flat name*,
the name users see (``tp`` → ``--tp`` / ``LMDQ_TP``): the field name, prefixed with the declaring
class's ``flag_prefix`` (the sim engine's own knobs read ``--sim-step-ms`` / ``LMDQ_SIM_STEP_MS``).
Flat names are what existing deployments, docs and scripts use; they stay valid.

A flag (or Python keyword) the chosen engine does not declare is an error (:func:`split_engine_settings`),
never silently ignored: ``--tp 2 --engine transformers`` would otherwise run on one device without a
word. Env vars are shared by whole environments (a ConfigMap serving several workers), so an engine
env var the chosen engine does not take is left alone and logged by the worker (:func:`unused_env`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lmdq.errors import BadSetting

__all__ = [
    "describe_validation_error",
    "flag_of",
    "EngineConfig",
    "LMDeployConfig",
    "ModelEngineConfig",
    "SimConfig",
    "TransformersConfig",
    "declaring_class",
    "flat_names",
]

C = TypeVar("C", bound="EngineConfig")


class EngineConfig(BaseModel):
    """What every engine takes. Frozen: an engine's configuration is fixed for its whole life."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Prefix of the flat (flag/env) names of the fields a class declares itself ('' = the field name).
    flag_prefix: ClassVar[str] = ""
    #: Fields that cannot change an answer, left out of result reuse's worker key (issue 47,
    #: lmdq.reuse.identity). Empty for a real engine: batch shapes and cache settings can change the low
    #: bits of a GPU's sums, so a worker configured differently never shares answers with another.
    reuse_ignores: ClassVar[frozenset[str]] = frozenset()

    session_len: int | None = Field(
        default=None, ge=16, description="max tokens per sequence (prompt + output); none = the model's own"
    )

    @classmethod
    def from_values(cls: type[C], base: C | None = None, /, **values: Any) -> C:
        """``base`` (or the defaults) with ``values`` over it; keys are field or flat names.

        A bad value is a :class:`BadSetting` naming the flag (``--backend: expected ...``)."""
        fields = flat_names(cls)
        data: dict[str, Any] = base.model_dump(exclude_unset=True) if base is not None else {}
        for key, value in values.items():
            data[fields.get(key, key)] = value
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise describe_validation_error(exc, cls) from exc


class ModelEngineConfig(EngineConfig):
    """What the engines that load real weights (LMDeploy, transformers) take besides."""

    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        default="auto",
        description="weights and activations dtype; auto = the engine's choice (lmdeploy: no float32)",
    )
    chat_template: str | None = Field(
        default=None,
        description="lmdeploy: a template name or a ChatTemplateConfig .json; transformers: a Jinja file or string",
    )


class LMDeployConfig(ModelEngineConfig):
    """LMDeploy's ``pipeline``: TurboMind or PyTorch backend (``build_backend_config`` reads this)."""

    backend: Literal["auto", "turbomind", "pytorch"] = Field(
        default="auto", description="auto (TurboMind, LMDeploy falls back to PyTorch) | turbomind | pytorch"
    )
    tp: int = Field(default=1, ge=1, le=64, description="tensor parallel GPUs")
    max_batch_size: int | None = Field(default=None, ge=1, description="sequences decoded at once; none = LMDeploy's")
    cache_max_entry_count: float = Field(
        default=0.8, gt=0.0, lt=1.0, description="KV cache: fraction of the GPU memory free when the engine "
        "allocates, 0 < x < 1 (a fixed size: --num-gpu-blocks, PyTorch only; TurboMind in LMDeploy 0.18 aborts on 1 "
        "or more)"
    )
    quant_policy: int = Field(default=0, description="KV cache quantization: 0, 4 or 8")
    enable_prefix_caching: bool = Field(
        default=False, description="reuse the KV blocks of a prompt prefix already computed (pair with the "
        "producer's prefix groups); refuses output_logits/last_hidden_state 'all'"
    )
    num_gpu_blocks: int = Field(
        default=0, ge=0, description="pytorch: KV cache blocks (64 tokens each); 0 = from --cache-max-entry-count"
    )
    eager_mode: bool = Field(default=False, description="pytorch: no CUDA graphs")
    mp_engine: bool = Field(default=True, description="pytorch: engine loop in its own process")
    raw: bool = Field(default=False, description="never apply the chat template, for plain prompts too")
    stream_from_new_tokens: int | None = Field(
        default=None, ge=0,
        description="stream requests asking for at least this many new tokens (partials); shorter ones "
                    "come back whole; 0 = stream all; none = 1024 on TurboMind, 0 on PyTorch",
    )

    occupancy_log_s: float = Field(
        default=0.0, ge=0.0, le=3600.0,
        description="every this many seconds while the engine holds requests, log how many it holds (min, "
                    "mean, max of 20 samples a second; event 'engine occupancy'): an engine kept short of work "
                    "and a slow one look alike in tokens/s; 0 = off",
    )
    warmup_requests: int = Field(
        default=64, ge=0, le=4096,
        description="requests of mixed lengths run through the engine before the worker reports ready, so "
                    "the first batch does not pay kernel compilation and first-use costs; 0 = off",
    )

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v == "float32":
            raise ValueError("expected auto, float16 or bfloat16 for lmdeploy, got 'float32'")
        return v

    @field_validator("quant_policy")
    @classmethod
    def _quant(cls, v: int) -> int:
        if v not in (0, 4, 8):
            raise ValueError(f"expected 0, 4 or 8, got {v}")
        return v

    def runs_pytorch(self, adapters: bool) -> bool:
        """Whether LMDeploy's PyTorch backend serves this config: asked for, or LoRA ``adapters`` (only the
        PyTorch engine applies them). Otherwise TurboMind (``auto`` included: LMDeploy tries it first)."""
        return self.backend == "pytorch" or adapters

    @model_validator(mode="after")
    def _blocks_need_pytorch(self) -> LMDeployConfig:
        # TurboMind has no such field, and no other fixed KV size (0.18 aborts on a cache_max_entry_count >= 1, seen
        # on the H200): never drop it silently
        if self.num_gpu_blocks and self.backend != "pytorch":
            raise ValueError("--num-gpu-blocks: a PyTorch-engine setting; pass --backend pytorch "
                             "(TurboMind takes only --cache-max-entry-count, a fraction 0 < x < 1)")
        return self


class TransformersConfig(ModelEngineConfig):
    """The CPU-capable reference engine on plain transformers."""

    device: str = Field(default="auto", description="auto (cuda when available) | cpu | cuda | cuda:N")
    max_batch_rows: int = Field(default=32, ge=1, description="requests of one stream call decoded as one padded batch")
    score_logits_mb: int = Field(
        default=128, ge=1, description="MiB of logits (with their float32 log-softmax) one score forward may hold: "
        "continuations are batched, and a long one fed in chunks of positions through the KV cache, within it")


class SimConfig(EngineConfig):
    """The simulated continuous-batching engine (queue, fault and load tests; no model)."""

    flag_prefix: ClassVar[str] = "sim_"
    #: the sim's text is a function of the prompt and params alone: its pacing and cache settings never change it
    reuse_ignores: ClassVar[frozenset[str]] = frozenset({
        "step_ms", "max_batch", "emit_every", "step_cpu_ms", "prefix_cache_tokens", "prefix_block",
        "prefill_us_per_token"})

    step_ms: float = Field(default=5.0, ge=0.0, description="ms per decode step")
    max_batch: int = Field(default=256, ge=1, description="sequences decoded at once")
    emit_every: int = Field(default=64, ge=1, description="tokens per streamed event (LMDeploy streams every token)")
    step_cpu_ms: float = Field(default=0.0, ge=0.0, description="GIL-holding Python work per step, in ms")
    vocab: int = Field(default=1000, ge=1, description="simulated vocabulary (logprobs ids, logits width)")
    hidden: int = Field(default=64, ge=1, description="simulated hidden size (last_hidden_state width)")
    prefix_cache_tokens: int = Field(
        default=0, ge=0, description="simulated prefix cache: LRU of prompt blocks holding this many tokens; 0 = off"
    )
    prefix_block: int = Field(default=16, ge=1, description="tokens per simulated prefix-cache block")
    prefill_us_per_token: float = Field(
        default=0.0, ge=0.0, description="simulated prefill time per prompt token not found in the prefix cache, in µs"
    )


def declaring_class(cls: type[EngineConfig], field: str) -> type[EngineConfig]:
    for klass in cls.__mro__:
        if field in klass.__dict__.get("__annotations__", {}):
            return klass
    raise KeyError(field)  # pragma: no cover - every model field is declared somewhere in the MRO


def flat_names(cls: type[EngineConfig]) -> dict[str, str]:
    """Flat (flag/env) name → field name, for one engine's config."""
    return {declaring_class(cls, f).flag_prefix + f: f for f in cls.model_fields}


def flag_of(flat: str) -> str:
    return "--" + flat.replace("_", "-")


def _where(flat: str) -> str:
    return f"{flag_of(flat)} / LMDQ_{flat.upper()}"


def describe_validation_error(exc: ValidationError, cls: type[BaseModel],
                              engines: Mapping[str, type[EngineConfig]] | None = None) -> BadSetting:
    """The first error of ``exc`` as one line naming the flag and env var: ``--tp / LMDQ_TP: ...``.

    ``cls`` is the model that was validated: an engine config, or the worker settings (a location inside
    one of its engine configs, ``engines``, is mapped back to that setting's flat name)."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    loc = [str(x) for x in err["loc"]]
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err["type"] in ("literal_error", "enum"):
        msg = msg.replace("Input should be", "expected") + f", got {err.get('input')!r}"
    if loc and not issubclass(cls, EngineConfig) and engines and loc[0] in engines:
        cls, loc = engines[loc[0]], loc[1:]
    name: str | None = None
    if loc and issubclass(cls, EngineConfig):
        name = next((flat for flat, f in flat_names(cls).items() if f == loc[0]), loc[0])
    elif loc:
        info = cls.model_fields.get(loc[0])
        alias = info.alias if info is not None and isinstance(info.alias, str) else None
        name = alias.removeprefix("LMDQ_").lower() if alias else loc[0]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return BadSetting(f"{_where(name)}: {msg}{more}" if name else msg + more)
