"""Worker settings: every flag is also an ``LMDQ_`` env var (flag > env > default).

Engine settings are not declared here: the chosen engine's typed configuration (its registered
settings class, :mod:`worker.engines.registry`) is ``.engine_config``, and keeps its flat names (``--tp``
/ ``LMDQ_TP``). Flat values (flags, Python keywords, env vars) go to the engine this worker runs; a flag
or keyword that engine does not take is an error, an env var it does not take is left alone.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource

from lmdq.settings import CommonSettings
from lmdq.worker.adapters import adapter_refusal, adapters_problem, parse_adapters
from lmdq.worker.engine_config import EngineConfig, LMDeployConfig
from lmdq.worker.engine_settings import ENGINE_CONFIGS, all_flat_names, describe_validation_error, split_engine_settings

__all__ = ["DEFAULT_MAX_JOBS", "WorkerSettings", "load_worker_settings", "resolve_engine"]

DEFAULT_MAX_JOBS = 256
"""Jobs a worker holds at most when ``jobs_in_flight`` is 0 (one thread each)."""

POOL_JOB_CONNECTIONS = 32
"""Most connections the derived pool gives job threads (``redis_max_connections`` = 0)."""

POOL_EXTRA_CONNECTIONS = 4
"""Connections beyond the job threads': main loop, heartbeat thread, health endpoint, one spare."""

#: Where :class:`_EngineEnvSource` hands the engine env vars to the validator, apart from the flat
#: keywords, so that a flag (or keyword) still beats its env var.
_ENGINE_ENV = "__engine_env__"


def resolve_engine(engine: str | None, model: str | None) -> str:
    """No ``--engine``: the embedded default model runs on transformers, a named model on LMDeploy."""
    return engine or ("transformers" if model is None else "lmdeploy")


class _EngineEnvSource(PydanticBaseSettingsSource):
    """``LMDQ_<flat name>`` for every engine setting (``LMDQ_TP``, ``LMDQ_SIM_STEP_MS``, ...): the names
    deployments use, though the settings themselves are nested per engine."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # everything is read in __call__

    def __call__(self) -> dict[str, Any]:
        prefix = str(self.config.get("env_prefix", "")).lower()
        env = {k.lower(): v for k, v in os.environ.items()}  # case-insensitive, like the default env source
        found = {flat: env[prefix + flat] for flat in all_flat_names() if prefix + flat in env}
        return {_ENGINE_ENV: found} if found else {}


def _health_port(v: Any) -> Any:
    """A port (0-65535; 0 = no endpoint) or ``auto``, refused in one sentence (not a union's two errors)."""
    if isinstance(v, str) and v.strip().lower() == "auto":
        return "auto"
    try:
        port = int(v)
    except (TypeError, ValueError):
        port = -1
    if not 0 <= port <= 65535 or isinstance(v, (bool, float)):
        raise ValueError(f"expected a port 0-65535, 0 for no endpoint, or auto; got {v!r}")
    return port


class WorkerSettings(CommonSettings):
    # model and engine
    model: str | None = Field(default=None, description="model folder or hub id (default: embedded SmolLM2 on CPU)")
    served_model_name: str | None = Field(default=None, description="name producers submit to (queue)")
    engine: str | None = Field(
        default=None, description="a registered engine: lmdeploy | transformers | sim | a plug-in's (see "
        "docs/architecture.md); the (engines) after an engine flag's help are those that take it")
    #: the chosen engine's settings (its registered settings class), from the flat engine flags/env vars
    engine_config: SerializeAsAny[EngineConfig] = Field(default_factory=EngineConfig)
    adapter: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="a LoRA adapter served beside the base model, NAME=PATH (repeatable); "
        "NAME is a model submit can name (PyTorch backend, or transformers with peft)")
    blob_url: str | None = Field(
        default=None, description="folder or s3://bucket/prefix for tensors when a batch names none (LMDQ_BLOB_URL)"
    )
    allowed_output_urls: str = Field(
        default="", description="comma-separated folders / s3:// prefixes a batch's results_url or blob_url may "
        "name, beyond LMDQ_BLOB_URL (LMDQ_ALLOWED_OUTPUT_URLS); a job writing elsewhere is refused"
    )
    # worker loop
    worker_name: str | None = Field(
        default=None, description="this worker's name in logs, Redis records and metrics (default: host.pid.random)")
    burst: bool = Field(default=False, description="exit when the queues are empty")
    jobs_in_flight: int = Field(default=0, ge=0, description="max jobs held at once (0 = auto)")
    prefetch_requests: int = Field(
        default=0, ge=0, description="requests held beyond engine capacity (0 = one engine-full, at least a job)"
    )
    drain_timeout_s: float = Field(default=30.0, ge=0.0, alias="LMDQ_DRAIN_TIMEOUT",
                                   description="seconds to finish work after SIGTERM")
    heartbeat_ttl_s: float = Field(default=30.0, ge=2.0, le=600.0, alias="LMDQ_HEARTBEAT_TTL",
                                   description="lease TTL: a dead worker's jobs rerun after it")
    max_attempts: int = Field(
        default=3, ge=1, description="times the engine may fail a job before its requests end failed")
    partial_interval_s: float = Field(
        default=2.0, ge=0.05, description="seconds between writes of a long answer's partial text while generated")
    poll_interval_s: float = Field(default=0.05, gt=0.0, description="queue poll period while idle")
    busy_poll_interval_s: float = Field(
        default=0.5, gt=0.0, description="queue poll period while holding jobs (a finished job also wakes it)"
    )
    idle_wait_s: float = Field(
        default=10.0, ge=0.0, le=60.0, description="an idle worker blocks in Redis (BLPOP on its model's wake "
        "list) up to this long between claims; a submit, re-queue or reap wakes it at once; 0 = poll every "
        "poll_interval_s instead (for a Redis proxy without blocking commands)"
    )
    redis_max_connections: int = Field(
        default=0, ge=0, description="size of the worker's Redis connection pool; a thread that finds every "
        "connection busy waits for one (never 'Too many connections'); 0 = jobs in flight (at most 32) + 4"
    )
    engine_process: bool | None = Field(
        default=None, description="build the engine in a process of its own and talk to it over a pipe, so the "
        "worker's Python never shares a GIL with an engine that runs in the loading process; unset: on for "
        "TurboMind (LMDeploy, backend not pytorch, no adapters: H200, SmolLM2 chat, 0.97 of a raw pipe() in a "
        "child against 0.80 in process), off otherwise (LMDeploy's PyTorch backend has its own engine process)")
    gil_switch_interval_ms: float | None = Field(
        default=None, gt=0.0, le=100.0, description="the worker process's GIL switch interval "
        "(sys.setswitchinterval; Python's default: 5 ms). An engine in this process (TurboMind) waits for the "
        "GIL for every step's callback while the worker's threads hold it; shorter hands it over sooner")
    health_host: str = Field(default="0.0.0.0", description="address the health endpoint binds")
    health_port: Annotated[int | Literal["auto"], BeforeValidator(_health_port)] = Field(
        default=8000, description="HTTP /healthz /readyz /metrics: a port, 0 = off, auto = the first free one from "
        "8000 (several workers on one host)")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, _EngineEnvSource(settings_cls), env_settings, dotenv_settings, file_secret_settings

    @model_validator(mode="before")
    @classmethod
    def _engine_settings(cls, data: Any) -> Any:
        """Flat engine settings → the chosen engine's nested config (flag > env > default)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        env = data.pop(_ENGINE_ENV, None) or {}
        engine = resolve_engine(data.get("engine"), data.get("model"))
        configs = dict(ENGINE_CONFIGS)
        if engine not in configs:  # the engine field itself reports the bad name
            for flat in all_flat_names():
                data.pop(flat, None)
            return data
        values = split_engine_settings(data, engine, env)  # reads a nested ``<engine>=`` config or dict
        for name in configs:
            data.pop(name, None)
        cls = configs[engine]
        try:
            data["engine_config"] = cls.model_validate(values)
        except ValidationError as exc:  # one line naming the flag and env var, as for any other setting
            raise ValueError(str(describe_validation_error(exc, cls))) from None
        return data

    @field_validator("engine")
    @classmethod
    def _registered_engine(cls, v: str | None) -> str | None:
        if v is not None and v not in ENGINE_CONFIGS:
            names = list(ENGINE_CONFIGS)
            raise ValueError(f"expected {', '.join(repr(n) for n in names[:-1])} or {names[-1]!r}, got {v!r}")
        return v

    @field_validator("adapter", mode="before")
    @classmethod
    def _adapter_specs(cls, v: Any) -> Any:
        """``NAME=PATH`` strings (the flag, repeated; LMDQ_ADAPTER: comma-separated, or a JSON object / list:
        NoDecode hands the env var here as it is)."""
        if isinstance(v, str) and v.strip().startswith("["):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise ValueError(f"expected NAME=PATH, comma-separated, or a JSON list of them: {e}") from None
        if isinstance(v, (str, dict)):
            v = [f"{k}={p}" for k, p in parse_adapters(v).items()]
        parse_adapters(v)  # NAME=PATH each, a valid name, none twice
        return v

    @field_validator("adapter")
    @classmethod
    def _adapters_servable(cls, v: list[str], info: ValidationInfo) -> list[str]:
        """Refused before a model load of minutes: an engine that cannot apply an adapter would otherwise
        answer its requests with the base model's outputs under the adapter's name; an adapter named as
        the base model would answer the base model's; a name the engine cannot load or a path that is
        no adapter folder would end the worker in a library's traceback after the load
        (:func:`lmdq.worker.adapters.adapters_problem`)."""
        if not v:
            return v
        engine = resolve_engine(info.data.get("engine"), info.data.get("model"))
        why = adapter_refusal(engine, info.data.get("engine_config"))
        if why:
            raise ValueError(why)
        served = info.data.get("served_model_name")
        if not served:  # the engine's default name for --model (what build_engine will serve)
            from lmdq.worker.engines.registry import engine_spec

            try:
                served = engine_spec(engine).served_name(info.data.get("model"))
            except ValueError:
                served = ""  # a bad --model is reported where the engine resolves it
        why = adapters_problem(parse_adapters(v), served)
        if why:
            raise ValueError(why)
        return v

    @property
    def adapters(self) -> dict[str, str]:
        """The LoRA adapters to serve, ``{NAME: PATH}`` (``--adapter NAME=PATH``, repeated)."""
        return parse_adapters(self.adapter)

    @property
    def max_jobs(self) -> int:
        """Jobs held at once: ``jobs_in_flight``, or :data:`DEFAULT_MAX_JOBS` (admission then keeps the
        engine full by requests, well below it)."""
        return self.jobs_in_flight or DEFAULT_MAX_JOBS

    @property
    def redis_pool_size(self) -> int:
        """Connections in the worker's pool: ``redis_max_connections``, or one per job thread up to
        :data:`POOL_JOB_CONNECTIONS` plus :data:`POOL_EXTRA_CONNECTIONS` for the loop, the heartbeat and
        the health endpoint. Job threads hold a connection only for one command or pipeline at a time,
        so a few dozen serve hundreds of jobs; the cap keeps a fleet within Redis' ``maxclients``."""
        return self.redis_max_connections or min(self.max_jobs, POOL_JOB_CONNECTIONS) + POOL_EXTRA_CONNECTIONS

    @property
    def runs_engine_process(self) -> bool:
        """``engine_process``, or where unset: whether the engine would run in this process and hold its GIL for
        every step (TurboMind: LMDeploy with a backend other than pytorch and no LoRA adapters, which only the
        PyTorch backend applies). ``backend auto`` counts as TurboMind, as LMDeploy tries it first; should it
        fall back to PyTorch, that engine starts its own process from the child, which costs nothing measurable."""
        if self.engine_process is not None:
            return self.engine_process
        cfg = self.engine_config
        return isinstance(cfg, LMDeployConfig) and not cfg.runs_pytorch(bool(self.adapter))

    @property
    def engine_name(self) -> str:
        """The engine this worker runs (``engine``, or the default for ``model``)."""
        return resolve_engine(self.engine, self.model)

    model_config = {**CommonSettings.model_config, "populate_by_name": True}


def load_worker_settings(**values: Any) -> WorkerSettings:
    """``WorkerSettings(**values)`` for the CLIs: a bad or unsupported setting is one :class:`BadSetting`
    line naming its flag and env var (exit 2), not a pydantic report."""
    try:
        return WorkerSettings(**values)
    except ValidationError as exc:
        raise describe_validation_error(exc, WorkerSettings) from exc
