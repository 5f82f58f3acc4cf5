"""Producer settings: ``LMDQ_`` env vars, overridden by CLI flags."""

from __future__ import annotations

from pydantic import Field

from lmdq.batches.headroom import DEFAULT_FRACTION
from lmdq.contract import MAX_REUSE_TTL_S
from lmdq.settings import CommonSettings

__all__ = ["ProducerSettings"]


class ProducerSettings(CommonSettings):
    batch_size: int = Field(default=32, ge=1, le=100_000)
    known_models: tuple[str, ...] = ()
    max_line_bytes: int = Field(default=10 * 1024 * 1024, ge=1024)
    max_requests: int = Field(default=10_000_000, ge=1)
    prefix_groups: bool = Field(
        default=True, description="put requests that share a prompt prefix into the same jobs (prefix caching)"
    )
    prefix_group_bytes: int = Field(
        default=512, ge=16, le=1 << 20,
        description="shortest shared prompt prefix, in bytes, that groups requests (up to 32x are compared)",
    )
    reuse: bool = Field(
        default=False, description="submit's --reuse default (issue 47): answer a deterministic request from an "
        "identical earlier one's stored result and record this batch's answers for later batches")
    reuse_ttl_s: int = Field(default=30 * 86400, ge=60, le=MAX_REUSE_TTL_S,
                             description="how long a --reuse batch's answers stay reusable (submit --reuse-ttl)")
    memory_headroom_fraction: float = Field(
        default=DEFAULT_FRACTION, ge=0, le=1, description="submit refuses a batch that would take Redis past this "
        "share of its maxmemory (LMDQ_MEMORY_HEADROOM_FRACTION; 0 = no check; see lmdq.batches.headroom)"
    )
