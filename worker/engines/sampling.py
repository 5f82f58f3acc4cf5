"""The decoding settings of one transformers-engine request, and the pick of each next token.

Greedy (``do_sample=False``) is argmax and, like LMDeploy, ignores temperature/top-k/top-p and
repetition_penalty. Sampling applies repetition penalty, temperature, top-k, top-p, min-p in that order
and draws with the request's seeded ``torch.Generator``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Sampling", "next_token"]


@dataclass
class Sampling:
    """The effective decoding settings of one request (LMDeploy's resolved GenerationConfig)."""

    max_new_tokens: int
    min_new_tokens: int
    greedy: bool
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int
    stop_words: list[str]
    stop_ids: set[int]
    banned_ids: list[int]
    skip_special_tokens: bool
    logprobs: int | None = None
    output_logits: str | None = None
    output_hidden: str | None = None
    grammar: Any = None  # a compiled xgrammar grammar, or None


def next_token(torch: Any, logits: Any, history: Any, s: Sampling, banned: list[int], generator: Any) -> int:
    """Pick one token: argmax for greedy, else penalty -> temperature -> top-k -> top-p -> min-p -> draw."""
    if banned:
        logits[banned] = -float("inf")
    if s.greedy:
        return int(torch.argmax(logits).item())
    if s.repetition_penalty != 1.0:
        seen = history.unique()
        scores = logits[seen]
        logits[seen] = torch.where(scores < 0, scores * s.repetition_penalty, scores / s.repetition_penalty)
    logits = logits / s.temperature
    if 0 < s.top_k < logits.numel():
        kth = torch.topk(logits, s.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) > s.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if s.min_p > 0.0:
        probs = probs.masked_fill(probs < s.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=generator).item())
