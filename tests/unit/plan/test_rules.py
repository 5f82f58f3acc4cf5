"""lmdq.plan.rules: expected output from a length history, the rate fit, the plan's figures and bases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from lmdq.contract import Endpoint, GenerationParams
from lmdq.plan.rules import expected_output, fit_rates, make_plan
from lmdq.plan.store import History, WorkerRate
from lmdq.plan.tokens import TokenCounter


@dataclass
class Line:
    prompt: str | None
    messages: list[dict[str, Any]] | None = None
    endpoint: Endpoint = Endpoint.chat
    params: GenerationParams | None = None
    model: str | None = None
    continuations: tuple[str, ...] | None = None


WORDS = TokenCounter(basis="words", exact=True, encode=lambda s, _special: [hash(w) % 1000 for w in s.split()])


def test_expected_output_caps_each_length_at_max_new_tokens() -> None:
    h = History(model="m", stopped={10: 2, 100: 2}, cut={50: 1})
    # the cut one had not stopped: it runs to any max_new_tokens
    assert expected_output(h, 1000) == (10 * 2 + 100 * 2 + 1000) / 5
    assert expected_output(h, 20) == (10 * 2 + 20 * 2 + 20) / 5
    assert expected_output(History(model="m"), 64) == 64


def test_two_rates_are_fitted_exactly_from_windows_of_different_shapes() -> None:
    a, b = 0.001, 0.02  # seconds per prefill token, per decode token
    windows = [(p * a + d * b, p, d) for p, d in [(1000, 10), (100, 200), (500, 50), (10, 300)]]
    h = History(model="m", rates=[WorkerRate("w", sum(w[0] for w in windows), 1610, 560, windows, 100.0)], now=100.0)
    r = fit_rates(h)
    assert r.s_per_prefill == pytest.approx(a) and r.s_per_decode == pytest.approx(b)
    assert "fitted to 1 worker(s)" in r.basis and r.workers[0]["worker"] == "w"


def test_windows_of_one_shape_give_one_rate_and_say_so() -> None:
    windows = [(1.0, 100, 10), (2.0, 200, 20)]
    h = History(model="m", rates=[WorkerRate("w", 3.0, 300, 30, windows, 5.0)], now=5.0)
    r = fit_rates(h)
    assert r.s_per_prefill is None and r.s_per_decode == pytest.approx(0.1)
    assert "not separable" in r.basis
    assert "no worker has measured" in fit_rates(History(model="m")).basis


def test_make_plan_without_history_says_what_each_figure_rests_on() -> None:
    lines = [Line(prompt="a b c"), Line(prompt="d e", params=GenerationParams(max_new_tokens=5)),
             Line(prompt="s", endpoint=Endpoint.score, continuations=("x y",))]
    p = make_plan(lines, model="m", params=GenerationParams(max_new_tokens=20), counter=WORDS,
                  history=History(model="m"), live_workers=2, gpu_hour_price=3.0, prefix_groups=True)
    # no chat template: a chat prompt is counted as a 'user: ...' line; the score's prompt is raw
    assert (p.requests, p.input_tokens, p.output_tokens, p.max_output_tokens) == (3, 4 + 3 + 1 + 2, 25, 25)
    assert p.output_basis.startswith("no history for this model")
    assert p.gpu_seconds is None and p.eta_s is None and p.cost is None
    assert "no worker has measured" in p.rate_basis and p.cost_basis == "GPU-seconds unknown"
    assert any("no history for this model" in line for line in p.lines())


def test_make_plan_with_history_gives_gpu_seconds_eta_and_cost() -> None:
    windows = [(p * 0.001 + d * 0.01, p, d) for p, d in [(1000, 10), (100, 200)]]
    h = History(model="m", stopped={4: 10}, rates=[WorkerRate("w", 3.0, 1100, 210, windows, 1.0)], now=1.0)
    lines = [Line(prompt="one two three four")] * 10
    p = make_plan(lines, model="m", params=GenerationParams(max_new_tokens=100), counter=WORDS, history=h,
                  live_workers=2, gpu_hour_price=36.0, prefix_groups=True)
    assert p.output_tokens == 40 and p.input_tokens == 50  # 'user: one two three four'
    assert p.gpu_seconds == pytest.approx(50 * 0.001 + 40 * 0.01)
    assert p.eta_s == pytest.approx(p.gpu_seconds / 2)
    assert p.cost == pytest.approx(p.gpu_seconds / 100)
    assert p.as_dict()["workers"][0]["worker"] == "w"


def test_shared_prefix_blocks_are_counted_once() -> None:
    shared = " ".join(f"w{i}" for i in range(128))
    lines = [Line(prompt=f"{shared} q{i}", endpoint=Endpoint.completion) for i in range(3)]
    p = make_plan(lines, model="m", params=GenerationParams(), counter=WORDS, history=History(model="m"),
                  live_workers=0, prefix_block=64, prefix_groups=True)
    assert p.prefix_saved_tokens == 2 * 128  # the 2 full blocks, computed by the first request only
    off = make_plan(lines, model="m", params=GenerationParams(), counter=WORDS, history=History(model="m"),
                    live_workers=0, prefix_groups=False)
    assert off.prefix_saved_tokens == 0
