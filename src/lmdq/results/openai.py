"""A batch's results as OpenAI Batch output lines (``results --format openai``, the HTTP API's output and
error files, ``Batch.lines("openai")``), in input order, read through the one reader
(:class:`lmdq.results.reader.ResultReader`); lmdq's own JSONL lines are :func:`lmdq.results.export.iter_lmdq_lines`."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lmdq.contract import (
    Batch,
    Endpoint,
    ErrorCode,
    FinishReason,
    Result,
    ResultStatus,
    TokenLogprob,
    decode_embedding,
)
from lmdq.results.reader import ResultReader
from lmdq.results.store import ResultStore

__all__ = ["BatchUsage", "is_openai_error", "iter_openai", "openai_ids", "openai_token", "to_openai"]


#: OpenAI's Batch API codes for requests that never ran; lmdq's ``failed`` results keep lmdq's own code
#: (``engine_error``, ``unsupported_feature``, ...) since they say what went wrong with that request.
_OPENAI_CODES = {
    ResultStatus.cancelled: (ErrorCode.batch_cancelled, "This request was cancelled before it ran."),
    ResultStatus.expired: (ErrorCode.batch_expired,
                           "This request could not be executed before the completion window expired."),
}


#: a request the engine had started when the cancel came (its stream ended ``abort``) is worded as such
_CANCELLED_RUNNING = "This request was cancelled while it was running ({n} tokens generated); its output was discarded."


def openai_ids(batch_id: str, index: int) -> tuple[str, str]:
    """A request's ``(id, request_id)`` as OpenAI spells them: ``batch_req_<hex>`` and ``req_<hex>``.

    Derived from the lmdq batch and the request's index, so the same request has the same ids on every
    export (the CLI's ``--format openai`` and the HTTP API's files agree); hashed, so no line names an
    internal batch (OpenAI's ids are opaque: a client must not parse them, and lmdq's need not be)."""
    h = hashlib.blake2b(f"{batch_id}\0{index}".encode(), digest_size=24).hexdigest()
    return f"batch_req_{h[:32]}", f"req_{h[16:]}"


@dataclass
class BatchUsage:
    """Token totals of a batch's answered requests: OpenAI's ``Batch.usage`` (``BatchUsage``).

    Summed over the lines that go to the output file (completed requests; as OpenAI bills only
    those); ``cached_tokens`` is the prompt tokens the engine did not compute (served from its prefix
    cache or a shared prefill) where the engine said how many it computed."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0

    def add(self, r: Result) -> None:
        if is_openai_error(r):
            return
        self.input_tokens += r.input_token_len
        self.output_tokens += r.generate_token_len
        if r.prefill_token_len is not None:
            self.cached_tokens += max(0, r.input_token_len - r.prefill_token_len)

    def to_openai(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.input_tokens + self.output_tokens}


def openai_token(token_id: int) -> str:
    """OpenAI's ``token`` string for a token lmdq knows only by id.

    lmdq results carry token ids, not token text (the producer has no tokenizer, and the engines
    return ids), so ``token`` is vLLM's ``--return-tokens-as-token-ids`` spelling ``token_id:<id>``
    and ``bytes`` is null (OpenAI's "no bytes representation"); a client decodes ids with the model's
    tokenizer. Never a guessed text.
    """
    return f"token_id:{token_id}"


def _chat_logprobs(lps: list[TokenLogprob]) -> dict[str, Any]:
    """``choices[0].logprobs`` of a chat.completion: one ``content`` entry per generated token."""
    return {
        "content": [
            {
                "token": openai_token(t.token_id),
                "logprob": t.logprob,
                "bytes": None,
                "top_logprobs": [{"token": openai_token(i), "logprob": lp, "bytes": None} for i, lp in t.top],
            }
            for t in lps
        ],
        "refusal": None,
    }


def _completion_logprobs(lps: list[TokenLogprob]) -> dict[str, Any]:
    """``choices[0].logprobs`` of a text_completion: parallel lists, ``top_logprobs`` as token -> logprob.

    ``text_offset`` is null: offsets into ``text`` need each token's text, which lmdq does not have.
    """
    return {
        "tokens": [openai_token(t.token_id) for t in lps],
        "token_logprobs": [t.logprob for t in lps],
        "top_logprobs": [{openai_token(i): lp for i, lp in t.top} for t in lps],
        "text_offset": None,
    }


def is_openai_error(r: Result) -> bool:
    """Whether the request's OpenAI line belongs in the error file (OpenAI's ``error_file_id``)."""
    return r.status is not ResultStatus.completed


def to_openai(r: Result) -> dict[str, Any]:
    """Map an lmdq result to an OpenAI Batch output line (chat.completion / text_completion / embeddings list)."""
    created = int(r.timings.finished_at or r.timings.started_at or 0)
    usage = {
        "prompt_tokens": r.input_token_len,
        "completion_tokens": r.generate_token_len,
        "total_tokens": r.input_token_len + r.generate_token_len,
    }
    line_id, request_id = openai_ids(r.batch_id, r.index)
    rid = line_id.removeprefix("batch_req_")
    finish = r.finish_reason.value if r.finish_reason else None
    if is_openai_error(r):
        if r.status in _OPENAI_CODES:
            code, default = _OPENAI_CODES[r.status]
            if r.status is ResultStatus.cancelled and r.finish_reason is FinishReason.abort:
                default = _CANCELLED_RUNNING.format(n=r.generate_token_len)
            err = {"code": code, "message": r.error.message if r.error else default}
        else:
            err = r.error.model_dump() if r.error else {"code": r.status.value, "message": f"request {r.status.value}"}
        return {"id": line_id, "custom_id": r.custom_id, "response": None, "error": err}
    # params.n > 1: one choice per sample, choices[0..n-1] (usage: the prompt once, the samples' tokens summed)
    outs = ([(s.index, s.text, s.logprobs, s.finish_reason.value if s.finish_reason else None) for s in r.samples]
            if r.samples else [(0, r.text, r.logprobs, finish)])
    if r.endpoint is Endpoint.embedding:
        body: dict[str, Any] = _embedding_body(r)
    elif not r.endpoint.generates:
        body = _score_body(r, rid, created)
    elif r.endpoint is Endpoint.completion:
        body = {
            "id": f"cmpl-{rid}",
            "object": "text_completion",
            "created": created,
            "model": r.model,
            "choices": [{"index": i, "text": text, "logprobs": _completion_logprobs(lps) if lps is not None else None,
                         "finish_reason": why} for i, text, lps, why in outs],
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
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": _chat_logprobs(lps) if lps is not None else None,
                    "finish_reason": why,
                }
                for i, text, lps, why in outs
            ],
            "usage": usage,
        }
    line: dict[str, Any] = {
        "id": line_id,
        "custom_id": r.custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }
    if r.reused_from is not None:  # issue 47: only a reused answer says so; a computed line is OpenAI's own shape
        line["reused_from"] = r.reused_from.model_dump()
    return line


def _score_body(r: Result, rid: str, created: int) -> dict[str, Any]:
    """The body of a ``/v1/score`` or ``/v1/reward`` output line, shaped like vLLM's ``/v1/score``
    response (``object: list``, ``data[i].score``) so clients of that read it as is: for ``score``,
    ``data[i]`` is continuation i with ``score`` = its sum logprob, plus lmdq's ``logprob``,
    ``num_tokens`` and ``is_greedy``; for ``reward`` one entry whose ``score`` is the reward."""
    if r.endpoint is Endpoint.reward:
        data: list[dict[str, Any]] = [{"index": 0, "object": "score", "score": r.reward}]
    else:
        data = [{"index": i, "object": "score", "score": s.logprob, "logprob": s.logprob,
                 "num_tokens": s.num_tokens, "is_greedy": s.is_greedy} for i, s in enumerate(r.scores or [])]
    return {
        "id": f"{r.endpoint.value}-{rid}",
        "object": "list",
        "created": created,
        "model": r.model,
        "data": data,
        "usage": {"prompt_tokens": r.input_token_len, "completion_tokens": 0, "total_tokens": r.input_token_len},
    }


def _embedding_body(r: Result) -> dict[str, Any]:
    """The body of a ``/v1/embeddings`` output line, OpenAI's CreateEmbeddingResponse: ``{"object": "list",
    "data": [{"object": "embedding", "embedding": [floats], "index": 0}], "model", "usage": {"prompt_tokens",
    "total_tokens"}}``. The floats are the stored float32 values, written as JSON numbers (each reads back
    as the same float32)."""
    vector = decode_embedding(r.embedding) if r.embedding is not None else []
    return {
        "object": "list",
        "data": [{"object": "embedding", "embedding": vector, "index": 0}],
        "model": r.model,
        "usage": {"prompt_tokens": r.input_token_len, "total_tokens": r.input_token_len},
    }


def iter_openai(store: ResultStore, batch: Batch, *, usage: BatchUsage | None = None) -> Iterator[tuple[bool, bytes]]:
    """OpenAI Batch output lines as ``(is_error, line)``: final results only (partials are not answers
    yet), so a caller can send errors to their own file as OpenAI's Batch API does. With ``usage``,
    each result's tokens are added to it as its line goes by (the HTTP API's ``Batch.usage``, in the
    same pass that writes the files)."""
    for _, raw in ResultReader.of(store, batch).records(partial=False):
        if raw is not None:
            r = Result.model_validate_json(raw)
            if usage is not None:
                usage.add(r)
            yield is_openai_error(r), json.dumps(to_openai(r), ensure_ascii=False).encode() + b"\n"
