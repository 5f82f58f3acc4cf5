"""lmdq.gates.gates: a result's entry (what it failed) and the verdict over a set of entries."""

from __future__ import annotations

from typing import Any

from lmdq.contract import ErrorInfo, FinishReason, ResponseFormat, Result, ResultStatus
from lmdq.gates.config import GateConfig
from lmdq.gates.gates import entry_of, judge

SCHEMA = ResponseFormat(type="json_schema", json_schema={"schema": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}})


def _result(i: int, text: str = "fine", status: ResultStatus = ResultStatus.completed,
            reason: FinishReason = FinishReason.stop, tokens: int = 5, **kw: Any) -> Result:
    return Result(batch_id="b", custom_id=f"c{i}", index=i, status=status, text=text, finish_reason=reason,
                  generate_token_len=tokens, model="m", **kw)


def test_entries_name_what_failed() -> None:
    cfg = GateConfig(canary=1, must_match="^ok", must_not_match="sorry")
    assert entry_of(_result(0, "ok then"), cfg, None) == {"i": 0, "ok": True, "t": 5, "bad": []}
    e = entry_of(_result(1, "  ", reason=FinishReason.length), cfg, None)
    assert e is not None and e["bad"] == ["empty", "length", "match"] and e["id"] == "c1"
    e = entry_of(_result(2, "ok, sorry"), cfg, None)
    assert e is not None and e["bad"] == ["not-match"]
    e = entry_of(_result(3, "failed", status=ResultStatus.failed, error=ErrorInfo(code="engine_error",
                                                                                  message="boom")), cfg, None)
    assert e is not None and not e["ok"] and e["why"] == "boom"
    assert entry_of(_result(4, status=ResultStatus.cancelled), cfg, None) is None


def test_json_validity() -> None:
    cfg = GateConfig(canary=1)
    assert entry_of(_result(0, '{"n": 3}'), cfg, SCHEMA)["bad"] == []  # type: ignore[index]
    bad = entry_of(_result(1, '{"n": "x"}'), cfg, SCHEMA)
    assert bad is not None and bad["bad"] == ["json"] and bad["why"].startswith("schema:")
    broken = entry_of(_result(2, '{"n": 3'), cfg, SCHEMA)
    assert broken is not None and broken["why"].startswith("not JSON")
    # a regex format is not judged as JSON
    assert entry_of(_result(3, "x"), cfg, ResponseFormat(type="regex", regex="x"))["bad"] == []  # type: ignore[index]


def test_judge_rates_and_mean_tokens() -> None:
    cfg = GateConfig(canary=1, max_failed=0.25, max_empty=0, max_length=1, min_mean_tokens=2, max_mean_tokens=10)
    good = [entry_of(_result(i), cfg, None) for i in range(4)]
    v = judge([e for e in good if e], cfg)
    assert v.passed and v.judged == 4 and v.completed == 4
    mixed = [entry_of(_result(0, status=ResultStatus.failed), cfg, None), entry_of(_result(1, ""), cfg, None),
             entry_of(_result(2, tokens=50), cfg, None), entry_of(_result(3, tokens=50), cfg, None)]
    v = judge([e for e in mixed if e], cfg)
    assert not v.passed
    by = {f.gate: f for f in v.failures}
    assert set(by) == {"empty", "tokens"}  # 1 failed of 4 is the 25 % allowed
    assert by["empty"].observed == round(1 / 3, 4) and by["empty"].examples[0]["id"] == "c1"
    assert by["tokens"].observed == 35.0  # (5 + 50 + 50) / 3 completed
    assert judge([], cfg).passed


def test_examples_in_input_order() -> None:
    cfg = GateConfig(canary=1)
    es = [entry_of(_result(i, ""), cfg, None) for i in (7, 2, 5)]
    v = judge([e for e in es if e], cfg)
    assert [x["i"] for x in v.failures[0].examples] == [2, 5, 7]
