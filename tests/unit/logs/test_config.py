"""lmdq.logs.config: a deferred set-up (``configure_logging(defer=True)``, lmdq-producer's commands) renders
every line as the eager one does, and imports structlog only when a line is written (issue 49)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROGRAM = """
import logging, sys
from lmdq.logs.config import configure_logging, get_logger
configure_logging("json", "INFO", defer={defer})
print("structlog before:", "structlog" in sys.modules)
logging.getLogger("lmdq.x").debug("below the level")
print("structlog after a filtered record:", "structlog" in sys.modules)
logging.getLogger("lmdq.x").warning("stdlib %s", "line")
{more}
print("structlog after:", "structlog" in sys.modules)
"""


def _run(defer: bool, more: str = "") -> tuple[list[str], list[dict[str, object]]]:
    p = subprocess.run([sys.executable, "-c", PROGRAM.format(defer=defer, more=more)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines(), [json.loads(line) for line in p.stderr.splitlines()]


def _shape(lines: list[dict[str, object]]) -> list[tuple[object, ...]]:
    return [(d["event"], d["level"], d["logger"], sorted(d)) for d in lines]


def test_deferred_imports_structlog_at_the_first_line_it_writes() -> None:
    out, lines = _run(defer=True)
    assert out == ["structlog before: False", "structlog after a filtered record: False", "structlog after: True"]
    assert _shape(lines) == [("stdlib line", "warning", "lmdq.x", ["event", "level", "logger", "timestamp"])]


def test_eager_imports_it_at_once() -> None:
    out, _ = _run(defer=False)
    assert out[0] == "structlog before: True"


@pytest.mark.parametrize("defer", [True, False])
def test_deferred_and_eager_write_the_same_lines(defer: bool) -> None:
    """get_logger finishes a deferred set-up: structlog's own calls are rendered by the same handler."""
    more = "get_logger('lmdq.y').info('structlog line', url='redis://u:secret@h:6379/0')"
    _, lines = _run(defer=defer, more=more)
    assert _shape(lines) == [("stdlib line", "warning", "lmdq.x", ["event", "level", "logger", "timestamp"]),
                             ("structlog line", "info", "lmdq.y", ["event", "level", "logger", "timestamp", "url"])]
    assert "secret" not in json.dumps(lines[1])  # redacted as ever
