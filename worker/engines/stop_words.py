"""Streaming decoded text safely: where stop words start, and which tail to hold back for now.

The transformers engine re-decodes all generated tokens each step; these helpers say how much of that
text may be emitted and whether (and where) a stop word ended it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["REPLACEMENT_CHAR", "find_stop", "safe_text_end"]

#: What the tokenizer decodes an incomplete multi-byte character to.
REPLACEMENT_CHAR = "\ufffd"


def safe_text_end(text: str, stop_words: Sequence[str]) -> int:
    """How much of ``text`` may be streamed now: everything except a tail that might still change.

    Held back: a trailing run of U+FFFD (an incomplete multi-byte character that the next token may
    complete) and the longest tail that is a proper prefix of a stop word (it may become the stop word,
    which must not be emitted).
    """
    end = len(text.rstrip(REPLACEMENT_CHAR))
    body = text[:end]
    for word in stop_words:
        for k in range(min(len(word) - 1, len(body)), 0, -1):
            if body.endswith(word[:k]):
                end = min(end, len(body) - k)
                break
    return end


def find_stop(text: str, stop_words: Sequence[str], checked_end: int = 0) -> int | None:
    """Start index of the earliest stop word in ``text`` that ends after ``checked_end``, else None.

    ``checked_end`` is how much text was already searched, so each step only looks at the new tail.
    """
    best: int | None = None
    for word in stop_words:
        pos = text.find(word, max(0, checked_end - len(word) + 1))
        if pos != -1 and (best is None or pos < best):
            best = pos
    return best
