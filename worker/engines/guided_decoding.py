"""Guided decoding (``response_format``) for the transformers engine, on xgrammar (what LMDeploy uses).

``response_format`` (json_schema / json_object / regex) is compiled once per request by a
:class:`GrammarCache` the engine shares across requests (xgrammar's compiler caches grammars); each
request then walks its grammar with its own :class:`GuidedMatcher`, which masks the tokens the grammar
forbids at every step. The request stops ('stop') when the grammar terminates (it accepted an end token)
or when it leaves no legal token.

xgrammar is imported on first use only: it pulls torch and triton, and requests without
``response_format`` never need it.
"""

from __future__ import annotations

import threading
from typing import Any

from lmdq.worker.engines.request_errors import BadRequest

__all__ = ["GrammarCache", "GuidedMatcher"]


class GrammarCache:
    """Compiles ``response_format`` with one lazily built xgrammar compiler (it caches grammars)."""

    def __init__(self, tokenizer: Any, tok_lock: threading.RLock, vocab_size: int, stop_token_ids: list[int]) -> None:
        """Nothing is built here: the compiler's tokenizer info is costly and only guided requests need it."""
        self._tokenizer = tokenizer
        self._tok_lock = tok_lock
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._info: Any = None

    def compile(self, response_format: Any) -> Any:
        """Compile ``response_format`` with xgrammar (compiler built on first use; it caches grammars)."""
        if response_format is None:
            return None
        from lmdq.contract import ResponseFormat
        from lmdq.guided import grammar_source

        rf = ResponseFormat.model_validate(response_format)
        try:
            import xgrammar as xgr
        except ImportError as exc:
            msg = f"response_format needs xgrammar on the worker (`pip install 'lmdq[cpu]'`): {exc}"
            raise BadRequest(msg) from exc
        try:
            kind, source = grammar_source(rf)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        with self._lock:
            if self._compiler is None:
                with self._tok_lock:
                    self._info = xgr.TokenizerInfo.from_huggingface(
                        self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
                    )
                self._compiler = xgr.GrammarCompiler(self._info, max_threads=1)
            compiler = self._compiler
        try:
            return compiler.compile_regex(source) if kind == "regex" else compiler.compile_json_schema(source)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError on a bad schema/regex
            raise BadRequest(f"response_format cannot be compiled: {exc}") from exc

    def matcher(self, grammar: Any) -> GuidedMatcher:
        """A fresh matcher for one request over ``grammar`` (which :meth:`compile` returned)."""
        return GuidedMatcher(grammar, self._info.vocab_size)


class GuidedMatcher:
    """One request's position in its grammar, and the token bitmask reused at every step."""

    def __init__(self, grammar: Any, vocab_size: int) -> None:
        """Allocate the matcher and a one-row bitmask of the grammar's vocabulary size."""
        import xgrammar as xgr

        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(grammar)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: Any) -> None:
        """Set the logits of the tokens the grammar forbids now to -inf, in place."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._xgr.apply_token_bitmask_inplace(logits, self._bitmask[0].to(logits.device))

    def exhausted(self, logits: Any, banned: list[int]) -> bool:
        """Whether the masked ``logits`` with ``banned`` also removed leave no token: the grammar is done."""
        legal = logits.clone()
        if banned:
            legal[banned] = -float("inf")
        return not bool(legal.isfinite().any())

    def accept(self, token: int) -> bool:
        """Advance the grammar by ``token``; False when the grammar rejects it."""
        return bool(self._matcher.accept_token(token))

    def is_terminated(self) -> bool:
        """Whether the grammar has accepted an end token (the output is complete)."""
        return bool(self._matcher.is_terminated())
