"""lmdq.metrics.settings: the exporter's settings and flags, importable without the exporter (issue 49)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lmdq.errors import BadSetting
from lmdq.metrics.settings import EXPORTER_FLAGS, ExporterSettings, load_settings


def test_flags_drop_the_exporter_prefix() -> None:
    assert [s.flat for s in EXPORTER_FLAGS] == ["host", "port", "max_batches", "interval_s", "read_timeout_s"]
    assert [s.key for s in EXPORTER_FLAGS] == [f"exporter_{s.flat}" for s in EXPORTER_FLAGS]


def test_flags_over_env_and_a_bad_value_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMDQ_EXPORTER_PORT", "9000")
    assert load_settings().exporter_port == 9000
    assert load_settings(exporter_port=9100).exporter_port == 9100
    monkeypatch.setenv("LMDQ_EXPORTER_INTERVAL_S", "0")
    with pytest.raises(BadSetting, match="LMDQ_EXPORTER_INTERVAL_S"):
        load_settings()


def test_the_exporter_re_exports_the_same_objects() -> None:
    from lmdq.metrics import exporter

    assert exporter.ExporterSettings is ExporterSettings and exporter.EXPORTER_FLAGS is EXPORTER_FLAGS
    assert exporter.load_settings is load_settings


def test_importing_it_pulls_no_redis_or_prometheus_client() -> None:
    code = ("import sys, lmdq.metrics.settings\n"
            "print(sorted(m for m in ('redis', 'prometheus_client', 'structlog') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
