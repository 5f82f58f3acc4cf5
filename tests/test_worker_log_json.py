"""Every line a worker and its children write is one JSON object (issue 27), tqdm bars and raw writers included.

The relay (lmdq.logs.relay) is checked in a real process against every kind of writer a worker hosts: a
structlog line, ``print``, a write straight to fd 2 (what C++/CUDA libraries do), a child process that
inherits the descriptors, and a tqdm bar (lmdq.logs.tqdm_events). Then the real worker, transformers engine on
the embedded SmolLM2 (whose loading draws tqdm bars), from start to stop, on a terminal (a pty) and off one.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmdq.logs.relay import render_line
from tests.conftest import ROOT, run_cli


def _records(text: str) -> list[dict]:  # type: ignore[type-arg]
    out = []
    for ln in text.replace("\r\n", "\n").split("\n"):
        if not ln.strip():
            continue
        try:
            d = json.loads(ln)
        except ValueError:
            raise AssertionError(f"a line that is not JSON: {ln!r}") from None
        assert isinstance(d, dict) and {"event", "level", "logger", "timestamp"} <= d.keys(), d
        out.append(d)
    return out


def test_render_line_keeps_json_and_wraps_the_rest() -> None:
    assert render_line(b'{"event": "x", "level": "info"}', "stderr") == b'{"event": "x", "level": "info"}\n'
    assert render_line(b"   ", "stderr") == b""
    bar = b"Loading:  10%|\xe2\x96\x88 | 1/10\rLoading:  20%|\xe2\x96\x88\xe2\x96\x88 | 2/10\r"
    (d,) = _records(render_line(bar, "stderr").decode())
    assert d["event"].startswith("Loading:  20%") and d["foreign"] is True and d["level"] == "warning"
    (d,) = _records(render_line(b"\x1b[31mTraceback (most recent call last):\x1b[0m", "stderr").decode())
    assert d["event"] == "Traceback (most recent call last):" and d["level"] == "error"
    (d,) = _records(render_line(b"connecting to redis://u:hunter2@h:6379/0", "stdout").decode())
    assert "hunter2" not in d["event"] and d["level"] == "info" and d["logger"] == "stdout"
    both = _records(render_line(b'bar 50%\r{"event": "kept", "level": "info", "logger": "a", "timestamp": "t"}',
                                "stderr").decode())
    assert [d["event"] for d in both] == ["kept", "bar 50%"]


_WRITERS = r"""
import os, subprocess, sys
from lmdq.logs.relay import install_relay
from lmdq.logs.config import configure_logging, get_logger
from lmdq.logs.tqdm_events import install
install_relay()
configure_logging("json", "INFO")
install()
get_logger("lmdq.test").info("structlog line", n=1)
print("a print to stdout")
os.write(2, b"raw bytes on fd 2, as a C++ library writes them\n")
subprocess.run([sys.executable, "-c", "import os; os.write(2, b'a child writes fd 2\\n'); print('child stdout')"])
from tqdm import tqdm
for _ in tqdm(range(3), desc="Warming up decoding"):
    pass
sys.stderr.write("no newline at exit")
"""


def test_every_writer_of_a_relayed_process_comes_out_as_json() -> None:
    p = subprocess.run([sys.executable, "-c", _WRITERS], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert p.returncode == 0, p.stderr
    out, err = _records(p.stdout), _records(p.stderr)
    events = {d["event"]: d for d in out + err}
    for text in ("a print to stdout", "child stdout"):
        assert events[text]["logger"] == "stdout" and events[text] in out
    for text in ("raw bytes on fd 2, as a C++ library writes them", "a child writes fd 2", "no newline at exit"):
        assert events[text]["logger"] == "stderr" and events[text] in err
    assert events["structlog line"]["n"] == 1
    bars = [d for d in err if d["logger"] == "tqdm"]
    assert bars and bars[-1]["desc"] == "Warming up decoding" and bars[-1]["done"] is True and bars[-1]["n"] == 3


def _read_pty(fd: int, proc: subprocess.Popen[bytes], timeout_s: float) -> bytes:
    buf = b""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        r, _, _ = select.select([fd], [], [], 0.5)
        if r:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: every writer closed the pty
                break
            if not chunk:
                break
            buf += chunk
        elif proc.poll() is not None:
            break
    return buf


@pytest.mark.model
@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "pty"])
def test_transformers_worker_log_is_json_from_start_to_stop(env: dict[str, str], tmp_path: Path,
                                                            terminal: bool) -> None:
    """The real worker, transformers engine on the embedded model (its loading draws tqdm bars), a batch
    submitted, --burst: its whole output is JSON lines, the bars as ``progress`` events."""
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": f"Say {i}."}) + "\n" for i in range(3)))
    sub = run_cli("lmdq.producer", "submit", str(f), "--model", "smollm2-135m-instruct", "--allow-unknown-model",
                  "--max-new-tokens", "4", env=env)
    assert sub.returncode == 0, sub.stderr
    cmd = [sys.executable, "-m", "lmdq.worker", "--engine", "transformers", "--burst"]
    wenv = {**env, "LMDQ_LOG_FORMAT": "json", "TERM": "xterm"}
    if terminal:
        leader, follower = pty.openpty()
        w = subprocess.Popen(cmd, env=wenv, cwd=ROOT, stdin=follower, stdout=follower, stderr=follower)
        os.close(follower)
        try:
            text = _read_pty(leader, w, 600).decode("utf-8", "replace")
        finally:
            os.close(leader)
        assert w.wait(60) == 0, text[-3000:]
    else:
        w = subprocess.Popen(cmd, env=wenv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        raw, _ = w.communicate(timeout=600)
        text = raw.decode("utf-8", "replace")
        assert w.returncode == 0, text[-3000:]
    docs = _records(text)
    events = [d["event"] for d in docs]
    assert events[0] == "connected to redis" and events[-1] == "worker stopped", events
    bars = [d for d in docs if d["logger"] == "tqdm"]
    assert bars and all(d["event"] == "progress" for d in bars), events  # the bars were drawn, as events
    assert any(d.get("done") for d in bars)
    assert next(d for d in docs if d["event"] == "worker stopped")["results"] == 3


def test_on_a_terminal_every_worker_line_fits_80_columns_and_internals_stay_at_debug(env: dict[str, str],
                                                                                     tmp_path: Path) -> None:
    """Issue 45: on a terminal (auto format: not JSON) the worker's start-up lines ran 105-369 columns and
    showed internals (``heap frozen objects=432381``). Each line now fits the terminal's width, wrapped,
    with every value kept; the heap freeze is a debug line."""
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": f"Say {i}."}) + "\n" for i in range(3)))
    sub = run_cli("lmdq.producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", env=env)
    assert sub.returncode == 0, sub.stderr
    wenv = {k: v for k, v in env.items() if k != "LMDQ_LOG_FORMAT"}
    wenv.update({"COLUMNS": "80", "TERM": "xterm"})
    leader, follower = pty.openpty()
    w = subprocess.Popen([sys.executable, "-m", "lmdq.worker", "--engine", "sim", "--burst"], env=wenv, cwd=ROOT,
                         stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    try:
        text = _read_pty(leader, w, 120).decode("utf-8", "replace")
    finally:
        os.close(leader)
    assert w.wait(60) == 0, text[-3000:]
    lines = [ln.rstrip("\r") for ln in text.split("\n") if ln.strip()]
    assert any("worker started" in ln for ln in lines) and any("worker stopped" in ln for ln in lines), text
    assert not any(ln.lstrip().startswith("{") for ln in lines), text  # a person's lines, not JSON
    assert all(len(ln) <= 80 for ln in lines), [ln for ln in lines if len(ln) > 80]
    assert "heap frozen" not in text and "\x1b[" not in text, text
    assert "queues=" in text and "results=3" in text.replace("\n    ", " "), text  # wrapped, nothing cut


@pytest.mark.model
def test_the_transformers_worker_on_an_80_column_terminal_fits_it_tqdm_bars_included(env: dict[str, str],
                                                                                    tmp_path: Path) -> None:
    """Issue 45: the start-up lines of the real (transformers) worker ran to 369 columns on a terminal, a
    tqdm record among them. The bars' records and the engine's config dict fit 80 columns too, wrapped."""
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"custom_id": "r0", "prompt": "Say 0."}) + "\n")
    sub = run_cli("lmdq.producer", "submit", str(f), "--model", "smollm2-135m-instruct", "--allow-unknown-model",
                  "--max-new-tokens", "2", env=env)
    assert sub.returncode == 0, sub.stderr
    wenv = {k: v for k, v in env.items() if k != "LMDQ_LOG_FORMAT"}
    wenv.update({"COLUMNS": "80", "TERM": "xterm"})
    leader, follower = pty.openpty()
    w = subprocess.Popen([sys.executable, "-m", "lmdq.worker", "--engine", "transformers", "--burst"], env=wenv,
                         cwd=ROOT, stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    try:
        text = _read_pty(leader, w, 600).decode("utf-8", "replace")
    finally:
        os.close(leader)
    assert w.wait(60) == 0, text[-3000:]
    frames = [fr for ln in text.split("\n") for fr in ln.split("\r") if fr.strip()]
    assert any("Loading weights" in fr for fr in frames) and any("engine loaded" in fr for fr in frames), text
    assert all(len(fr) <= 80 for fr in frames), [fr for fr in frames if len(fr) > 80]
    assert "heap frozen" not in text and "\x1b[" not in text and "results=1" in text, text
