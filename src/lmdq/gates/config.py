"""What a batch's quality gates are (``submit --canary 2% --gate ...``), and which jobs its canary runs.

Why jobs and not requests: a job is what a worker claims and the queue holds, so the sample is whole jobs
spread evenly over the file (every part of the file is tried, not only its head: a template that breaks on
the last section shows). The canary asked for is a floor: ``--canary 2%`` of 1,000 requests in jobs of 8
runs 3 jobs, 24 requests (:func:`canary_jobs`).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["GATE_KEYS", "GateConfig", "canary_jobs", "from_options", "parse_canary", "parse_gate"]

Rate = Annotated[float, Field(ge=0.0, le=1.0)]


class GateConfig(BaseModel):
    """A batch's gates. Every rate is a share of the judged results (failed: of all that ended completed
    or failed; the output gates: of the completed ones); a gate fails when its share is ABOVE its limit.
    Cancelled and expired results are not judged (they say nothing of the batch's quality)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: the canary: requests (an int >= 1) or a share of the batch (0 < x < 1); None: no canary
    canary: float | None = None
    #: judge every ``window`` newest results as they come (after the canary, if any); None: off
    window: Annotated[int, Field(ge=1, le=100_000)] | None = None
    max_failed: Rate = 0.1
    max_empty: Rate = 0.1
    max_length: Rate = 0.5
    #: outputs that are not JSON valid against their request's response_format (json_schema / json_object)
    max_invalid_json: Rate = 0.0
    #: a regex every output must match (re.search), and one none may match; their limit is ``max_regex``
    must_match: Annotated[str, Field(max_length=10_000)] | None = None
    must_not_match: Annotated[str, Field(max_length=10_000)] | None = None
    max_regex: Rate = 0.0
    #: the mean generated tokens of completed results must lie within [min, max]
    min_mean_tokens: Annotated[float, Field(ge=0)] | None = None
    max_mean_tokens: Annotated[float, Field(ge=0)] | None = None

    @field_validator("canary")
    @classmethod
    def _canary(cls, v: float | None) -> float | None:
        if v is not None and (v <= 0 or (v >= 1 and v != int(v))):
            raise ValueError("canary must be a share in (0, 1) or a whole number of requests >= 1")
        return v

    @field_validator("must_match", "must_not_match")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a valid regex: {e}") from None
        return v

    @model_validator(mode="after")
    def _some(self) -> GateConfig:
        if self.canary is None and self.window is None:
            raise ValueError("gates need a canary (--canary) or a rolling window (--gate-window)")
        if (self.min_mean_tokens is not None and self.max_mean_tokens is not None
                and self.min_mean_tokens > self.max_mean_tokens):
            raise ValueError("the mean output tokens' min is above its max")
        return self

    def canary_requests(self, total: int) -> int:
        """Requests the canary asks for out of ``total`` (at least 1, at most ``total``)."""
        if self.canary is None:
            return 0
        want = math.ceil(self.canary * total) if self.canary < 1 else int(self.canary)
        return max(1, min(total, want))


def canary_jobs(config: GateConfig, job_sizes: list[int]) -> list[int]:
    """The job numbers of the canary: the fewest jobs holding at least the requests it asks for, spread
    evenly over the batch (the middle of each of k equal stretches of its jobs). [] without a canary."""
    total = sum(job_sizes)
    want = config.canary_requests(total)
    if want == 0 or not job_sizes:
        return []
    n = len(job_sizes)
    for k in range(1, n + 1):
        picked = sorted({min(n - 1, int((i + 0.5) * n / k)) for i in range(k)})
        if sum(job_sizes[j] for j in picked) >= want:
            return picked
    return list(range(n))


def parse_canary(text: str) -> float:
    """``2%`` → 0.02, ``50`` → 50 (requests); one clear error otherwise."""
    t = text.strip()
    try:
        if t.endswith("%"):
            pct = float(t[:-1])
            if not 0 < pct < 100:
                raise ValueError
            return pct / 100
        n = int(t)
        if n < 1:
            raise ValueError
        return float(n)
    except ValueError:
        raise ValueError(f"--canary {text!r}: expected a share such as 2% (0-100, exclusive) or a request "
                         "count such as 50") from None


def from_options(canary: str | float | None, gates: list[str] | None, window: int | None) -> GateConfig | None:
    """The GateConfig of submit's ``canary`` / ``gate`` / ``gate_window`` (the CLI's, Python's and the HTTP
    API's extension field alike); None without a canary or a window. ValueError: one line, naming the option
    (``--canary``, ``--gate``; a bare config error names neither)."""
    if canary is None and window is None:
        if gates:
            raise ValueError("--gate: gates judge a canary or a rolling window: pass --canary or --gate-window too")
        return None
    fields: dict[str, Any] = {"window": window}
    if canary is not None:
        if isinstance(canary, str):
            fields["canary"] = parse_canary(canary)
        elif 0 < canary < 1:
            fields["canary"] = float(canary)
        else:
            fields["canary"] = parse_canary(f"{canary:g}")
    for spec in gates or []:
        fields.update(parse_gate(spec))
    try:
        return GateConfig.model_validate(fields)
    except ValueError as e:
        errs = getattr(e, "errors", None)
        msg = errs()[0]["msg"] if callable(errs) else str(e)
        raise ValueError(f"--gate: {msg.removeprefix('Value error, ')}") from None


#: ``--gate KEY=VALUE`` keys and the GateConfig field each sets (``tokens`` sets both mean-token bounds)
GATE_KEYS: dict[str, str] = {
    "failed": "max_failed", "empty": "max_empty", "length": "max_length", "json": "max_invalid_json",
    "match": "must_match", "not-match": "must_not_match", "regex": "max_regex", "tokens": "tokens",
}


def parse_gate(text: str) -> dict[str, Any]:
    """One ``--gate`` spec → GateConfig fields: ``failed=0.05``, ``empty=0``, ``length=0.2``, ``json=0``,
    ``match=REGEX``, ``not-match=REGEX``, ``regex=0.01``, ``tokens=20..200`` (either side may be empty)."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or key not in GATE_KEYS:
        raise ValueError(f"--gate {text!r}: expected KEY=VALUE with KEY one of {', '.join(GATE_KEYS)}")
    name = GATE_KEYS[key]
    if name in ("must_match", "must_not_match"):
        return {name: value}
    if name == "tokens":
        lo, dots, hi = value.partition("..")
        if not dots:
            raise ValueError(f"--gate {text!r}: tokens takes MIN..MAX (either may be empty), e.g. tokens=20..200")
        try:
            return {k: float(v) for k, v in (("min_mean_tokens", lo), ("max_mean_tokens", hi)) if v.strip()}
        except ValueError:
            raise ValueError(f"--gate {text!r}: MIN and MAX are numbers") from None
    try:
        return {name: float(value)}
    except ValueError:
        raise ValueError(f"--gate {text!r}: {key} takes a share of results, 0 to 1") from None
