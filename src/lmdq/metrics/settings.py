"""The exporter's settings and flags, apart from the exporter itself.

Why a module of its own: ``lmdq-producer`` builds every command's options when it starts, the
exporter's among them, so ``lmdq-producer --help`` (or ``status``) read :data:`EXPORTER_FLAGS`; here
they cost a settings class, not redis-py, prometheus_client and structlog (issue 49: the CLI imports
only what the command needs). :mod:`lmdq.metrics.exporter` re-exports all three names."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from lmdq.flags import own_fields, settings_flags
from lmdq.settings import CommonSettings, load_or_refuse

__all__ = ["EXPORTER_FLAGS", "ExporterSettings", "load_settings"]


class ExporterSettings(CommonSettings):
    """The exporter's settings (``LMDQ_`` env vars; ``lmdq-producer exporter`` flags override)."""

    exporter_host: str = Field(default="0.0.0.0", description="address the /metrics server binds")
    exporter_port: int = Field(default=9464, ge=0, le=65535, description="port of /metrics (0: any free port; "
                               "9464, apart from the worker's health port 8000 and lmdq-api's 8080)")
    exporter_max_batches: int = Field(
        default=1000, ge=0, le=1_000_000, description="newest batches counted in lmdq_batches per read")
    exporter_interval_s: float = Field(
        default=5.0, gt=0, le=3600, description="seconds between two reads of Redis (ONE collector thread, "
        "whatever the number of scrapers; scrapes serve the last read and never touch Redis)")
    exporter_read_timeout_s: float = Field(
        default=3.0, gt=0, le=300, description="Redis time one read may take: a read still waiting past it "
        "(a frozen Redis) makes lmdq_exporter_redis_up 0. Interval + this stays under Prometheus' 10 s "
        "scrape timeout")


#: One flag per field ExporterSettings declares, named without its ``exporter_`` prefix (``--interval-s``:
#: the command already says whose interval); ``lmdq-producer exporter`` takes the producer's --redis-url.
EXPORTER_FLAGS = settings_flags(ExporterSettings, own_fields(ExporterSettings, CommonSettings),
                                flat=lambda name: name.removeprefix("exporter_"))


def load_settings(**given: Any) -> ExporterSettings:
    """``LMDQ_*`` env vars under the flags given; a bad value is one line naming it, exit 2."""
    return load_or_refuse(ExporterSettings, **given)
