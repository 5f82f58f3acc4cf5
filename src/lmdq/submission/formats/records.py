"""The prompt parser's shared vocabulary: formats, limits, the records it yields, and line errors.

Every format module builds :class:`ParsedLine` and raises :class:`_LineError`; the reader in
:mod:`producer.formats` turns those into what callers see, so the types live apart from both.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from lmdq.contract import Endpoint, GenerationParams
from lmdq.settings import default_of
from lmdq.submission.settings import ProducerSettings


class InputFormat(str, Enum):
    """The three prompt-file formats lmdq reads."""

    text = "text"
    jsonl = "jsonl"
    openai = "openai"


@dataclass(frozen=True)
class InputLimits:
    """Per-file guards so one bad file cannot exhaust producer memory or Redis (``LMDQ_MAX_LINE_BYTES``,
    ``LMDQ_MAX_REQUESTS``: declared in :class:`ProducerSettings`, whose defaults these are)."""

    max_line_bytes: int = default_of(ProducerSettings, "max_line_bytes")
    max_requests: int = default_of(ProducerSettings, "max_requests")

    @classmethod
    def of(cls, settings: ProducerSettings) -> InputLimits:
        """The limits a producer's settings set."""
        return cls(max_line_bytes=settings.max_line_bytes, max_requests=settings.max_requests)


@dataclass(frozen=True)
class InputError:
    """One problem in a prompt file; ``line`` is 1-based, 0 for whole-file problems."""

    path: str
    line: int
    field: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line > 0 else self.path
        if self.field:
            return f"{where}: field '{self.field}': {self.message}"
        return f"{where}: {self.message}"


class Sampling(str, Enum):
    """What a line's sampling knobs did without an explicit ``do_sample`` (submit warns once per
    file with a count, not once per line)."""

    #: ``temperature`` > 0 turned sampling on (0 turned it off), as OpenAI and vLLM do
    implied = "implied"
    #: ``top_p``/``top_k``/``min_p`` without ``temperature``: sampling stays as the batch sets it
    #: (greedy by default), where they have no effect
    inert = "inert"


@dataclass(frozen=True)
class ParsedLine:
    """One valid request line; ``messages`` are the file's own dicts, already checked."""

    line_no: int
    custom_id: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    endpoint: Endpoint
    params: GenerationParams | None
    model: str | None
    sampling: Sampling | None = None
    #: endpoint ``score`` only: the texts to score after the prompt
    continuations: tuple[str, ...] | None = None

    @classmethod
    def make(cls, line_no: int, custom_id: str, prompt: str | None, messages: list[dict[str, Any]] | None,
             endpoint: Endpoint, params: GenerationParams | None, model: str | None, sampling: Sampling | None = None,
             continuations: tuple[str, ...] | None = None) -> ParsedLine:
        """``ParsedLine(...)`` for the parsers' hot path: the same frozen object, its fields set at once rather
        than by the frozen dataclass's ``object.__setattr__`` per field (3x slower: issue 49)."""
        self = object.__new__(cls)
        self.__dict__.update(line_no=line_no, custom_id=custom_id, prompt=prompt, messages=messages,
                             endpoint=endpoint, params=params, model=model, sampling=sampling,
                             continuations=continuations)
        return self


class _LineError(Exception):
    """Internal: the first problem found on a line (turned into an InputError by the caller)."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def _got(value: Any) -> str:
    """A short, JSON-flavoured description of a user value for 'got ...' (never a 10 MB dump)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...")
    if isinstance(value, (int, float)):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    if isinstance(value, list):
        return f"a list of {len(value)} item{'s' if len(value) != 1 else ''}"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _join(names: tuple[str, ...] | list[str]) -> str:
    return "|".join(names)
