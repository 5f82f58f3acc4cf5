"""tqdm progress bars as structured log events, never as terminal text.

Why: LMDeploy (``Loading weights from safetensors``, ``Warming up decoding``) and transformers
(checkpoint and GGUF loading) draw tqdm bars straight onto stderr, with carriage returns and ANSI
codes: a log collector reading a worker's output gets raw lines beside the JSON ones (found on the
H200, issue 27). A worker's start-up still deserves progress, so instead of silencing the bars
every bar becomes ``progress`` events of logger ``tqdm`` (``desc``, ``n``, ``total``, ``unit``,
``elapsed_s``, ``rate``): its first draw, then at most one every :data:`PROGRESS_EVERY_S`, and one
when it closes (``done: true``).

How: the methods of ``tqdm.std.tqdm`` are replaced in place, so every subclass (``tqdm.auto``,
``tqdm.asyncio``, huggingface_hub's and transformers' wrappers) and every module that imported the
class before this ran are covered. A bar's own output stream is a sink that discards what tqdm
still writes to it directly (newlines on close, cursor moves).
"""

from __future__ import annotations

import io
import time
from typing import Any

import structlog

__all__ = ["PROGRESS_EVERY_S", "install"]

#: a bar emits at most one event this often (plus its first and its last)
PROGRESS_EVERY_S = 5.0

_log = structlog.get_logger("tqdm")


class _Discard(io.TextIOBase):
    """What a bar writes to directly: nothing reaches the process's streams."""

    def write(self, s: str) -> int:
        return len(s)

    def isatty(self) -> bool:
        return False


_SINK = _Discard()


def _fields(bar: Any) -> dict[str, Any]:
    d = bar.format_dict
    out: dict[str, Any] = {"desc": (d.get("prefix") or "").rstrip(": ") or None, "n": d.get("n"),
                           "total": d.get("total"), "unit": d.get("unit"),
                           "elapsed_s": round(float(d.get("elapsed") or 0.0), 2)}
    rate = d.get("rate")
    if rate is None and out["elapsed_s"] and d.get("n"):
        rate = d["n"] / d["elapsed"]
    if rate is not None:
        out["rate"] = round(float(rate), 2)
    return out


def _emit(bar: Any, *, done: bool) -> None:
    try:
        _log.info("progress", done=done, **_fields(bar))
    except Exception:  # noqa: BLE001 - a progress event must never break the library's loop
        pass


def install() -> bool:
    """Turn every tqdm bar of this process into ``progress`` events. Idempotent; False without tqdm."""
    try:
        import tqdm.std as std
    except ImportError:
        return False
    cls: Any = std.tqdm
    if getattr(cls, "_lmdq_events", False):
        return True
    orig_init, orig_close = cls.__init__, cls.close

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 (the method it replaces)
        if len(args) > 4:  # tqdm(iterable, desc, total, leave, file, ...): a positional file
            args = (*args[:4], _SINK, *args[5:])
        else:
            kwargs["file"] = _SINK
        if kwargs.get("disable") is None:  # None means "off unless a terminal": the sink is none; keep bars on
            kwargs["disable"] = False
        self._lmdq_last = float("-inf")
        orig_init(self, *args, **kwargs)

    def display(self: Any, msg: Any = None, pos: Any = None) -> bool:
        now = time.monotonic()
        if now - getattr(self, "_lmdq_last", float("-inf")) >= PROGRESS_EVERY_S:
            self._lmdq_last = now
            _emit(self, done=False)
        return True

    def close(self: Any) -> None:
        if not getattr(self, "disable", True) and not getattr(self, "_lmdq_closed", False):
            self._lmdq_closed = True
            _emit(self, done=True)
        orig_close(self)

    def status_printer(_file: Any) -> Any:  # tqdm's own printer writes to the stream: ours draws nothing
        return lambda _s: None

    cls.__init__ = __init__
    cls.display = display
    cls.close = close
    cls.status_printer = staticmethod(status_printer)
    cls._lmdq_events = True
    return True
