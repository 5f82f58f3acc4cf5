"""How one request of a ``stream`` call fails alone, while the call carries on.

Shared by the transformers engine and its guided-decoding helpers, which both reject requests as the
caller's fault (``bad_request``).
"""

from __future__ import annotations

from lmdq.contract import ErrorCode, FinishReason
from lmdq.worker.engines.base import EngineEvent

__all__ = ["BadRequest", "error_event"]


class BadRequest(ValueError):
    """The request itself is unusable (the caller's fault): reported as ``bad_request``."""


def error_event(
    index: int, code: ErrorCode, message: str, *, input_token_len: int = 0, generate_token_len: int = 0
) -> EngineEvent:
    """A final error event (the request fails alone; the call carries on)."""
    return EngineEvent(
        index=index,
        input_token_len=input_token_len,
        generate_token_len=generate_token_len,
        finish_reason=FinishReason.error,
        error_code=code,
        error_message=message,
    )
