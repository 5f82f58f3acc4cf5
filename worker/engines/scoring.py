"""Scoring without generation: continuation log-likelihoods and reward-model scores.

What the ``score`` and ``reward`` endpoints compute, shared by the engines (docs/outputs.md, "Scores"):

* **Tokenization boundary** (lm-eval-harness' ``loglikelihood``): the prompt is tokenized as the
  engine tokenizes any prompt (``prompt``: raw text with the tokenizer's special tokens, i.e. BOS, as
  the completion endpoint does; ``messages``: the chat template with the generation prompt, as the chat
  endpoint does), each continuation on its own WITHOUT special tokens, and the ids are concatenated. So
  a continuation is scored token by token exactly as it would have been generated after that prompt
  (tokenizing prompt + continuation as one string could merge tokens across the boundary and score
  something the model never chooses). lmdq does not move whitespace across the boundary: lm-eval's
  own ``_encode_pair`` moves the prompt's trailing spaces into the continuation before it asks, and
  a caller wanting the same sends the pair already split that way.
* **Score**: the sum over the continuation's tokens of ``log_softmax(logits)[token]`` at the position
  before each, in float32; ``is_greedy`` is True when each of those tokens is the argmax there.
* **Reward**: the chat (``messages``, its last turn usually the assistant answer being judged) is
  rendered with the chat template WITHOUT a generation prompt and tokenized with special tokens; the
  score is the model's value at the last token (LMDeploy's ``get_reward_score`` takes the last
  position's logit; a transformers ``*ForSequenceClassification`` head with one label pools the last
  token the same way).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from lmdq.worker.engines.request_errors import BadRequest

__all__ = [
    "LOGIT_BUDGET",
    "logit_positions",
    "continuation_ids",
    "continuation_score",
    "reward_text",
    "score_continuations",
]

LOGIT_BUDGET = 32 * 1024 * 1024
"""Most float32 logits (rows x positions x vocab) one scoring forward keeps: 128 MB (LMDeploy's
``get_logits`` calls). The transformers engine's budget is its ``score_logits_mb`` setting
(:func:`score_continuations`), which also bounds ONE long continuation."""


def continuation_ids(tokenizer: Any, lock: threading.RLock, continuations: Sequence[str]) -> list[list[int]]:
    """Each continuation's ids, tokenized alone and without special tokens (no BOS in the middle)."""
    out: list[list[int]] = []
    with lock:
        for i, text in enumerate(continuations):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if not ids:
                raise BadRequest(f"continuations[{i}] encodes to zero tokens")
            out.append([int(t) for t in ids])
    return out


def reward_text(tokenizer: Any, lock: threading.RLock, messages: list[dict[str, Any]],
                chat_template: str | None) -> str:
    """The chat as a reward model reads it: the template without a generation prompt."""
    from jinja2 import TemplateError

    if not chat_template:
        raise BadRequest("this reward model has no chat template (pass --chat-template)")
    try:
        with lock:
            text = tokenizer.apply_chat_template(messages, chat_template=chat_template,
                                                 add_generation_prompt=False, tokenize=False)
    except (TemplateError, TypeError, ValueError, KeyError) as exc:
        raise BadRequest(f"the chat template rejected the messages: {exc}") from exc
    if not isinstance(text, str):
        raise BadRequest("the chat template did not render to text")
    return text


def logit_positions(budget_bytes: int, vocab_size: int, logit_bytes: int = 4) -> int:
    """Positions whose logits one scoring forward may turn out within ``budget_bytes`` (at least one): each
    position costs its logits in the model's dtype (``logit_bytes`` per value), their float32 copy and the
    float32 log-softmax, over the whole vocabulary."""
    per_position = max(vocab_size, 1) * (logit_bytes + 8)
    return max(1, budget_bytes // per_position)


def score_continuations(torch: Any, model: Any, prompt_ids: list[int], conts: list[list[int]], *, device: Any,
                        pad_id: int, vocab_size: int, accepts_logits_to_keep: bool,
                        budget_bytes: int = 4 * LOGIT_BUDGET, logit_bytes: int = 4,
                        cache_kwarg: str = "past_key_values") -> list[tuple[float, int, bool]]:
    """(sum logprob, tokens, is_greedy) per continuation after ``prompt_ids``, never holding more than
    ``budget_bytes`` of logits (and their float32 log-softmax) at once, however long a continuation is.

    Short continuations: one forward over prompt + continuation per row, rows right-padded together (real
    tokens keep positions 0..n-1, the mask hides the padding), only the positions from the prompt's last
    token on turned into logits, as many rows as the budget holds. A continuation whose logits alone
    exceed the budget: :func:`_score_in_chunks`, the sequence fed in chunks of positions through the KV
    cache (chunked prefill), each chunk's logits reduced to its log-probs before the next.
    The caller holds the model lock and inference mode."""
    p = len(prompt_ids)
    limit = logit_positions(budget_bytes, vocab_size, logit_bytes)

    def positions(rows: Sequence[list[int]]) -> int:  # logit positions of one padded forward over ``rows``
        longest = max(len(c) for c in rows)
        return len(rows) * (longest + 1 if accepts_logits_to_keep else p + longest)

    out: list[tuple[float, int, bool]] = []
    start = 0
    while start < len(conts):
        if positions(conts[start:start + 1]) > limit:
            out.append(_score_in_chunks(torch, model, prompt_ids, conts[start], device=device, step=limit,
                                        accepts_logits_to_keep=accepts_logits_to_keep, cache_kwarg=cache_kwarg))
            start += 1
            continue
        end = start + 1  # as many rows as the budget allows
        while end < len(conts) and positions(conts[start:end + 1]) <= limit:
            end += 1
        chunk = conts[start:end]
        width = p + max(len(c) for c in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(chunk), width), dtype=torch.long, device=device)
        for r, c in enumerate(chunk):
            ids[r, : p + len(c)] = torch.tensor(prompt_ids + c, dtype=torch.long, device=device)
            mask[r, : p + len(c)] = 1
        kwargs: dict[str, Any] = {"attention_mask": mask, "use_cache": False}
        keep_from = p - 1  # the logit at position i predicts token i + 1
        if accepts_logits_to_keep:
            kwargs["logits_to_keep"] = width - keep_from
        logits = model(input_ids=ids, **kwargs).logits
        if not accepts_logits_to_keep:
            logits = logits[:, keep_from:]
        for r, c in enumerate(chunk):
            target = torch.tensor(c, dtype=torch.long, device=device)
            total, greedy = _logprob_sum(torch, logits[r, : len(c)], target)
            out.append((total, len(c), greedy))
        del logits
        start = end
    return out


def _logprob_sum(torch: Any, logits: Any, target: Any) -> tuple[float, bool]:
    """(sum of log_softmax(logits)[target] in float64, whether each target is the argmax): ``logits`` is
    ``[n, vocab]``, the log-softmax in float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    greedy = bool((logits.argmax(-1) == target).all().item())
    return float(picked.double().sum().item()), greedy


def _score_in_chunks(torch: Any, model: Any, prompt_ids: list[int], cont: list[int], *, device: Any, step: int,
                     accepts_logits_to_keep: bool, cache_kwarg: str) -> tuple[float, int, bool]:
    """One continuation too long for the logit budget: prompt + continuation (but its last token, whose
    logit predicts nothing) fed ``step`` positions at a time after a KV cache of what came before, so a
    forward turns out at most ``step`` positions of logits. The model's own forward runs every chunk (any
    logit soft-capping or scaling it applies is kept); a model without ``logits_to_keep`` also takes the
    prompt in chunks, since it returns logits for every position it is fed. ``cache_kwarg``: the forward's
    (and its output's) name for the KV cache (``past_key_values``; ``cache`` from transformers 5.2x)."""
    ids = prompt_ids + cont
    first = len(prompt_ids) - 1  # the first position whose logit is scored (it predicts cont[0])
    last = len(ids) - 1  # positions first..last-1 are fed and scored; ids[last] is only a target
    total, greedy, cache = 0.0, True, None
    a = 0
    while a < last:
        # the whole prompt in the first forward (with logits_to_keep): only its logits are bounded
        b = min(last, first + step) if accepts_logits_to_keep and a == 0 else min(last, a + step)
        kwargs: dict[str, Any] = {"use_cache": True, cache_kwarg: cache,
                                  "attention_mask": torch.ones((1, b), dtype=torch.long, device=device)}
        scored_from = max(a, first)
        if accepts_logits_to_keep:
            kwargs["logits_to_keep"] = max(b - scored_from, 1)
        seg = torch.tensor([ids[a:b]], dtype=torch.long, device=device)
        result = model(input_ids=seg, **kwargs)
        cache = getattr(result, cache_kwarg)
        if b > scored_from:
            logits = result.logits[0, -(b - scored_from):]
            target = torch.tensor(ids[scored_from + 1: b + 1], dtype=torch.long, device=device)
            part, part_greedy = _logprob_sum(torch, logits, target)
            total += part
            greedy = greedy and part_greedy
            del logits
        del result
        a = b
    return total, len(cont), greedy


def continuation_score(logits: Any, prompt_len: int, cont: list[int]) -> tuple[float, int, bool]:
    """(sum logprob, tokens, is_greedy) of ``cont`` from the logits of every position of prompt +
    continuation (``[len, vocab]``, any dtype and device): only the rows that predict the continuation
    (from the prompt's last token on) are taken, log_softmax in float32, the sum in float64."""
    import torch

    rows = logits[prompt_len - 1: prompt_len - 1 + len(cont)].float()
    if rows.shape[0] != len(cont):
        raise ValueError(f"{rows.shape[0]} logit rows for a continuation of {len(cont)} tokens")
    target = torch.tensor(cont, dtype=torch.long, device=rows.device)
    logp = torch.log_softmax(rows, dim=-1)
    picked = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    greedy = bool((rows.argmax(-1) == target).all().item())
    return float(picked.double().sum().item()), len(cont), greedy
