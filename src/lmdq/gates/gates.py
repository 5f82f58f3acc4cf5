"""Judging results against a batch's gates: each final result becomes one small entry (what it failed),
and a set of entries (the canary's, or the rolling window's) passes or fails (:func:`judge`).

Why an entry and not the result: the verdict needs a few bits per result and a handful of examples, not
the texts; the store keeps entries (bounded) and hands them back whole for the verdict, so any worker
can judge, and the report names example lines by custom_id with an excerpt of their output.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from lmdq.contract import FinishReason, ResponseFormat, Result, ResultStatus
from lmdq.gates.config import GateConfig

__all__ = ["GateFailure", "Verdict", "entry_of", "judge"]

EXCERPT = 200
"""Characters of a failing output kept as its example."""

EXAMPLES = 5
"""Example lines a report keeps per failed gate."""


def _json_problem(text: str, rf: ResponseFormat) -> str | None:
    """Why ``text`` is not valid for the json_schema / json_object format ``rf`` (None: it is)."""
    from lmdq.guided import schema_of

    try:
        value = json.loads(text)
    except ValueError as e:
        return f"not JSON: {e}"
    schema = schema_of(rf)
    try:
        import jsonschema
    except ImportError:  # the producer's light install: JSON and an object where one is asked for
        if isinstance(schema, dict) and schema.get("type") == "object" and not isinstance(value, dict):
            return "not a JSON object"
        return None
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return f"schema: {e.message}"
    except jsonschema.SchemaError:
        return None  # submit checked the schema; one the validator cannot read judges nothing
    return None


def entry_of(result: Result, config: GateConfig, rf: ResponseFormat | None) -> dict[str, Any] | None:
    """The entry of one final result: ``i`` index, ``ok`` (completed, else failed), ``bad`` the output gates
    it failed, ``t`` generated tokens, and for a failing one ``id`` (custom_id), ``x`` (an excerpt) and
    ``why``. None for a cancelled or expired result (not judged)."""
    if result.status not in (ResultStatus.completed, ResultStatus.failed):
        return None
    e: dict[str, Any] = {"i": result.index, "ok": result.status is ResultStatus.completed,
                         "t": max(0, result.generate_token_len)}
    bad: list[str] = []
    why = ""
    if e["ok"]:
        text = result.text
        if not text.strip():
            bad.append("empty")
        if result.finish_reason is FinishReason.length:
            bad.append("length")
        if rf is not None and rf.type in ("json_schema", "json_object"):
            problem = _json_problem(text, rf)
            if problem is not None:
                bad.append("json")
                why = problem
        if config.must_match is not None and not re.search(config.must_match, text):
            bad.append("match")
        if config.must_not_match is not None and re.search(config.must_not_match, text):
            bad.append("not-match")
    else:
        why = result.error.message if result.error and result.error.message else "failed"
    e["bad"] = bad
    if bad or not e["ok"]:
        e["id"] = result.custom_id
        e["x"] = result.text[:EXCERPT]
        if why:
            e["why"] = why[:EXCERPT]
    return e


class GateFailure(BaseModel):
    """One gate that failed: its name, what was seen, its limit, examples."""

    gate: str
    observed: float
    limit: str
    message: str
    examples: list[dict[str, Any]] = []


class Verdict(BaseModel):
    """A set of entries judged: passed, or the gates that failed (the pause report's body)."""

    passed: bool
    judged: int
    completed: int
    failures: list[GateFailure] = []


def _examples(entries: Sequence[dict[str, Any]], pick: Any) -> list[dict[str, Any]]:
    """The first :data:`EXAMPLES` picked entries in input order (whatever order their jobs ended in)."""
    picked = sorted((e for e in entries if pick(e)), key=lambda e: int(e.get("i", 0)))
    return [{k: e[k] for k in ("i", "id", "x", "why") if k in e} for e in picked[:EXAMPLES]]


def judge(entries: Sequence[dict[str, Any]], config: GateConfig) -> Verdict:
    """Whether ``entries`` pass ``config``'s gates. An empty set passes (nothing to judge: a canary whose
    requests were all cancelled says nothing against the batch)."""
    judged = len(entries)
    done = [e for e in entries if e.get("ok")]
    fails: list[GateFailure] = []
    if not judged:
        return Verdict(passed=True, judged=0, completed=0)

    def rate_gate(gate: str, share: float, limit: float, what: str, pick: Any) -> None:
        if share > limit:
            fails.append(GateFailure(gate=gate, observed=round(share, 4), limit=f"<= {limit:g}",
                                     message=f"{what}: {share:.1%} of results (limit {limit:.1%})",
                                     examples=_examples(entries, pick)))

    rate_gate("failed", (judged - len(done)) / judged, config.max_failed, "failed requests",
              lambda e: not e.get("ok"))
    if done:
        n = len(done)

        def share(name: str) -> float:
            return sum(1 for e in done if name in e.get("bad", ())) / n

        def has(name: str) -> Any:
            return lambda e: name in e.get("bad", ())

        rate_gate("empty", share("empty"), config.max_empty, "empty outputs", has("empty"))
        rate_gate("length", share("length"), config.max_length, "outputs cut at max_new_tokens (finish_reason=length)",
                  has("length"))
        rate_gate("json", share("json"), config.max_invalid_json, "outputs not valid for their response_format",
                  has("json"))
        if config.must_match is not None:
            rate_gate("match", share("match"), config.max_regex, f"outputs not matching {config.must_match!r}",
                      has("match"))
        if config.must_not_match is not None:
            rate_gate("not-match", share("not-match"), config.max_regex,
                      f"outputs matching {config.must_not_match!r}", has("not-match"))
        mean = sum(int(e.get("t", 0)) for e in done) / n
        lo, hi = config.min_mean_tokens, config.max_mean_tokens
        if (lo is not None and mean < lo) or (hi is not None and mean > hi):
            bounds = f"{'' if lo is None else f'{lo:g}'}..{'' if hi is None else f'{hi:g}'}"
            fails.append(GateFailure(gate="tokens", observed=round(mean, 2), limit=bounds,
                                     message=f"mean output tokens {mean:.1f}, outside {bounds}"))
    return Verdict(passed=not fails, judged=judged, completed=len(done), failures=fails)
