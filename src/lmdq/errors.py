"""lmdq's boundary errors: each names the bad input and what was expected.

Exit codes live here, in one place (:class:`ExitCode`); every CLI ends through
:func:`lmdq.cli.run.run_cli`, so an lmdq error, a Redis that is gone mid-command, or one that refuses
writes is one line on stderr and the documented code, never a traceback.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

__all__ = [
    "IdempotencyConflict",
    "EXIT_CODES_HELP",
    "InputProblem",
    "ExitCode",
    "LmdqError",
    "BadSetting",
    "BatchNotFound",
    "InvalidArgument",
    "RedisRefused",
    "RedisUnavailable",
    "ResultsUnavailable",
    "PurgeRefused",
    "RetryRejected",
    "SubmitRejected",
    "UnknownModel",
    "WaitTimeout",
]


class ExitCode(IntEnum):
    """What a CLI's exit status means; scripts branch on these, so they never change meaning."""

    ok = 0
    failed = 1
    """A runtime error: unknown batch, nothing to retry, a --wait that timed out."""
    bad_input = 2
    """The input (file, flag, setting) was refused; nothing was enqueued."""
    redis_unavailable = 3
    """Redis unreachable, frozen (timeout), refusing the credentials, or a malformed Redis URL."""
    results_unavailable = 4
    """A batch's results shard could not be read."""
    redis_refused = 5
    """Redis is reachable but refused a write (out of memory, read-only replica); nothing left behind."""


EXIT_CODES_HELP = (
    "Exit codes: 0 ok; 1 runtime error (unknown batch, nothing to retry, --wait timed out); "
    "2 bad input (file, flag or setting; nothing enqueued); "
    "3 Redis unreachable, timed out, bad URL or credentials; 4 results shard unreadable; "
    "5 Redis refused the write (out of memory, read-only; nothing left behind)."
)
"""The exit code table for CLI ``--help`` epilogs (README.md has the same table)."""


class LmdqError(Exception):
    """Base class; CLIs print ``str(err)`` on one line and exit non-zero. ``message`` is that text."""

    exit_code: int = ExitCode.failed

    @property
    def message(self) -> str:
        """The error's text, as the CLIs print it (``str(err)``)."""
        return str(self.args[0]) if self.args else ""


class BatchNotFound(LmdqError):
    def __init__(self, batch_id: str) -> None:
        super().__init__(f"no such batch: {batch_id!r} (see `lmdq-producer list`)")
        self.batch_id = batch_id


class UnknownModel(LmdqError):
    exit_code = ExitCode.bad_input


_ROW = re.compile(r"^(?P<source>.+?): (?:row (?P<row>\d+)(?: \((?P<base>[01])-based\))?|index (?P<index>.+?))"
                  r"(?:: column '(?P<column>[^']*)')?: (?P<message>.*)$", re.S)
_LINE = re.compile(r"^(?P<source>.+?):(?P<line>\d+): (?:field '(?P<field>[^']*)': )?(?P<message>.*)$", re.S)


@dataclass(frozen=True)
class InputProblem:
    """One thing wrong with a submit: where it is and what was expected.

    ``row`` or ``line`` says where. ``row``: a row's 0-based position in its source, whatever the source
    (``df.iloc[p.row]``, ``table.slice(p.row, 1)``, ``rows[p.row]``), while the text names the row as the
    source's user counts it and says which count: a DataFrame's index label (``DataFrame: index 'a7'``),
    a Parquet/CSV file's 1-based row (``q.csv: row 4 (1-based)``, the header not counted), an in-memory
    table's or iterable's position (``rows: row 3 (0-based)``). ``index``: a pandas DataFrame row's index
    label (``df.loc[p.index]``), None for every other source. ``line``: a prompt file's 1-based line
    (``q.jsonl:4``; None for an error about the whole file). ``column`` is the source column (tabular
    sources and dict rows), ``field`` the JSON field (a prompt file's line) or the submit option
    (``result_ttl``, ``temperature`` ...); ``value`` the value refused, where it is known (an option's,
    a row's cell); ``message`` what was expected, without the location."""

    message: str
    source: str | None = None
    row: int | None = None
    line: int | None = None
    column: str | None = None
    field: str | None = None
    value: Any = None
    index: Hashable | None = None

    @classmethod
    def parse(cls, text: str) -> InputProblem:
        """A problem from its one-line form (``src: row 4 (1-based): column 'q': ...``, ``DataFrame: index
        'a7': ...``, ``path:3: field 'f': ...``); text in none of them is a problem with a message only. A
        row said 1-based becomes its 0-based ``row``; a bare ``row N`` is 0-based; an index label is read
        back as a Python literal where it is one (``'a7'``, ``42``), else kept as its text."""
        m = _ROW.match(text)
        if m and m["index"] is not None:
            try:
                label: Hashable = ast.literal_eval(m["index"])
            except (ValueError, SyntaxError):
                label = m["index"]
            return cls(message=m["message"], source=m["source"], index=label, column=m["column"])
        if m:
            row = int(m["row"]) - (1 if m["base"] == "1" else 0)
            return cls(message=m["message"], source=m["source"], row=row, column=m["column"])
        m = _LINE.match(text)
        if m:
            return cls(message=m["message"], source=m["source"], line=int(m["line"]), field=m["field"])
        return cls(message=text)


class SubmitRejected(LmdqError):
    """The input (a source's rows or lines, or a submit option) was not accepted; nothing was enqueued.

    ``str(err)`` is every problem, one a line (as the CLIs print it), each row named as its source's user
    counts it (a DataFrame's index label, a file's 1-based row or line, an in-memory position said 0-based).
    The problems are data too: ``err.problems`` (each an :class:`InputProblem`), and the first one's
    ``row`` (0-based position, always), ``index`` (a DataFrame row's label), ``line``, ``column``,
    ``field``, ``value`` on the error itself (``except SubmitRejected as e: df.iloc[e.row]``, or
    ``df.loc[e.index]``)."""

    exit_code = ExitCode.bad_input

    def __init__(self, message: str, *, problems: Sequence[InputProblem] | None = None) -> None:
        super().__init__(message)
        self.problems: tuple[InputProblem, ...] = (
            tuple(problems) if problems is not None
            else tuple(InputProblem.parse(ln) for ln in message.split("\n") if ln.strip())
        )

    def _first(self) -> InputProblem:
        return self.problems[0] if self.problems else InputProblem(message=self.message)

    @property
    def source(self) -> str | None:
        """What the first problem's location names: a file's path, ``DataFrame``, ``rows`` ..."""
        return self._first().source

    @property
    def row(self) -> int | None:
        """The first bad row's 0-based position in a DataFrame, Parquet/CSV file, Arrow object or Python
        rows (``df.iloc[e.row]``), whichever count the message uses."""
        return self._first().row

    @property
    def index(self) -> Hashable | None:
        """The first bad row's index label, for a pandas DataFrame (``df.loc[e.index]``); None otherwise."""
        return self._first().index

    @property
    def line(self) -> int | None:
        """The first bad line (1-based) of a prompt file (None: the problem is not on one line)."""
        return self._first().line

    @property
    def column(self) -> str | None:
        """The first problem's column (tabular sources, dict rows)."""
        return self._first().column

    @property
    def field(self) -> str | None:
        """The first problem's JSON field (a prompt file's line) or submit option (``result_ttl``)."""
        return self._first().field

    @property
    def value(self) -> Any:
        """The value the first problem refused, where it is known (None otherwise)."""
        return self._first().value


class IdempotencyConflict(SubmitRejected):
    """An idempotency key already bound to a batch of another file or other options; nothing was enqueued."""


class RetryRejected(LmdqError):
    """``retry`` found nothing to resubmit, or the batch cannot be retried (yet); nothing was enqueued."""


class PurgeRefused(LmdqError):
    """``purge`` / ``results --delete`` refused: the batch has not ended (``--force`` overrides purge's)."""

    exit_code = ExitCode.bad_input


class RedisUnavailable(LmdqError):
    """Redis could not be reached, timed out, refused our credentials, or its URL is malformed."""

    exit_code = ExitCode.redis_unavailable


class ResultsUnavailable(LmdqError):
    """A batch's results shard (its results URL) could not be read."""

    exit_code = ExitCode.results_unavailable


class RedisRefused(LmdqError):
    """Redis is reachable but refused a write (out of memory under ``maxmemory``, a read-only
    replica): nothing was left behind, and retrying later or elsewhere can succeed."""

    exit_code = ExitCode.redis_refused


class BadSetting(LmdqError, ValueError):
    """A worker/engine setting (flag or ``LMDQ_*`` env var) with a bad value, or one the chosen engine does
    not take: named by its flag and env var, exit 2 like any usage error. A ValueError too, so code that
    validates settings keeps catching it as one."""

    exit_code = ExitCode.bad_input


class InvalidArgument(LmdqError, ValueError):
    """An argument of an lmdq call (a CLI flag, a Python keyword) with a bad value; nothing was done.
    A ValueError too, as Python callers expect of a bad argument. ``field``: the argument's name where
    the caller named it (None otherwise), ``value``: the value refused, where it is known."""

    exit_code = ExitCode.bad_input

    def __init__(self, message: str, *, field: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.field = field
        self.value = value


class WaitTimeout(LmdqError, TimeoutError):
    """A wait (``Batch.wait``, ``as_completed``, ``results --wait --timeout``) gave up before the batch ended."""
