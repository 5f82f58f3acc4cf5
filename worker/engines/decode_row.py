"""One request's decoding state inside the transformers engine's batched decode loop.

The batched loop (:meth:`TransformersEngine._generate_batch`) owns the model, the padded KV cache and
the attention mask; each row owns everything that is about its request alone: its token history (for the
repetition penalty), its seeded generator, the generated ids, the decoded text, what was already
streamed, and why it finished. Keeping that here means a row's stop/length/hold-back rules are the
same code whichever batch it runs in, so a row's output depends only on its own logits.
"""

from __future__ import annotations

import threading
from typing import Any

from lmdq.contract import FinishReason
from lmdq.worker.engines.base import EngineEvent
from lmdq.worker.engines.rich_outputs import RichOutputs
from lmdq.worker.engines.sampling import Sampling, next_token
from lmdq.worker.engines.stop_words import REPLACEMENT_CHAR, find_stop, safe_text_end

__all__ = ["EVENT_EVERY_TOKENS", "DecodeRow", "batchable"]

#: Emit an (empty-delta) progress event at least this often, even while text is held back.
EVENT_EVERY_TOKENS = 4


def batchable(s: Sampling) -> bool:
    """Whether a request can share a padded batch: not guided, no hidden states, no prompt-position logits.

    Guided decoding needs a per-step grammar walk and hidden states / 'all' logits need extra forward
    outputs; those requests run alone (the one-at-a-time loop), which is simpler and exactly as before.
    Logprobs and 'generation' logits come from the row's own raw logits, so they batch.
    """
    return s.grammar is None and s.output_hidden is None and s.output_logits != "all"


class DecodeRow:
    """A request's state across decode steps; :meth:`advance` applies one picked token."""

    def __init__(
        self,
        index: int,
        input_ids: list[int],
        s: Sampling,
        *,
        torch: Any,
        device: Any,
        vocab_size: int,
        tokenizer: Any,
        tok_lock: threading.RLock,
    ) -> None:
        """``tokenizer`` / ``tok_lock`` are the engine's (the Rust tokenizer must not be used concurrently)."""
        self.index = index
        self.input_len = len(input_ids)
        self.s = s
        self._torch = torch
        self._tokenizer = tokenizer
        self._tok_lock = tok_lock
        self._vocab_size = vocab_size
        self.history = torch.tensor(input_ids, dtype=torch.long, device=device)
        self.generator = None if s.greedy else torch.Generator(device=device).manual_seed(s.seed)
        self._min_ban = sorted(i for i in s.stop_ids if i < vocab_size)
        self.rich = RichOutputs(torch, s.logprobs, s.output_logits, s.output_hidden)
        self.gen_ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self._last_event_at = 0
        self.finish: FinishReason | None = None
        #: prompt tokens computed for this row: all of them, or 0 when it shares another row's prefill
        self.prefilled = self.input_len

    def banned(self) -> list[int]:
        """Ids this step may not pick: ignore_eos bans, plus the stop ids until min_new_tokens exist."""
        banned: list[int] = self.s.banned_ids + (self._min_ban if len(self.gen_ids) < self.s.min_new_tokens else [])
        return banned

    def pick(self, logits: Any) -> int:
        """The next token from this row's step logits (a 1-D float tensor, modified in place)."""
        raw = logits.clone() if (self.s.logprobs is not None or self.s.output_logits is not None) else None
        token: int = next_token(self._torch, logits, self.history, self.s, self.banned(), self.generator)
        if raw is not None and token not in self.s.stop_ids:
            self.rich.add_token(token, raw, None)
        return token

    def advance(self, token: int) -> EngineEvent | None:
        """Apply ``token``: sets :attr:`finish` when the request is done, else may return a progress event."""
        s = self.s
        if token in s.stop_ids:
            self.finish = FinishReason.stop
            return None
        self.gen_ids.append(token)
        self.history = self._torch.cat([self.history, self.history.new_tensor([token])])
        stable_before = len(self.text.rstrip(REPLACEMENT_CHAR))
        with self._tok_lock:
            self.text = self._tokenizer.decode(
                self.gen_ids, skip_special_tokens=s.skip_special_tokens, clean_up_tokenization_spaces=False
            )
        if s.stop_words and len(self.gen_ids) > s.min_new_tokens:
            # Stop words ending inside the first min_new_tokens tokens don't count (LMDeploy bans stop
            # tokens there); stable_before keeps U+FFFD-completed characters searchable.
            pos = find_stop(self.text, s.stop_words, stable_before)
            if pos is not None:
                self.text, self.finish = self.text[:pos], FinishReason.stop
                return None
        if len(self.gen_ids) >= s.max_new_tokens:
            self.finish = FinishReason.length
            return None
        end = safe_text_end(self.text, s.stop_words)
        if end > self.emitted or len(self.gen_ids) - self._last_event_at >= EVENT_EVERY_TOKENS:
            delta = self.text[self.emitted : end] if end > self.emitted else ""
            self.emitted = max(self.emitted, end)
            self._last_event_at = len(self.gen_ids)
            return EngineEvent(
                index=self.index, text=delta, input_token_len=self.input_len, generate_token_len=len(self.gen_ids)
            )
        return None

    def final_event(self, finish: FinishReason | None = None) -> EngineEvent:
        """The request's one final event (``finish`` overrides, e.g. 'abort'), with the unsent text tail."""
        tensors = self.rich.tensors(self._vocab_size, 0)
        return EngineEvent(
            index=self.index,
            text=self.text[self.emitted :] if len(self.text) > self.emitted else "",
            input_token_len=self.input_len,
            generate_token_len=len(self.gen_ids),
            finish_reason=finish or self.finish,
            logprobs=self.rich.logprob_rows(),
            tensors=tensors or None,
            prefill_token_len=self.prefilled,
        )
