"""lmdq's boundary errors: each names the bad input and what was expected.

Exit codes live here, in one place (:class:`ExitCode`); every CLI ends through
:func:`lmdq.cli.run.run_cli`, so an lmdq error, a Redis that is gone mid-command, or one that refuses
writes is one line on stderr and the documented code, never a traceback.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = [
    "IdempotencyConflict",
    "EXIT_CODES_HELP",
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
    """Base class; CLIs print ``str(err)`` on one line and exit non-zero."""

    exit_code: int = ExitCode.failed


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
