"""Rich outputs of one transformers-engine request: logprobs, logits and last hidden states.

These follow GenerationConfig's ``logprobs`` / ``output_logits`` / ``output_last_hidden_state``:

* ``logprobs=k``: per generated token, the chosen token's logprob and the top-k, from ``log_softmax`` of
  the RAW model logits of that step (before bans, the grammar mask, penalties and temperature), i.e.
  LMDeploy's ``logprobs_mode='raw_logprobs'``. A stop token is not a generated token and gets no row.
* ``output_logits`` / ``output_last_hidden_state`` follow LMDeploy TurboMind's row layout: 'generation'
  is one row per generated token (the raw logits / final-norm hidden state of the position that
  produced it: ``[generated, vocab|hidden]``); 'all' adds every prompt position before it, i.e. one row
  per position whose next token is known: ``[input + generated - 1, ...]`` (the last generated token
  is never fed back). float32 CPU tensors on the final event's ``tensors``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RichOutputs"]


class RichOutputs:
    """Collects one request's rows step by step, then hands them over with its final event."""

    def __init__(self, torch: Any, logprobs: int | None, output_logits: str | None, output_hidden: str | None) -> None:
        """``torch`` is the engine's module (imported lazily there); the rest are the request's settings."""
        self._torch = torch
        self.logprobs = logprobs
        self.output_logits = output_logits
        self.output_hidden = output_hidden
        #: the prefill must also keep the prompt positions' rows
        self.want_all = "all" in (output_logits, output_hidden)
        #: the forward passes must return hidden states
        self.want_hidden = output_hidden is not None
        self._logprob_rows: list[tuple[int, float, list[tuple[int, float]]]] = []
        self._logit_rows: list[Any] = []
        self._hidden_rows: list[Any] = []

    def add_prompt(self, logits: Any, hidden: Any) -> None:
        """'all': the prompt positions before the last one (their next token is known)."""
        if self.output_logits == "all":
            self._logit_rows.append(logits[0, :-1].float().cpu())
        if self.output_hidden == "all" and hidden is not None:
            self._hidden_rows.append(hidden[:-1].cpu())

    def add_token(self, token: int, raw: Any, hidden: Any) -> None:
        """The rows of one generated ``token``, from the step's raw logits and hidden states."""
        torch = self._torch
        if self.logprobs is not None:
            lp = torch.log_softmax(raw, dim=-1)
            top: list[tuple[int, float]] = []
            if self.logprobs > 0:
                vals, ids = torch.topk(lp, min(self.logprobs, lp.numel()))
                top = [(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist())]
            self._logprob_rows.append((token, float(lp[token]), top))
        if self.output_logits is not None:
            self._logit_rows.append(raw.cpu().unsqueeze(0))
        if hidden is not None:
            self._hidden_rows.append(hidden[-1:].cpu())

    def logprob_rows(self) -> list[tuple[int, float, list[tuple[int, float]]]] | None:
        """The final event's ``logprobs`` (None when not asked for)."""
        return self._logprob_rows if self.logprobs is not None else None

    def tensors(self, vocab_size: int, hidden_size: int) -> dict[str, Any]:
        """The final event's ``tensors`` (empty when none was asked for)."""
        tensors: dict[str, Any] = {}
        if self.output_logits is not None:
            tensors["logits"] = _stack(self._torch, self._logit_rows, vocab_size)
        if self.output_hidden is not None:
            tensors["last_hidden_state"] = _stack(self._torch, self._hidden_rows, hidden_size)
        return tensors


def _stack(torch: Any, rows: list[Any], width: int) -> Any:
    """Row blocks → one float32 CPU tensor ``[rows, width]`` (``[0, width]`` when nothing was generated)."""
    if not rows:
        return torch.zeros((0, width), dtype=torch.float32)
    return torch.cat(rows, dim=0).to(torch.float32).contiguous()
