"""The bar a ``score`` engine's log-likelihoods are held to against an exact reference (issue 24).

Why not "every pair within 1e-2 per token": a float16 model cannot meet it against float32, whoever
implements it. On the H200 (sessions 9 and 11, evidence/session11/scores_gpu_2729dda.json) transformers
float16 is 2.68e-2 per token from transformers float32 on its worst pair, LMDeploy float16 2.59e-2; every pair
over 1e-2 is a continuation of one or two tokens the model finds very unlikely (log-probability -11 to -21),
where float16's own spacing is 0.0078-0.0156. On CPU float16 hidden states through a float32 lm_head are still
2.7e-2 off (scripts/score_precision.py): the error is in the activations, no score code can remove it.

So the bar, decided in session 11:
- the issue's number where it is attainable, per token over the whole set: the summed absolute difference
  over all scored tokens is at most ``PER_TOKEN_TOL`` per token (what an eval's summed log-likelihoods see;
  4.2e-3 recorded for LMDeploy, 3.9e-3 for transformers float16);
- no pair over ``PAIR_TOL`` per token: about twice float16's own worst pair (2.68e-2), half of what a wrong
  score costs at the least (a token off, the wrong prompt or template, a dropped first token: tenths of a nat
  to several nats).
:func:`verdict` is the whole of what the GPU test asserts and writes, computed from its rows alone, so that
tests/unit/test_score_bar.py replays the same verdict on the rows the H200 recorded (and on wrong ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["COMPARISONS", "PAIR_TOL", "PER_TOKEN_TOL", "Pair", "ScoreBar", "score_bar", "verdict"]

PER_TOKEN_TOL = 1e-2
PAIR_TOL = 5e-2


@dataclass(frozen=True)
class Pair:
    """One (prompt, continuation): the engine's summed log-probability, the reference's, and the token count."""

    got: float
    ref: float
    tokens: int


@dataclass(frozen=True)
class ScoreBar:
    """The verdict with the numbers that make it (all printed and written by the GPU test)."""

    ok: bool
    pairs: int
    tokens: int
    per_token_all: float  # summed |got - ref| over summed tokens
    worst_per_token: float  # the largest pair's |got - ref| / tokens
    over_per_token_tol: int  # pairs over PER_TOKEN_TOL on their own (the literal per-pair reading)
    failing: tuple[int, ...]  # indices of pairs over PAIR_TOL

    def explain(self) -> str:
        return (f"{self.pairs} pairs, {self.tokens} tokens: {self.per_token_all:.2e}/token over all "
                f"(bar {PER_TOKEN_TOL:g}), worst pair {self.worst_per_token:.2e}/token (bar {PAIR_TOL:g}), "
                f"{self.over_per_token_tol} pairs over {PER_TOKEN_TOL:g} alone; failing: {list(self.failing)}")


def score_bar(pairs: Sequence[Pair]) -> ScoreBar:
    """Apply the bar to every pair; an empty set or a pair without tokens is refused (it would pass vacuously)."""
    if not pairs or any(p.tokens < 1 for p in pairs):
        raise ValueError("score_bar needs at least one pair, each with at least one token")
    per_pair = [abs(p.got - p.ref) / p.tokens for p in pairs]
    per_token_all = sum(abs(p.got - p.ref) for p in pairs) / sum(p.tokens for p in pairs)
    failing = tuple(i for i, d in enumerate(per_pair) if d > PAIR_TOL)
    return ScoreBar(ok=per_token_all <= PER_TOKEN_TOL and not failing, pairs=len(pairs),
                    tokens=sum(p.tokens for p in pairs), per_token_all=per_token_all,
                    worst_per_token=max(per_pair), over_per_token_tol=sum(d > PER_TOKEN_TOL for d in per_pair),
                    failing=failing)


#: each comparison the GPU test records: (engine's column, reference's column) in a row
COMPARISONS = {"fp16_vs_tf32": ("lmdeploy_fp16", "transformers_fp32"),
               "tf16_vs_tf32": ("transformers_fp16", "transformers_fp32"),
               "fp16_vs_tf16": ("lmdeploy_fp16", "transformers_fp16")}


def verdict(rows: Sequence[dict[str, Any]], dtype: str) -> tuple[dict[str, Any], list[str]]:
    """(summary, problems) of the GPU score test's rows: ``tokens``, the three engines' summed log-probabilities
    (``lmdeploy_fp16``, ``transformers_fp32``, ``transformers_fp16``) and ``is_greedy`` of each, per pair.

    Asserted (a problem each): LMDeploy against transformers float32 within the bar; transformers float16
    within the same bar (a bar float16 cannot meet shows here first); ``is_greedy`` equal to transformers' in
    the engine's dtype on every pair. Only recorded: LMDeploy against transformers float16, and the agreement
    of ``is_greedy`` with float32."""
    bars = {k: score_bar([Pair(got=r[a], ref=r[b], tokens=r["tokens"]) for r in rows])
            for k, (a, b) in COMPARISONS.items()}
    greedy = sum(r["is_greedy"]["lmdeploy"] == r["is_greedy"]["transformers_fp16"] for r in rows)
    greedy32 = sum(r["is_greedy"]["lmdeploy"] == r["is_greedy"]["transformers_fp32"] for r in rows)
    summary = {"pairs": len(rows), "asserted": f"score_bar: lmdeploy {dtype} vs transformers float32",
               "bar": bars["fp16_vs_tf32"].explain(), "bar_transformers_fp16": bars["tf16_vs_tf32"].explain(),
               "max_per_token_diff": {k: b.worst_per_token for k, b in bars.items()},
               "over_tolerance": {k: b.over_per_token_tol for k, b in bars.items()},
               "is_greedy_agree": greedy, "is_greedy_agree_tf32": greedy32,
               "tolerance": PER_TOKEN_TOL, "suite_dtype": dtype}
    problems = []
    if not bars["tf16_vs_tf32"].ok:
        problems.append(f"transformers {dtype} itself misses the bar: {bars['tf16_vs_tf32'].explain()}")
    if not bars["fp16_vs_tf32"].ok:
        problems.append(f"lmdeploy {dtype} misses the bar: {bars['fp16_vs_tf32'].explain()}")
    if greedy != len(rows):
        problems.append(f"is_greedy differs from transformers {dtype} on {len(rows) - greedy} pairs")
    return summary, problems
