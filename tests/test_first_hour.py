"""docs/first-hour.md (issues 26 and 45) runs as written, and every line it prints fits an 80-column
terminal: the transcript's own ``$`` commands, in order, in one bash on a pseudo-terminal of 80 columns
(``COLUMNS=80``, ``stty cols 80``), against a real redis-server with the sim worker.

Widths are measured as a terminal shows them: escape sequences take no column, and a line a live
display redraws (``\\r``) is measured frame by frame. The page's own output lines are held to 80 too.
"""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOC = ROOT / "docs" / "first-hour.md"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def _transcript() -> list[str]:
    """The lines of the page's console block (commands and the output shown for them)."""
    text = DOC.read_text()
    block = text.split("```console\n", 1)[1].split("\n```", 1)[0]
    return block.splitlines()


def _frames(raw: str) -> list[str]:
    """Each line as shown, a redrawn line once per frame, escape sequences removed."""
    out: list[str] = []
    for line in raw.split("\n"):
        out += [ANSI.sub("", f) for f in line.split("\r")]
    return [f for f in out if f.strip()]


def _run_on_a_tty(script: Path, env: dict[str, str], cwd: Path, timeout_s: float) -> tuple[int, str]:
    leader, follower = pty.openpty()
    p = subprocess.Popen(["bash", str(script)], env=env, cwd=cwd, stdin=follower, stdout=follower, stderr=follower,
                         start_new_session=True)
    os.close(follower)
    out = b""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if select.select([leader], [], [], 0.2)[0]:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the terminal closed: every process on it has exited
                    break
                if not chunk:
                    break
                out += chunk
            elif p.poll() is not None:
                break
        else:
            raise AssertionError(f"the transcript did not finish in {timeout_s}s:\n{out.decode(errors='replace')}")
    finally:
        os.close(leader)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
    return p.returncode, out.decode(errors="replace")


def test_the_page_shows_no_line_over_80_columns() -> None:
    long = [ln for ln in _transcript() if len(ln) > 80]
    assert not long, long


@pytest.mark.skipif(shutil.which("jq") is None, reason="the page's commands use jq, not installed here")
def test_the_transcript_runs_as_written_and_fits_80_columns(redis_url: str, prefix: str, tmp_path: Path) -> None:
    commands: list[str] = []
    for ln in _transcript():  # "$ " starts a command, "> " continues it (the shell's own prompts)
        if ln.startswith("$ "):
            commands.append(ln[2:])
        elif ln.startswith("> "):
            commands[-1] += "\n" + ln[2:]
    assert len(commands) >= 12
    script = tmp_path / "first-hour.sh"
    script.write_text("set -e\nstty cols 80 rows 40\n" + "\n".join(commands) + "\n")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
           "LMDQ_REDIS_URL": redis_url, "LMDQ_KEY_PREFIX": prefix, "LMDQ_HEALTH_PORT": "0",
           "LMDQ_LOG_LEVEL": "WARNING", "COLUMNS": "80", "LINES": "40", "TERM": "xterm-256color",
           "PYTHONUNBUFFERED": "1"}
    rc, raw = _run_on_a_tty(script, env, tmp_path, timeout_s=120)
    shown = _frames(raw)
    assert rc == 0, raw
    wide = [(len(f), f) for f in shown if len(f) > 80]
    assert not wide, wide
    # it did what the page says: the finish-order lines, the batch's end, input order kept by --in-order
    assert sum(1 for f in shown if f.startswith('{"index":')) == 14, shown
    assert any("completed" in f and "total=48 completed=48" in f for f in shown), shown
    assert "true" in shown, shown
    assert any(f.startswith("hint: no live worker serves model 'sim'") for f in shown), shown
