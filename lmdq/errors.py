"""lmdq's boundary errors: each names the bad input and what was expected.

Exit codes live here, in one place (:class:`ExitCode`); every CLI ends through :func:`run_cli`, so
an lmdq error, a Redis that is gone mid-command, or one that refuses writes is one line on stderr and
the documented code, never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from enum import IntEnum

import redis
import typer

try:  # typer >= 0.22 vendors click (typer._click); its CLIs raise these, not click's own
    from typer._click.exceptions import BadParameter, ClickException, MissingParameter, UsageError
except ImportError:  # pragma: no cover - older typer runs on click itself
    from click.exceptions import (  # type: ignore[assignment]
        BadParameter,
        ClickException,
        MissingParameter,
        UsageError,
    )

from lmdq.logs.redaction import redact_text

__all__ = [
    "IdempotencyConflict",
    "EXIT_CODES_HELP",
    "ExitCode",
    "LmdqError",
    "run_cli",
    "usage_line",
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
    """Base class; CLIs print ``str(err)`` on one line and exit non-zero."""

    exit_code: int = ExitCode.failed


def run_cli(app: Callable[..., object]) -> None:
    """Console entry point shared by the CLIs: an error becomes one line on stderr and its exit code.

    Usage errors (a bad flag value, an unknown option, a missing argument) are one ``error:`` line
    naming the flag and exit :attr:`ExitCode.bad_input`, not click's three-line usage block: the
    app runs in click's non-standalone mode, so they reach this function.

    Besides lmdq's own errors, a Redis that goes away after the connection was made (reset, timeout,
    still loading) exits :attr:`ExitCode.redis_unavailable`, and one that refuses a write exits
    :attr:`ExitCode.redis_refused`: both are facts about Redis, not bugs, so no traceback. Redis's
    own error text is redacted in case it quotes a URL, and so is every message (a safety net for
    URLs that came from a user's file or a results shard's error).
    """
    try:
        code = app(standalone_mode=False)
    except typer.Abort:  # EOF at a prompt
        _fail("aborted", ExitCode.failed)
    except ClickException as e:
        _fail(usage_line(e), e.exit_code)
    except LmdqError as e:
        _fail(redact_text(e), e.exit_code)  # a safety net: messages already name URLs redacted
    except (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError) as e:
        _fail(f"Redis refused the write: {_one_line(e)}", ExitCode.redis_refused)
    except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError) as e:
        _fail(f"lost the connection to Redis: {_one_line(e)}", ExitCode.redis_unavailable)
    else:
        # non-standalone click returns a typer.Exit's code (and a command's return value: None)
        if isinstance(code, int) and not isinstance(code, bool) and code:
            sys.exit(code)


def usage_line(e: ClickException) -> str:
    """A click error as one line: ``--metadata: expected k=v, got 'foo'`` for a bad value (the flag
    first, as lmdq's own errors name it), click's own sentence plus where help is otherwise."""
    text = e.format_message()
    if isinstance(e, BadParameter) and not isinstance(e, MissingParameter) and text.endswith(e.message):
        # "Invalid value for '--metadata': expected k=v" (the wording of every click version)
        hint = text[: len(text) - len(e.message)].removeprefix("Invalid value for ").removesuffix(": ")
        return _one_line(f"{hint.replace(chr(39), '')}: {e.message}" if hint else e.message)
    text = _one_line(text)
    ctx = getattr(e, "ctx", None)
    if isinstance(e, UsageError) and ctx is not None:
        text += f" (see '{ctx.command_path} --help')"
    return text


def _one_line(e: BaseException | str) -> str:
    """Foreign error text: redacted, and folded onto one line (a second line reads like a traceback)."""
    return " ".join(redact_text(e).split())


def _fail(message: str, code: int) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(int(code))


class BatchNotFound(LmdqError):
    def __init__(self, batch_id: str) -> None:
        super().__init__(f"no such batch: {batch_id!r} (see `lmdq-producer list`)")
        self.batch_id = batch_id


class UnknownModel(LmdqError):
    exit_code = ExitCode.bad_input


class SubmitRejected(LmdqError):
    """The input file was not accepted; nothing was enqueued."""

    exit_code = ExitCode.bad_input


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
    A ValueError too, as Python callers expect of a bad argument."""

    exit_code = ExitCode.bad_input


class WaitTimeout(LmdqError, TimeoutError):
    """A wait (``Batch.wait``, ``as_completed``, ``results --wait --timeout``) gave up before the batch ended."""
