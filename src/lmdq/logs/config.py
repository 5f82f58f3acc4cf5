"""Logging set-up: every line a process writes through structlog *or* stdlib ``logging`` is one JSON
object (``level``, ``event``, ``logger``, ``timestamp``) in containers, a pretty console line on a
terminal.

Why one root handler: LMDeploy, transformers and lmdq's own engine modules log through stdlib
``logging``. Left alone their records came out as plain text beside structlog's JSON (log pipelines
cannot parse them) or were dropped below WARNING. So structlog's own calls are handed to stdlib too
(``structlog.stdlib.LoggerFactory``) and a single root handler renders both kinds with structlog's
``ProcessorFormatter``: one formatter, one stream, one level.

Why the logger takeover: LMDeploy's ``lmdeploy.utils.get_logger`` attaches its own stdout
``StreamHandler`` (colour text format) to the ``lmdeploy`` logger and sets ``propagate = False``; it
does so whenever first called, which is typically inside pipeline creation, long after
:func:`configure_logging` ran. transformers does the same for ``transformers``. Re-doing the clean-up
"after engine load" would leave a window and needs every caller to remember it, so those loggers are
switched to :class:`_AdoptedLogger`, which refuses console handlers and never stops propagating,
whenever they are configured.

Why structlog may come late: importing it costs ~50 ms (it pulls rich and pygments for its console
tracebacks), more than a read-only command's whole start-up. ``configure_logging(..., defer=True)``
(``lmdq-producer``'s commands) sets up the root handler, levels and warnings capture at once, without
structlog, and builds structlog's formatter from the first record that reaches the handler, or the
first :func:`get_logger`: every line is rendered as before, and ``status`` (which logs nothing) never
imports structlog (issue 49).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, TextIO

from lmdq.errors import BadSetting
from lmdq.logs.redaction import redact_text

if TYPE_CHECKING:
    from structlog.stdlib import ProcessorFormatter

__all__ = ["ADOPTED_LOGGERS", "CHILD_HOOK_DIR", "adopt_foreign_loggers", "configure_logging", "get_logger",
           "route_child_logs"]

#: holds the ``sitecustomize.py`` that configures logging in spawned children (route_child_logs)
CHILD_HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child_logging")

#: Libraries known to attach their own console handler (and stop propagation) when they first log.
ADOPTED_LOGGERS = ("lmdeploy", "transformers", "torch", "triton")


def _redact(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Never let a password in a URL reach a log line (any scheme: redis, s3, http...)."""
    for k, v in event.items():
        if isinstance(v, str) and "://" in v:
            event[k] = redact_text(v)
    return event


def _is_console(handler: logging.Handler) -> bool:
    """A handler that prints to the process's stdout/stderr (a library's own), not a file a user asked for
    (``LMDEPLOY_LOG_FILE`` keeps working) and not ours."""
    if isinstance(handler, (_RootHandler, logging.FileHandler)):
        return False
    return isinstance(handler, logging.StreamHandler) and handler.stream in (
        sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)


class _AdoptedLogger(logging.Logger):
    """A library's logger that stays routed through the root handler whatever the library does later:
    console handlers it adds are dropped, ``propagate = False`` is ignored. Its records are not lost, they
    reach the root handler (JSON) instead of the library's text handler."""

    def addHandler(self, hdlr: logging.Handler) -> None:  # noqa: N802 (stdlib's name)
        if not _is_console(hdlr):
            super().addHandler(hdlr)

    @property
    def propagate(self) -> bool:
        return True

    @propagate.setter
    def propagate(self, _value: bool) -> None:
        """Ignored: the root handler is where this logger's records are rendered."""


class _RootHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The one handler: writes to whatever ``sys.stderr`` is *now* (a test's capture, a redirected stream),
    never a stream closed since configuration.

    A subclass on purpose: ``lmdeploy.utils.get_logger`` lowers every root handler whose type *is*
    ``logging.StreamHandler`` to ERROR ("handle duplicate logs"), which would drop INFO and WARNING."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        #: (JSON?, level) of a deferred set-up (configure_logging(defer=True)): structlog is set up, and
        #: this handler's formatter built, by the first record it formats
        self.pending: tuple[bool, int] | None = None

    def format(self, record: logging.LogRecord) -> str:
        self.finish_setup()
        return super().format(record)

    def finish_setup(self) -> None:
        """Build the formatter (and configure structlog) of a deferred set-up; nothing if there is none."""
        if self.pending is not None:
            use_json, lvl = self.pending
            self.pending = None
            self.setFormatter(_setup_structlog(use_json, lvl))

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        """The stream is always the current ``sys.stderr``."""


def adopt_foreign_loggers(names: tuple[str, ...] = ADOPTED_LOGGERS) -> None:
    """Route every stdlib logger through the root handler: drop libraries' console handlers, re-enable
    propagation, and keep ``names`` that way even when their library configures them later.

    Idempotent; :func:`configure_logging` calls it. ``logger.__class__`` is switched in place because
    modules hold references to the logger objects they got at import time."""
    for name in names:
        lg = logging.getLogger(name)
        if type(lg) is logging.Logger:
            lg.__class__ = _AdoptedLogger
    for lg in [logging.getLogger(n) for n in list(logging.Logger.manager.loggerDict)]:
        for h in [h for h in lg.handlers if _is_console(h)]:
            lg.removeHandler(h)
        lg.propagate = True


class TerminalRenderer:
    """A log line for a person at a terminal: ``HH:MM:SS level event key=value ...`` wrapped to the
    terminal's width (``COLUMNS``, else the terminal's, else 80), continuation lines indented, nothing
    cut: every value is still there (issue 45: structlog's console lines ran 105-369 columns). No
    colour codes, so the width a line is measured at is the width it shows; containers and pipes get
    JSON (:func:`configure_logging`), which this never replaces."""

    def __init__(self, width: int | None = None) -> None:
        self.width = width

    def __call__(self, _logger: Any, _name: str, event: dict[str, Any]) -> str:
        import shutil
        import textwrap

        width = self.width or shutil.get_terminal_size((80, 24)).columns
        e = dict(event)
        stamp = str(e.pop("timestamp", ""))[11:19]
        level = str(e.pop("level", "")).lower()
        text = str(e.pop("event", ""))
        e.pop("logger", None)
        exc = e.pop("exception", None) or e.pop("stack", None)
        head = " ".join(x for x in (stamp, f"{level:<7}", text) if x)
        pairs = " ".join(f"{k}={v}" for k, v in e.items())
        out = textwrap.wrap(f"{head} {pairs}".rstrip(), width=max(width, 20), subsequent_indent="    ",
                            break_long_words=True, break_on_hyphens=False) or [""]
        if exc:
            for line in str(exc).splitlines():
                out += textwrap.wrap(line, width=max(width, 20), subsequent_indent="    ") or [""]
        return "\n".join(out)


def configure_logging(fmt: str = "auto", level: str = "INFO", *, defer: bool = False) -> None:
    """Configure structlog and stdlib logging once per process. ``fmt``: auto | json | console
    (auto: JSON unless stderr is a terminal). Calling it again replaces the previous set-up.

    ``defer``: structlog is imported and configured by the first record the root handler formats, or
    the first :func:`get_logger` (see the module's docstring); a process that never logs never imports
    it. Not for a process whose code calls ``structlog.get_logger`` itself: that logger would run on
    structlog's defaults until the first stdlib record."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        raise BadSetting(f"LMDQ_LOG_LEVEL: expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got {level!r}")
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, _RootHandler) or _is_console(h)]:
        root.removeHandler(h)
    handler = _RootHandler()
    handler.pending = (use_json, lvl)
    handler.setLevel(lvl)  # records propagated from a library's logger skip root's level, not the handler's
    root.addHandler(handler)
    root.setLevel(lvl)
    logging.captureWarnings(True)  # warnings.warn() from libraries: a JSON line too, logger "py.warnings"
    adopt_foreign_loggers()
    if not defer:
        # after the adoption: structlog's LoggerFactory sets logging's logger class, and only plain
        # logging.Logger objects are adopted (a library's logger made later is then structlog's class)
        handler.finish_setup()


def _setup_structlog(use_json: bool, lvl: int) -> ProcessorFormatter:
    """Configure structlog (its own calls handed to stdlib) and return the root handler's formatter."""
    import structlog

    renderer: Any = structlog.processors.JSONRenderer() if use_json else TerminalRenderer()
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    # Both kinds of records get the same fields; structlog's own calls get them before wrap_for_formatter,
    # stdlib records (from the root handler) in foreign_pre_chain.
    common: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        timestamper,
    ]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=common,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            # A stdlib traceback becomes the "exception" field of the same JSON line.
            structlog.processors.format_exc_info if use_json else structlog.processors.StackInfoRenderer(),
            _redact,  # after format_exc_info: a traceback's text may quote a URL too
            renderer,
        ],
    )
    structlog.configure(
        processors=[*common, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
    return formatter


def route_child_logs(fmt: str = "auto", level: str = "INFO") -> None:
    """Make the Python processes this one spawns log like it (JSON lines on stderr).

    LMDeploy's engine process (``enable_mp_engine``) is started with multiprocessing's ``spawn``: a
    fresh interpreter, which :func:`configure_logging` in this process never reaches. This puts
    lmdq's start-up hook (``src/lmdq/logs/_child_logging/sitecustomize.py``) first on the children's
    ``PYTHONPATH`` and hands them the format and level in ``LMDQ_CHILD_LOG_FORMAT`` /
    ``LMDQ_CHILD_LOG_LEVEL``; this process itself is unaffected (``PYTHONPATH`` is read at start).
    ``auto`` is decided here, where the terminal is known. Idempotent."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    os.environ["LMDQ_CHILD_LOG_FORMAT"] = "json" if use_json else "console"
    os.environ["LMDQ_CHILD_LOG_LEVEL"] = level
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != CHILD_HOOK_DIR]
    os.environ["PYTHONPATH"] = os.pathsep.join([CHILD_HOOK_DIR, *paths])


def get_logger(name: str | None = None, **bind: Any) -> Any:
    """A structlog logger; a deferred set-up (``configure_logging(defer=True)``) is finished first, so its
    lines render as configured."""
    import structlog

    for h in logging.getLogger().handlers:
        if isinstance(h, _RootHandler):
            h.finish_setup()
    return structlog.get_logger(name).bind(**bind) if bind else structlog.get_logger(name)
