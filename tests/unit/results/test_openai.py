"""lmdq.results.openai: an lmdq Result as an OpenAI Batch output line."""

from __future__ import annotations

from typing import Any

from lmdq.contract import (
    ContinuationScore,
    Endpoint,
    ErrorCode,
    ErrorInfo,
    FinishReason,
    Result,
    ResultStatus,
    Sample,
    Timings,
    TokenLogprob,
)
from lmdq.results.openai import is_openai_error, openai_token, to_openai


def _r(**kw: Any) -> Result:
    base: dict[str, Any] = {"batch_id": "batch_x", "custom_id": "c1", "index": 4, "model": "m",
                            "status": ResultStatus.completed, "text": "hi", "finish_reason": FinishReason.stop,
                            "input_token_len": 3, "generate_token_len": 2, "timings": Timings(finished_at=99.7)}
    return Result(**{**base, **kw})


def test_chat_line() -> None:
    line = to_openai(_r())
    assert line["id"] == "batch_x-4" and line["custom_id"] == "c1" and line["error"] is None
    resp = line["response"]
    assert resp["status_code"] == 200 and resp["request_id"] == "batch_x-4"
    body = resp["body"]
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-batch_x-4" and body["created"] == 99
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
                                "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_completion_with_logprobs_uses_token_ids() -> None:
    lps = [TokenLogprob(token_id=7, logprob=-0.5, top=[(7, -0.5), (9, -1.5)])]
    body = to_openai(_r(endpoint=Endpoint.completion, logprobs=lps))["response"]["body"]
    assert body["object"] == "text_completion" and body["id"] == "cmpl-batch_x-4"
    assert body["choices"][0]["logprobs"] == {"tokens": ["token_id:7"], "token_logprobs": [-0.5],
                                              "top_logprobs": [{"token_id:7": -0.5, "token_id:9": -1.5}],
                                              "text_offset": None}
    chat = to_openai(_r(logprobs=lps))["response"]["body"]["choices"][0]["logprobs"]
    assert chat["content"][0]["token"] == "token_id:7" and chat["content"][0]["bytes"] is None
    assert chat["content"][0]["top_logprobs"][1] == {"token": "token_id:9", "logprob": -1.5, "bytes": None}
    assert openai_token(0) == "token_id:0"


def test_samples_become_choices() -> None:
    samples = [Sample(index=0, text="a", finish_reason=FinishReason.stop, generate_token_len=1),
               Sample(index=1, text="b", finish_reason=FinishReason.length, generate_token_len=1)]
    choices = to_openai(_r(samples=samples))["response"]["body"]["choices"]
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in choices] == [
        (0, "a", "stop"), (1, "b", "length")]


def test_failed_cancelled_and_expired_go_to_the_error_file() -> None:
    failed = _r(status=ResultStatus.failed, error=ErrorInfo(code=ErrorCode.engine_error.value, message="boom"))
    assert is_openai_error(failed) and not is_openai_error(_r())
    assert to_openai(failed) == {"id": "batch_x-4", "custom_id": "c1", "response": None,
                                 "error": {"code": "engine_error", "message": "boom"}}
    cancelled = to_openai(_r(status=ResultStatus.cancelled))
    assert cancelled["error"]["code"] == ErrorCode.batch_cancelled and "cancelled" in cancelled["error"]["message"]
    expired = to_openai(_r(status=ResultStatus.expired, error=ErrorInfo(code="x", message="window passed")))
    assert expired["error"] == {"code": ErrorCode.batch_expired, "message": "window passed"}
    bare = to_openai(_r(status=ResultStatus.failed))
    assert bare["error"] == {"code": "failed", "message": "request failed"}


def test_score_and_reward_bodies() -> None:
    scored = _r(endpoint=Endpoint.score, text="", scores=[ContinuationScore(logprob=-2.0, num_tokens=3,
                                                                            is_greedy=True)])
    body = to_openai(scored)["response"]["body"]
    assert body["object"] == "list" and body["id"] == "score-batch_x-4"
    assert body["data"] == [{"index": 0, "object": "score", "score": -2.0, "logprob": -2.0, "num_tokens": 3,
                             "is_greedy": True}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
    reward = to_openai(_r(endpoint=Endpoint.reward, text="", reward=0.25))["response"]["body"]
    assert reward["data"] == [{"index": 0, "object": "score", "score": 0.25}]


def test_embedding_line_is_an_openai_embedding_list() -> None:
    from lmdq.contract import encode_embedding

    body = to_openai(_r(endpoint=Endpoint.embedding, text="", finish_reason=FinishReason.stop, input_token_len=5,
                        generate_token_len=0, embedding=encode_embedding([0.5, -1.0, 0.25])))["response"]["body"]
    assert body == {"object": "list", "data": [{"object": "embedding", "embedding": [0.5, -1.0, 0.25], "index": 0}],
                    "model": "m", "usage": {"prompt_tokens": 5, "total_tokens": 5}}
    failed = to_openai(_r(endpoint=Endpoint.embedding, status=ResultStatus.failed,
                          error=ErrorInfo(code="context_length_exceeded", message="too long")))
    assert failed["response"] is None and failed["error"]["code"] == "context_length_exceeded"
