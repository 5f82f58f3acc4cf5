"""Every log line a process writes is structlog JSON, whoever logs it (issue #19).

The scripts run in a fresh interpreter: logging configuration is process-global, and LMDeploy's
``get_logger`` remembers what it configured for the life of the process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, level: str = "INFO") -> tuple[list[dict[str, Any]], str]:
    """Run ``script`` after lmdq's JSON configuration; every line of stdout and stderr must be JSON."""
    head = f"from lmdq.logs.config import configure_logging\nconfigure_logging('json', {level!r})\n"
    p = subprocess.run([sys.executable, "-c", head + textwrap.dedent(script)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    events: list[dict[str, Any]] = []
    for ln in lines:
        try:
            doc = json.loads(ln)
        except ValueError:
            pytest.fail(f"not a JSON line: {ln!r}\nall output:\n{p.stdout}{p.stderr}")
        assert isinstance(doc, dict) and {"level", "event", "logger", "timestamp"} <= doc.keys(), ln
        events.append(doc)
    return events, p.stderr


def _by_event(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {str(e["event"]): e for e in events}


def test_lmdeploy_and_stdlib_loggers_come_out_as_json_lines() -> None:
    """LMDeploy configures its logger after lmdq did (as at pipeline creation): its stdout handler is refused,
    INFO is kept, and a stdlib exception is one line with the traceback in a field."""
    events, _ = _run("""
        import logging
        from lmdeploy.utils import get_logger
        lm = get_logger('lmdeploy')
        lm.info('lmdeploy info %d', 1)
        lm.warning('lmdeploy warning')
        logging.getLogger('lmdeploy').error('lmdeploy error')
        other = logging.getLogger('some.library')
        other.info('library info')
        other.warning('library warning')
        try:
            raise KeyError('Qz7 missing')
        except KeyError:
            other.exception('library failed')
        from lmdq.logs.config import get_logger as lmdq_logger
        lmdq_logger('lmdq.test').info('structlog line', n=3)
    """)
    got = _by_event(events)
    assert set(got) == {"lmdeploy info 1", "lmdeploy warning", "lmdeploy error", "library info",
                        "library warning", "library failed", "structlog line"}, events
    assert (got["lmdeploy info 1"]["level"], got["lmdeploy info 1"]["logger"]) == ("info", "lmdeploy")
    assert got["lmdeploy warning"]["level"] == "warning" and got["lmdeploy error"]["level"] == "error"
    assert (got["library info"]["level"], got["library info"]["logger"]) == ("info", "some.library")
    failed = got["library failed"]
    assert failed["level"] == "error" and "Traceback (most recent call last)" in failed["exception"]
    assert "KeyError: 'Qz7 missing'" in failed["exception"]
    assert got["structlog line"]["logger"] == "lmdq.test" and got["structlog line"]["n"] == 3


def test_a_library_configured_before_lmdq_is_taken_over() -> None:
    """Loggers a library set up earlier (own console handler, no propagation) are adopted at configuration,
    and warnings.warn() is a JSON line too."""
    head = """
        import logging, sys
        lib = logging.getLogger('transformers')
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter('[%(levelname)s] plain %(message)s'))
        lib.addHandler(h)
        lib.propagate = False
        from lmdq.logs.config import configure_logging
        configure_logging('json', 'INFO')
        lib.warning('transformers warning')
        lib.addHandler(logging.StreamHandler(sys.stderr))  # configured again later: refused
        lib.propagate = False
        logging.getLogger('transformers.models').info('child info')
        import warnings
        warnings.warn('deprecated knob')
    """
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(head)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    lines = (p.stdout + p.stderr).splitlines()
    docs = [json.loads(ln) for ln in lines]  # raises on a plain-text line
    got = _by_event(docs)
    assert [d["logger"] for d in docs] == ["transformers", "transformers.models", "py.warnings"], lines
    assert got["transformers warning"]["level"] == "warning" and got["child info"]["level"] == "info"
    assert "deprecated knob" in docs[2]["event"] and docs[2]["level"] == "warning"


def test_the_configured_level_applies_to_library_loggers() -> None:
    """LMDeploy sets its own logger to INFO; LMDQ_LOG_LEVEL=WARNING still drops its INFO lines."""
    events, _ = _run("""
        from lmdeploy.utils import get_logger
        lm = get_logger('lmdeploy')
        lm.info('dropped')
        lm.warning('kept')
        from lmdq.logs.config import get_logger as lmdq_logger
        lmdq_logger('lmdq.test').info('dropped too')
    """, level="WARNING")
    assert [e["event"] for e in events] == ["kept"]


def test_a_bad_level_is_a_setting_error() -> None:
    from lmdq.errors import BadSetting
    from lmdq.logs.config import configure_logging

    with pytest.raises(BadSetting, match="LMDQ_LOG_LEVEL"):
        configure_logging("json", "LOUD")


def test_a_worker_writes_only_json_lines(env: dict[str, str], tmp_path: Path) -> None:
    """The real worker (sim engine, burst, nothing queued): every line it writes, stdout and stderr together,
    is one JSON object naming its logger, its own warnings and INFO lines included."""
    from conftest import start_worker

    log = tmp_path / "worker.log"
    w = start_worker("--engine", "sim", "--served-model-name", "sim", "--burst", log=log,
                     env={**env, "LMDQ_LOG_FORMAT": "auto", "LMDQ_TP": "2"})  # tp: a setting sim does not take
    assert w.wait(120) == 0, log.read_text()
    docs = []
    for ln in log.read_text().splitlines():
        try:
            docs.append(json.loads(ln))
        except ValueError:
            pytest.fail(f"not a JSON line: {ln!r}")
    assert docs and all({"level", "event", "logger", "timestamp"} <= d.keys() for d in docs), docs
    levels = {d["level"] for d in docs}
    assert {"info", "warning"} <= levels, docs
