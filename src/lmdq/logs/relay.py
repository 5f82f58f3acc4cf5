"""Every line a worker and its engine children write to stdout/stderr reaches the log as one JSON object.

Why a relay on the file descriptors: structlog and stdlib logging are JSON already (lmdq.logs.config), and tqdm
bars become events (lmdq.logs.tqdm_events), but a worker also hosts writers no Python logging sees: C++ and
CUDA libraries writing to fd 2 (torch's ``[W...]`` warnings, NCCL, Triton), ``print`` in a library, an
interpreter's last traceback, and the same in LMDeploy's engine process, which inherits the worker's
descriptors. Log collectors read a container's stdout/stderr line by line; one raw line breaks their
parsing. So, in JSON mode, the worker points its fds 1 and 2 at pipes (inherited by every child it
starts) and a thread copies them to the real streams: a line that is already a JSON object passes
unchanged, any other line is wrapped as ``{"event": text, "level", "logger": "stdout"|"stderr",
"timestamp", "foreign": true}`` (ANSI codes stripped, a line redrawn with carriage returns reduced to
what a terminal would show: its last part, URL credentials redacted).

Kept in-process (a thread), not a relay process: the worker's orphan reaper SIGKILLs every process below a
dead worker, and a relay process among them could be killed before it flushed. At exit the real streams
are put back and the thread drains what the pipes still hold (:func:`StdioRelay.close`, via atexit).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import sys
import threading
import time
from datetime import datetime, timezone

from lmdq.logs.redaction import redact_text

__all__ = ["StdioRelay", "install_relay", "render_line"]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Za-z0-9]")
#: a line longer than this without a newline is relayed as it is (a bar redrawn forever never ends its line)
_MAX_LINE = 1 << 20
#: how long close() waits for the pipes to drain (a child that still holds them never sends EOF)
_DRAIN_S = 2.0
_ERROR_PREFIXES = ("error", "Error", "ERROR", "Traceback", "FATAL", "Fatal", "CRITICAL")


def _is_json_object(text: str) -> bool:
    if not text.startswith("{"):
        return False
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def render_line(raw: bytes, stream: str) -> bytes:
    """One line as written (no newline) → what the log gets: JSON lines, each ending in a newline; b'' for a
    blank line. Segments separated by carriage returns that are JSON objects are kept; of the others
    only the last (what a terminal shows after a redraw) is wrapped."""
    text = raw.decode("utf-8", "replace")
    out: list[str] = []
    foreign = ""
    for seg in text.split("\r"):
        seg = _ANSI.sub("", seg).strip()
        if not seg:
            continue
        if _is_json_object(seg):
            out.append(seg)
        else:
            foreign = seg
    if foreign:
        level = "info" if stream == "stdout" else "error" if foreign.startswith(_ERROR_PREFIXES) else "warning"
        out.append(json.dumps({"event": redact_text(foreign), "level": level, "logger": stream,
                               "timestamp": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z"),
                               "foreign": True}, ensure_ascii=False))
    return "".join(s + "\n" for s in out).encode("utf-8", "replace")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        except OSError:
            return  # the real stream is gone (a closed terminal): nothing left to log to
        view = view[n:]


class StdioRelay:
    """Pipes behind fds 1 and 2 and the thread that relays them (see the module docstring)."""

    def __init__(self) -> None:
        self._saved: dict[int, int] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False

    def start(self) -> None:
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            with contextlib.suppress(Exception):
                (sys.stdout if fd == 1 else sys.stderr).flush()
            real = os.dup(fd)  # not inheritable: children write to the pipe, never past it
            r, w = os.pipe()
            os.dup2(w, fd)  # inheritable: the engine's processes write into the same pipe
            os.close(w)
            self._saved[fd] = real
            t = threading.Thread(target=self._pump, args=(r, real, stream), daemon=True,
                                 name=f"lmdq-log-relay-{stream}")
            t.start()
            self._threads.append(t)
        with contextlib.suppress(Exception):
            sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        atexit.register(self.close)

    @staticmethod
    def _pump(r: int, out: int, stream: str) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(r, 65536)
            except InterruptedError:
                continue
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            if len(buf) > _MAX_LINE:
                lines.append(buf)
                buf = b""
            data = b"".join(render_line(line, stream) for line in lines)
            if data:
                _write_all(out, data)
        if buf:
            _write_all(out, render_line(buf, stream))
        os.close(r)

    def close(self) -> None:
        """Put the real streams back and let the relay drain (EOF once no process holds the pipes)."""
        if self._closed:
            return
        self._closed = True
        for fd, real in self._saved.items():
            with contextlib.suppress(Exception):
                (sys.stdout if fd == 1 else sys.stderr).flush()
            os.dup2(real, fd)
        end = time.monotonic() + _DRAIN_S
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))


_relay: StdioRelay | None = None


def install_relay() -> StdioRelay:
    """Relay this process's fds 1 and 2 (and its future children's) as JSON lines. Idempotent."""
    global _relay
    if _relay is None:
        _relay = StdioRelay()
        _relay.start()
    return _relay
