"""lmdq.results.openai: an lmdq Result as an OpenAI Batch output line."""

from __future__ import annotations

import json
import re
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
from lmdq.results.openai import BatchUsage, is_openai_error, openai_ids, openai_token, to_openai


def _r(**kw: Any) -> Result:
    base: dict[str, Any] = {"batch_id": "batch_x", "custom_id": "c1", "index": 4, "model": "m",
                            "status": ResultStatus.completed, "text": "hi", "finish_reason": FinishReason.stop,
                            "input_token_len": 3, "generate_token_len": 2, "timings": Timings(finished_at=99.7)}
    return Result(**{**base, **kw})


def test_chat_line() -> None:
    line = to_openai(_r())
    line_id, request_id = openai_ids("batch_x", 4)
    assert line["id"] == line_id and line["custom_id"] == "c1" and line["error"] is None
    resp = line["response"]
    assert resp["status_code"] == 200 and resp["request_id"] == request_id
    body = resp["body"]
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-" + line_id.removeprefix("batch_req_")
    assert body["created"] == 99
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
                                "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_completion_with_logprobs_uses_token_ids() -> None:
    lps = [TokenLogprob(token_id=7, logprob=-0.5, top=[(7, -0.5), (9, -1.5)])]
    body = to_openai(_r(endpoint=Endpoint.completion, logprobs=lps))["response"]["body"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and "batch_x" not in body["id"]
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
    assert to_openai(failed) == {"id": openai_ids("batch_x", 4)[0], "custom_id": "c1", "response": None,
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
    assert body["object"] == "list" and body["id"] == "score-" + openai_ids("batch_x", 4)[0].removeprefix("batch_req_")
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
def test_ids_are_openai_shaped_stable_and_never_name_the_batch() -> None:
    """Issue 45: ``id`` / ``request_id`` were ``<lmdq batch>-<index>``."""
    a, ra = openai_ids("batch_e2376abc", 0)
    assert re.fullmatch(r"batch_req_[0-9a-f]{32}", a) and re.fullmatch(r"req_[0-9a-f]{32}", ra)
    assert openai_ids("batch_e2376abc", 0) == (a, ra)  # the same on every export
    assert len({openai_ids("batch_e2376abc", i)[0] for i in range(1000)}) == 1000
    assert openai_ids("batch_other", 0)[0] != a
    line = json.dumps(to_openai(_r(batch_id="batch_e2376abc")))
    assert "e2376abc" not in line


def test_cancelled_while_running_is_worded_as_such() -> None:
    """Issue 45: a request the engine had started (its stream ended ``abort``) said 'cancelled before it ran'."""
    ran = to_openai(_r(status=ResultStatus.cancelled, finish_reason=FinishReason.abort, generate_token_len=7))
    assert ran["error"]["code"] == ErrorCode.batch_cancelled
    assert ran["error"]["message"].startswith("This request was cancelled while it was running (7 tokens generated)")
    never = to_openai(_r(status=ResultStatus.cancelled, finish_reason=None, generate_token_len=0))
    assert never["error"]["message"] == "This request was cancelled before it ran."


def test_batch_usage_sums_the_answered_requests() -> None:
    u = BatchUsage()
    u.add(_r(input_token_len=10, generate_token_len=4, prefill_token_len=6))
    u.add(_r(input_token_len=5, generate_token_len=2))
    u.add(_r(status=ResultStatus.failed, input_token_len=100, generate_token_len=100))  # not in the output file
    assert u.to_openai() == {"input_tokens": 15, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 6,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 21}
