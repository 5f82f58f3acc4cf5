"""Redis replies read as data: they are untrusted, so decoding them never raises."""

from __future__ import annotations

from typing import Any

__all__ = ["reply_text"]


def reply_text(value: Any) -> str:
    """A Redis reply as text: bad UTF-8 is replaced, never raised (a key or field written by anyone with
    access to Redis must not crash a reader); clients made with ``decode_responses`` already return str."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
