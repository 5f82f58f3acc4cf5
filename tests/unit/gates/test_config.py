"""lmdq.gates.config: what a canary spec and a --gate spec mean, and which jobs a canary runs."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from lmdq.gates.config import GateConfig, canary_jobs, parse_canary, parse_gate


def test_parse_canary() -> None:
    assert parse_canary("2%") == pytest.approx(0.02)
    assert parse_canary("50") == 50
    for bad in ("0%", "100%", "0", "-3", "x", "2.5"):
        with pytest.raises(ValueError, match="--canary"):
            parse_canary(bad)


def test_parse_gate() -> None:
    assert parse_gate("failed=0.05") == {"max_failed": 0.05}
    assert parse_gate("json=0") == {"max_invalid_json": 0.0}
    assert parse_gate("match=^\\{") == {"must_match": "^\\{"}
    assert parse_gate("tokens=20..") == {"min_mean_tokens": 20.0}
    assert parse_gate("tokens=..200") == {"max_mean_tokens": 200.0}
    for bad in ("failed", "nope=1", "failed=x", "tokens=5"):
        with pytest.raises(ValueError, match="--gate"):
            parse_gate(bad)


def test_config_rules() -> None:
    with pytest.raises(ValidationError, match="canary"):
        GateConfig(max_failed=0.1)
    with pytest.raises(ValidationError, match="regex"):
        GateConfig(canary=3, must_match="(")
    with pytest.raises(ValidationError, match="min is above"):
        GateConfig(canary=3, min_mean_tokens=10, max_mean_tokens=5)
    with pytest.raises(ValidationError):
        GateConfig(canary=0.02, max_failed=2)
    assert GateConfig(canary=0.02).canary_requests(1000) == 20
    assert GateConfig(canary=0.001).canary_requests(10) == 1  # at least one request
    assert GateConfig(canary=50).canary_requests(10) == 10  # at most the batch
    assert GateConfig(window=10).canary_requests(10) == 0


def test_canary_jobs_are_spread_and_hold_enough() -> None:
    assert canary_jobs(GateConfig(canary=0.1), [2] * 20) == [5, 15]
    assert canary_jobs(GateConfig(canary=1), [2] * 20) == [10]  # one job: the middle of the file
    picked = canary_jobs(GateConfig(canary=0.25), [3, 1, 1, 1, 3, 1, 1, 1])
    assert sum([3, 1, 1, 1, 3, 1, 1, 1][j] for j in picked) >= 3 and picked == sorted(set(picked))
    assert canary_jobs(GateConfig(canary=40), [2] * 20) == list(range(20))
    assert canary_jobs(GateConfig(window=4), [2] * 20) == []
