"""Settings shared by both sides (pydantic-settings, ``LMDQ_`` env prefix; CLI flags override)."""

from __future__ import annotations

import os

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from lmdq.job_data import DEFAULT_MAX_JOB_BYTES

__all__ = ["CommonSettings", "DEFAULT_REDIS_URL"]

DEFAULT_REDIS_URL = "redis://localhost:6379/0"


class CommonSettings(BaseSettings):
    """What producer and worker both need: where Redis is and how lmdq keys live in it."""

    model_config = SettingsConfigDict(env_prefix="LMDQ_", extra="ignore")

    redis_url: str = Field(
        default_factory=lambda: os.environ.get("REDIS_URL", DEFAULT_REDIS_URL),
        validation_alias=AliasChoices("LMDQ_REDIS_URL", "redis_url"),
    )
    key_prefix: str = "lmdq"
    result_ttl_s: int = Field(default=7 * 24 * 3600, ge=60, description="how long batches and results are kept")
    log_format: str = Field(default="auto", pattern="^(auto|json|console)$")
    log_level: str = "INFO"
    max_job_bytes: int = Field(
        default=DEFAULT_MAX_JOB_BYTES, ge=1 << 20, description="cap on one job's data, compressed and decompressed "
        "(LMDQ_MAX_JOB_BYTES): a worker refuses larger jobs without inflating them; see lmdq.job_data"
    )
    redis_retries: int = Field(
        default=6, ge=0, le=100, description="reconnect attempts per Redis command (backoff 0.4 s doubling to 5 s)"
    )
