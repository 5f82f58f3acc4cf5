"""lmdq's boundary errors: each names the bad input and what was expected."""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = [
    "LmdqError",
    "run_cli",
    "BadSetting",
    "BatchNotFound",
    "RedisRefused",
    "RedisUnavailable",
    "ResultsUnavailable",
    "RetryRejected",
    "SubmitRejected",
    "UnknownModel",
]


class LmdqError(Exception):
    """Base class; CLIs print ``str(err)`` on one line and exit non-zero."""

    exit_code = 1


def run_cli(app: Callable[[], object]) -> None:
    """Console entry point shared by the CLIs: an lmdq error becomes one line on stderr and its exit code."""
    try:
        app()
    except LmdqError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


class BatchNotFound(LmdqError):
    def __init__(self, batch_id: str) -> None:
        super().__init__(f"no such batch: {batch_id!r} (see `lmdq-producer list`)")
        self.batch_id = batch_id


class UnknownModel(LmdqError):
    exit_code = 2


class SubmitRejected(LmdqError):
    """The input file was not accepted; nothing was enqueued."""

    exit_code = 2


class RetryRejected(LmdqError):
    """``retry`` found nothing to resubmit, or the batch cannot be retried (yet); nothing was enqueued."""


class RedisUnavailable(LmdqError):
    """Redis could not be reached or refused our credentials."""

    exit_code = 3


class ResultsUnavailable(LmdqError):
    """A batch's results shard (its results URL) could not be read."""

    exit_code = 4


class RedisRefused(LmdqError):
    """Redis is reachable but refused a write (out of memory under ``maxmemory``, a read-only
    replica): nothing was left behind, and retrying later or elsewhere can succeed."""

    exit_code = 5


class BadSetting(LmdqError, ValueError):
    """A worker/engine setting (flag or ``LMDQ_*`` env var) with a bad value, or one the chosen engine does
    not take: named by its flag and env var, exit 2 like any usage error. A ValueError too, so code that
    validates settings keeps catching it as one."""

    exit_code = 2
