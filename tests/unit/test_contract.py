"""lmdq.contract: the wire models refuse what a worker must never run, and params layer as documented."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from lmdq.contract import (
    MAX_SCHEMA_DEPTH,
    BatchStatus,
    ChatMessage,
    Endpoint,
    GenerationParams,
    JobPayload,
    Request,
    RequestCounts,
    ResponseFormat,
    Result,
    ResultStatus,
)

BATCH = "batch_" + "0" * 24


def test_params_merge_override_wins_and_unset_keeps() -> None:
    base = GenerationParams(max_new_tokens=10, temperature=0.5)
    merged = base.merged(GenerationParams(temperature=0.1, top_k=3))
    assert (merged.max_new_tokens, merged.temperature, merged.top_k) == (10, 0.1, 3)
    assert base.merged(None) is base
    assert base.temperature == 0.5  # not mutated


def test_resolved_fills_engine_defaults() -> None:
    r = GenerationParams(max_new_tokens=7).resolved()
    assert r["max_new_tokens"] == 7 and r["temperature"] == 0.8 and r["top_k"] == 50 and r["n"] == 1
    assert r["random_seed"] is None
    assert set(r) == set(GenerationParams.model_fields)


@pytest.mark.parametrize("bad", [{"max_new_tokens": 0}, {"temperature": 2.5}, {"top_p": 0.0},
                                 {"min_new_tokens": 5, "max_new_tokens": 4}, {"n": 129}, {"unknown": 1},
                                 {"stop_words": [""]}, {"stop_words": ["x"] * 65}, {"logprobs": 21}])
def test_params_bounds(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        GenerationParams.model_validate(bad)


def test_response_format_rules() -> None:
    with pytest.raises(ValidationError, match="needs 'json_schema'"):
        ResponseFormat(type="json_schema")
    with pytest.raises(ValidationError, match="needs 'regex'"):
        ResponseFormat(type="regex")
    deep: Any = {}
    for _ in range(MAX_SCHEMA_DEPTH + 1):
        deep = {"a": deep}
    with pytest.raises(ValidationError, match="nests deeper"):
        ResponseFormat(type="json_schema", json_schema=deep)
    ok: Any = {}
    for _ in range(MAX_SCHEMA_DEPTH - 1):
        ok = {"a": ok}
    ResponseFormat(type="json_schema", json_schema=ok)


def test_chat_message_text_parts() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert ChatMessage(role="user", content=parts).text() == "ab"
    assert ChatMessage(role="assistant").text() == ""
    with pytest.raises(ValueError, match="vision-language model"):  # images are parts now (issue 48), not text
        ChatMessage(role="user", content=[{"type": "image_url", "image_url": {}}]).text()


@pytest.mark.parametrize("bad, why", [
    ({}, "exactly one"), ({"prompt": "p", "messages": [{"role": "user", "content": "x"}]}, "exactly one"),
    ({"messages": [{"role": "user", "content": "x"}], "endpoint": "completion"}, "need 'prompt'"),
    ({"prompt": "p", "endpoint": "reward"}, "need 'messages'"),
    ({"prompt": "p", "endpoint": "score"}, "continuations"),
    ({"prompt": "p", "continuations": ["x"]}, "continuations"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "an image_url part needs"),
    ({"prompt": "p", "custom_id": ""}, "custom_id"),
    ({"prompt": "p", "index": -1}, "index"),
])
def test_request_refusals(bad: dict[str, Any], why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        Request.model_validate({"index": 0, "custom_id": "c", **bad})


def test_score_request_is_accepted() -> None:
    r = Request(index=0, custom_id="c", prompt="p", endpoint=Endpoint.score, continuations=[" a", " b"])
    assert r.continuations == [" a", " b"]


def _payload(**kw: Any) -> dict[str, Any]:
    return {"batch_id": BATCH, "model": "m", "job_no": 0,
            "requests": [{"index": 0, "custom_id": "a", "prompt": "p"}], **kw}


def test_job_payload_refuses_forged_fields() -> None:
    JobPayload.model_validate(_payload())
    for bad in [_payload(batch_id="batch_../../x"), _payload(batch_id=BATCH.upper()), _payload(requests=[]),
                _payload(job_no=-1), _payload(format_version=2), _payload(extra=1),
                _payload(requests=[{"index": 1, "custom_id": "a", "prompt": "p"},
                                   {"index": 1, "custom_id": "b", "prompt": "q"}])]:
        with pytest.raises(ValidationError):
            JobPayload.model_validate(bad)


def test_statuses_and_counts() -> None:
    assert {s for s in BatchStatus if s.terminal} == {BatchStatus.completed, BatchStatus.failed,
                                                      BatchStatus.cancelled, BatchStatus.expired}
    assert RequestCounts(total=9, completed=2, failed=1, cancelled=1, expired=1).done == 5
    res = Result(batch_id=BATCH, custom_id="a", index=0, model="m", status=ResultStatus.in_progress)
    assert not res.final
    assert Result(batch_id=BATCH, custom_id="a", index=0, model="m", status=ResultStatus.failed).final


def test_enums_print_as_their_value() -> None:
    """``print(result.finish_reason)`` shows ``stop`` (issue 45): str() and format() both give the value."""
    from lmdq.contract import BatchStatus, Endpoint, ErrorCode, FinishReason, Priority, ResultStatus

    for enum in (BatchStatus, Endpoint, ErrorCode, FinishReason, Priority, ResultStatus):
        for member in enum:
            assert str(member) == f"{member}" == member.value, member
