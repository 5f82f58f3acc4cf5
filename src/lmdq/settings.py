"""Settings shared by both sides (pydantic-settings, ``LMDQ_`` env prefix; CLI flags override)."""

from __future__ import annotations

import os
from typing import Any, TypeVar

from pydantic import AliasChoices, BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["CommonSettings", "DEFAULT_MAX_IMAGE_BYTES", "DEFAULT_MAX_JOB_BYTES", "DEFAULT_REDIS_URL",
           "DEFAULT_RESULT_TTL_S", "default_of", "load_or_refuse"]

_S = TypeVar("_S", bound=BaseSettings)

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
#: cap on one job's data (``LMDQ_MAX_JOB_BYTES``); :mod:`lmdq.jobs.data` enforces it
DEFAULT_MAX_JOB_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
"""Largest image lmdq accepts (``LMDQ_MAX_IMAGE_BYTES``): OpenAI's per-image limit."""

DEFAULT_RESULT_TTL_S = 7 * 24 * 3600
"""How long a batch and its results are kept once it ended: ``LMDQ_RESULT_TTL_S``'s default, declared
here once (tests/test_settings.py fails on a second 7-day literal); code that takes a TTL gets it from the
settings or names this constant."""


def default_of(cls: type[BaseModel], name: str) -> Any:
    """The declared default of setting ``name`` of ``cls``, for a dataclass or function that takes the
    setting as a parameter: it refers to the declaration instead of repeating its value."""
    return cls.model_fields[name].get_default(call_default_factory=True)


class CommonSettings(BaseSettings):
    """What producer and worker both need: where Redis is and how lmdq keys live in it."""

    # defer_build: built when first loaded, not at import (the CLI's --help reads the fields only; issue 49)
    model_config = SettingsConfigDict(env_prefix="LMDQ_", extra="ignore", defer_build=True)

    redis_url: str = Field(
        default_factory=lambda: os.environ.get("REDIS_URL", DEFAULT_REDIS_URL),
        validation_alias=AliasChoices("LMDQ_REDIS_URL", "redis_url"),
        description="Redis URL (env LMDQ_REDIS_URL, then REDIS_URL)",
    )
    key_prefix: str = "lmdq"
    result_ttl_s: int = Field(default=DEFAULT_RESULT_TTL_S, ge=60,
                              description="how long a batch and its results are kept once it has ended")
    results_url: str | None = Field(
        default=None,
        description="the cluster's results sink (LMDQ_RESULTS_URL: a folder or s3://bucket/prefix): every "
        "batch writes its results there as JSONL shards and Redis keeps only counters and a small index, "
        "unless `submit --results-url` names another (or `none`). Workers may also write there",
    )
    @field_validator("results_url")
    @classmethod
    def _none_is_no_sink(cls, v: str | None) -> str | None:
        """``LMDQ_RESULTS_URL=none`` (or empty) is the same as not setting it."""
        return None if v is None or v.strip().lower() in ("", "none") else v.strip()

    sink_timeout_s: float = Field(
        default=60.0, gt=0, le=3600, description="longest wait for one results-sink or blob-store call (a "
        "shard's write + its confirmation, a read); past it the call counts as failed and is retried later"
    )
    sink_retry_max_s: float = Field(
        default=60.0, gt=0, le=3600, description="cap of the jittered, doubling delay between retries of a "
        "shard write that failed (its results stay in Redis until it lands)"
    )
    staging_lease_s: float = Field(
        default=30.0, gt=0, le=3600, description="the staging lease of a batch whose first jobs are visible "
        "while its submit stages the rest (LMDQ_STAGING_LEASE_S): the submit renews it every third of it; once "
        "it lapses (the submit died) a re-run of the same submit resumes the batch, or whoever notices first "
        "(workers, status/results/cancel, the API) ends it with its unstaged requests failed as "
        "submit_interrupted (docs/reliability.md)"
    )
    max_image_bytes: int = Field(
        default=DEFAULT_MAX_IMAGE_BYTES, ge=1024, description="largest image an image_url part may name or hold "
        "(LMDQ_MAX_IMAGE_BYTES): submit refuses a larger one, a worker reads no more (lmdq.images)"
    )
    # completion webhooks (lmdq.webhooks; docs/webhooks.md): who may be called, and how tries are spaced
    webhook_allow: str = Field(
        default="", description="comma-separated URL prefixes a batch's webhook may name (LMDQ_WEBHOOK_ALLOW), "
        "e.g. https://hooks.example.com/lmdq,http://127.0.0.1:9000; empty: webhooks are refused"
    )
    webhook_backoff_s: float = Field(
        default=5.0, gt=0, le=3600, description="delay before the 2nd try of a webhook event; it doubles each try "
        "(exponential backoff), up to LMDQ_WEBHOOK_BACKOFF_MAX_S"
    )
    webhook_backoff_max_s: float = Field(default=3600.0, gt=0, le=86400,
                                         description="cap of the delay between two tries of a webhook event")
    webhook_max_tries: int = Field(default=20, ge=1, le=1000, description="tries of a webhook event before it is "
                                   "given up (kept in the dead set, logged)")
    webhook_timeout_s: float = Field(default=10.0, gt=0, le=300,
                                     description="longest wait for a webhook receiver's answer to one try")
    webhook_lease_s: float = Field(
        default=60.0, gt=0, le=3600, description="how long a deliverer holds an event it is trying; one killed "
        "mid-try leaves it to another deliverer after this (keep it above LMDQ_WEBHOOK_TIMEOUT_S)"
    )
    webhook_poll_s: float = Field(default=1.0, gt=0, le=60,
                                  description="how often a delivery thread looks for webhook events due")
    log_format: str = Field(default="auto", pattern="^(auto|json|console)$")
    log_level: str = "INFO"
    max_job_bytes: int = Field(
        default=DEFAULT_MAX_JOB_BYTES, ge=1 << 20, description="cap on one job's data, compressed and decompressed "
        "(LMDQ_MAX_JOB_BYTES): a worker refuses larger jobs without inflating them; see lmdq.jobs.data"
    )
    # Redis client timeouts and the startup wait. Retries themselves are lmdq.redis.connection.RetryPolicy,
    # declared there once (30 jittered retries, 0.1 s doubling to 5 s: about 2 minutes).
    # One default for both sides: no lmdq command blocks in Redis (Lua scripts work in bounded chunks;
    # the one BLPOP, an idle worker's wait, has its own connection and timeout: lmdq.jobs.wakeup), so a
    # reply slower than 10 s means Redis is frozen or the network is gone. The
    # worker rides such a spell out with its operation retries, not with a longer timeout, so a
    # frozen Redis is noticed (and logged) equally fast on both sides.
    redis_connect_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description="TCP connect + TLS timeout of every Redis connection; also bounds the first PING at start",
    )
    redis_socket_timeout_s: float = Field(
        default=10.0, gt=0, le=3600, description="longest wait for one Redis reply before it counts as a timeout"
    )
    redis_wait_s: float = Field(
        default=10.0,
        ge=0,
        le=3600,
        description="how long a command waits at start for an unreachable or (re)starting Redis before exit 3",
    )


def load_or_refuse(cls: type[_S], **given: Any) -> _S:
    """``cls`` from its ``LMDQ_*`` env vars under the flags ``given``; a bad value is one line naming each
    variable (never its value: it may be a secret), a BadSetting, exit 2. One home for the commands that
    load their settings this way (lmdq-api, the exporter)."""
    from pydantic import ValidationError

    from lmdq.errors import BadSetting

    try:
        return cls(**given)
    except ValidationError as e:
        problems = "; ".join(f"LMDQ_{str(err['loc'][0]).upper() if err['loc'] else '?'}: {err['msg']}"
                             for err in e.errors(include_input=False, include_url=False))
        raise BadSetting(f"invalid setting {problems}") from None
