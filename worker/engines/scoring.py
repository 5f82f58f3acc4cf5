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
    "continuation_ids",
    "continuation_score",
    "reward_text",
    "score_continuations",
]

LOGIT_BUDGET = 32 * 1024 * 1024
"""Most float32 logits (rows x positions x vocab) one scoring forward keeps: 128 MB. The continuations of
one request are cut into forwards of at most this many (a 64-way request over a big vocabulary would
otherwise hold gigabytes of logits at once)."""


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


def score_continuations(torch: Any, model: Any, prompt_ids: list[int], conts: list[list[int]], *, device: Any,
                        pad_id: int, vocab_size: int, accepts_logits_to_keep: bool,
                        budget: int = LOGIT_BUDGET) -> list[tuple[float, int, bool]]:
    """(sum logprob, tokens, is_greedy) per continuation after ``prompt_ids``: one forward over
    prompt + continuation per row, rows right-padded together (real tokens keep positions 0..n-1, the
    mask hides the padding), only the positions from the prompt's last token on turned into logits.
    The caller holds the model lock and inference mode."""
    p = len(prompt_ids)
    out: list[tuple[float, int, bool]] = []
    start = 0
    while start < len(conts):
        # as many rows as the logit budget allows, at least one
        end = start + 1
        while end < len(conts):
            keep = max(len(c) for c in conts[start:end + 1])
            if (end + 1 - start) * keep * max(vocab_size, 1) > budget:
                break
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
        logp = torch.log_softmax(logits.float(), dim=-1)
        for r, c in enumerate(chunk):
            rows = logp[r, : len(c)]
            target = torch.tensor(c, dtype=torch.long, device=device)
            picked = rows.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            greedy = bool((rows.argmax(-1) == target).all().item())
            out.append((float(picked.double().sum().item()), len(c), greedy))
        start = end
    return out


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
