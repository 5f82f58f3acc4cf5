"""Write a batch's results in input order: lmdq's own records or OpenAI Batch output lines."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from lmdq.contract import Batch, Endpoint, Result, ResultStatus
from lmdq.store import ResultStore

__all__ = ["iter_lmdq_lines", "iter_openai_lines", "to_openai"]


def _records(store: ResultStore, batch: Batch, *, partial: bool) -> Iterator[tuple[int, bytes | None]]:
    """Full records in input order; with a results URL, compact Redis records are replaced by the
    full ones from the batch's shards (jobs not flushed yet are still whole in Redis)."""
    pairs = store.iter_results(batch.id, batch.request_counts.total, partial=partial)
    if not batch.results_url:
        return pairs
    from lmdq.sink import resolve_results

    return resolve_results(pairs, batch.results_url, batch.id)


def iter_lmdq_lines(store: ResultStore, batch: Batch, *, partial: bool = True) -> Iterator[bytes]:
    """One JSON line per request, in input order; requests with no record yet are skipped."""
    for _, raw in _records(store, batch, partial=partial):
        if raw is not None:
            yield raw + b"\n"


def to_openai(r: Result) -> dict[str, Any]:
    """Map an lmdq result to an OpenAI Batch output line (chat.completion / text_completion)."""
    created = int(r.timings.finished_at or r.timings.started_at or 0)
    usage = {
        "prompt_tokens": r.input_token_len,
        "completion_tokens": r.generate_token_len,
        "total_tokens": r.input_token_len + r.generate_token_len,
    }
    rid = f"{r.batch_id}-{r.index}"
    finish = r.finish_reason.value if r.finish_reason else None
    if r.status is not ResultStatus.completed:
        err = r.error.model_dump() if r.error else {"code": r.status.value, "message": f"request {r.status.value}"}
        return {"id": rid, "custom_id": r.custom_id, "response": None, "error": err}
    if r.endpoint is Endpoint.completion:
        body: dict[str, Any] = {
            "id": f"cmpl-{rid}",
            "object": "text_completion",
            "created": created,
            "model": r.model,
            "choices": [{"index": 0, "text": r.text, "logprobs": None, "finish_reason": finish}],
            "usage": usage,
        }
    else:
        body = {
            "id": f"chatcmpl-{rid}",
            "object": "chat.completion",
            "created": created,
            "model": r.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": r.text},
                    "logprobs": None,
                    "finish_reason": finish,
                }
            ],
            "usage": usage,
        }
    return {
        "id": rid,
        "custom_id": r.custom_id,
        "response": {"status_code": 200, "request_id": rid, "body": body},
        "error": None,
    }


def iter_openai_lines(store: ResultStore, batch: Batch) -> Iterator[bytes]:
    """OpenAI Batch output: final results only (partials are not answers yet)."""
    for _, raw in _records(store, batch, partial=False):
        if raw is not None:
            yield json.dumps(to_openai(Result.model_validate_json(raw)), ensure_ascii=False).encode() + b"\n"
