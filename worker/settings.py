"""Worker settings: every flag is also an ``LMDQ_`` env var (flag > env > default)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from lmdq.settings import CommonSettings

__all__ = ["WorkerSettings"]


class WorkerSettings(CommonSettings):
    # model and engine
    model: str | None = Field(default=None, description="model folder or hub id; none = embedded SmolLM2 on CPU")
    served_model_name: str | None = None
    engine: Literal["lmdeploy", "transformers", "sim"] | None = None
    backend: Literal["auto", "turbomind", "pytorch"] = "auto"
    tp: int = Field(default=1, ge=1, le=64)
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    session_len: int | None = Field(default=None, ge=16)
    max_batch_size: int | None = Field(default=None, ge=1)
    cache_max_entry_count: float = Field(default=0.8, gt=0.0)
    quant_policy: int = Field(default=0, description="KV cache quantization: 0, 4 or 8")
    chat_template: str | None = None
    eager_mode: bool = False
    mp_engine: bool = Field(default=True, description="PyTorch backend: engine loop in its own process")
    raw: bool = Field(default=False, description="skip the chat template for plain prompts too")
    device: str = "auto"
    blob_url: str | None = Field(
        default=None, description="folder or s3://bucket/prefix for tensors when a batch names none (LMDQ_BLOB_URL)"
    )
    allowed_output_urls: str = Field(
        default="", description="comma-separated folders / s3:// prefixes a batch's results_url or blob_url may "
        "name, beyond LMDQ_BLOB_URL (LMDQ_ALLOWED_OUTPUT_URLS); a job writing elsewhere is refused"
    )
    # sim engine
    sim_step_ms: float = Field(default=5.0, ge=0.0)
    sim_max_batch: int = Field(default=256, ge=1)
    # worker loop
    worker_name: str | None = None
    burst: bool = False
    jobs_in_flight: int = Field(default=0, ge=0, description="max jobs held at once; 0 = derive from engine capacity")
    prefetch_requests: int = Field(
        default=0, ge=0, description="requests held beyond engine capacity; 0 = max(job size, capacity/2)"
    )
    drain_timeout_s: float = Field(default=30.0, ge=0.0, alias="LMDQ_DRAIN_TIMEOUT")
    heartbeat_ttl_s: float = Field(default=30.0, ge=2.0, le=600.0, alias="LMDQ_HEARTBEAT_TTL")
    max_attempts: int = Field(default=3, ge=1)
    partial_interval_s: float = Field(default=2.0, ge=0.05)
    poll_interval_s: float = Field(default=0.05, gt=0.0, description="queue poll period while idle")
    busy_poll_interval_s: float = Field(
        default=0.5, gt=0.0, description="queue poll period while holding jobs (a finished job also wakes it)"
    )
    health_host: str = "0.0.0.0"
    health_port: int = Field(default=8000, ge=0, le=65535, description="0 = no HTTP endpoint")

    @field_validator("quant_policy")
    @classmethod
    def _quant(cls, v: int) -> int:
        if v not in (0, 4, 8):
            raise ValueError(f"expected 0, 4 or 8, got {v}")
        return v

    model_config = {**CommonSettings.model_config, "populate_by_name": True}  # type: ignore[misc]
