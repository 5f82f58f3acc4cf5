"""Contract Results for one job attempt, built from its requests and the engine's stream events.

Every result of an attempt carries the same identity (model, backend, worker, attempt) and job
timings, so :class:`ResultBuilder` holds them once and the worker loop says only what differs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from lmdq.contract import (
    ContinuationScore,
    ErrorCode,
    ErrorInfo,
    FinishReason,
    JobPayload,
    Request,
    Result,
    ResultStatus,
    Timings,
    TokenLogprob,
    encode_embedding,
)
from lmdq.worker.engines.base import EngineEvent

__all__ = ["LiveRequest", "ResultBuilder", "final_status", "score_fields", "token_logprobs"]


@dataclass
class LiveRequest:
    """Per-request state while it streams."""

    req: Request
    text: list[str] = field(default_factory=list)
    input_len: int = 0
    gen_len: int = 0
    first_token_at: float | None = None
    last_partial: float = 0.0
    dirty: bool = False


@dataclass(frozen=True)
class ResultBuilder:
    """Stamps one job attempt's identity and timings on every Result of its requests."""

    payload: JobPayload
    model: str
    backend: str
    worker: str
    attempt: int
    enqueued_at: float | None
    started_at: float

    def build(self, req: Request, **kw: Any) -> Result:
        """A Result for ``req``; ``kw`` are Result fields plus ``first_token_at``/``finished_at``
        (the latter defaults to now)."""
        return Result(
            batch_id=self.payload.batch_id,
            custom_id=req.custom_id,
            index=req.index,
            model=self.model,
            backend=self.backend,
            worker=self.worker,
            attempt=self.attempt,
            endpoint=req.endpoint,
            timings=Timings(
                enqueued_at=self.enqueued_at,
                started_at=self.started_at,
                first_token_at=kw.pop("first_token_at", None),
                finished_at=kw.pop("finished_at", time.time()),
            ),
            **kw,
        )

    def partial(self, lv: LiveRequest) -> Result:
        """The in-progress snapshot of a streaming request: a progress hint, not an answer."""
        return self.build(
            lv.req,
            status=ResultStatus.in_progress,
            text="".join(lv.text),
            input_token_len=lv.input_len,
            generate_token_len=lv.gen_len,
            first_token_at=lv.first_token_at,
            finished_at=None,
        )

    def final(
        self,
        lv: LiveRequest,
        *,
        status: ResultStatus,
        reason: FinishReason,
        error: ErrorInfo | None,
        finished_at: float,
        logprobs: list[TokenLogprob] | None,
        tensors: dict[str, Any] | None,
        ev: EngineEvent | None = None,
    ) -> Result:
        """The answer of a request whose stream has ended."""
        return self.build(
            lv.req,
            status=status,
            text="".join(lv.text),
            finish_reason=reason,
            input_token_len=lv.input_len,
            generate_token_len=lv.gen_len,
            error=error,
            first_token_at=lv.first_token_at,
            finished_at=finished_at,
            logprobs=logprobs,
            tensors=tensors,
            **(score_fields(ev) if ev is not None and status is ResultStatus.completed else {}),
        )


def final_status(ev: EngineEvent, reason: FinishReason) -> tuple[ResultStatus, ErrorInfo | None]:
    """How a final event's finish reason reads as a result: an abort is a cancellation, an engine
    error a failure with the engine's code, anything else a completed answer."""
    if reason is FinishReason.abort:
        return ResultStatus.cancelled, None
    if reason is FinishReason.error:
        error = ErrorInfo(code=ev.error_code or ErrorCode.internal_error,
                          message=ev.error_message or "generation failed")
        return ResultStatus.failed, error
    return ResultStatus.completed, None


def token_logprobs(ev: EngineEvent) -> list[TokenLogprob] | None:
    """The engine's ``(token, logprob, top)`` triples as contract TokenLogprobs (None when not asked)."""
    return (
        [TokenLogprob(token_id=t, logprob=lp, top=list(top)) for t, lp, top in ev.logprobs]
        if ev.logprobs is not None
        else None
    )


def score_fields(ev: EngineEvent) -> dict[str, Any]:
    """The Result fields of a scoring request's final event (``scores`` / ``reward`` / ``embedding``); none for
    generation."""
    out: dict[str, Any] = {}
    if ev.scores is not None:
        out["scores"] = [ContinuationScore(logprob=lp, num_tokens=n, is_greedy=g) for lp, n, g in ev.scores]
    if ev.reward is not None:
        out["reward"] = ev.reward
    if ev.embedding is not None:
        out["embedding"] = encode_embedding(ev.embedding)
    return out
