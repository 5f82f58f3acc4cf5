"""structlog set-up: JSON lines in containers (no TTY), pretty console on a terminal."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

from lmdq.redaction import redact_text

__all__ = ["configure_logging", "get_logger"]


def _redact(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Never let a password in a URL reach a log line (any scheme: redis, s3, http...)."""
    for k, v in event.items():
        if isinstance(v, str) and "://" in v:
            event[k] = redact_text(v)
    return event


def configure_logging(fmt: str = "auto", level: str = "INFO") -> None:
    """Configure structlog once per process. ``fmt``: auto | json | console."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: Any = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info if use_json else structlog.processors.StackInfoRenderer(),
            _redact,  # after format_exc_info: a traceback's text may quote a URL too
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str | None = None, **bind: Any) -> Any:
    return structlog.get_logger(name).bind(**bind) if bind else structlog.get_logger(name)
