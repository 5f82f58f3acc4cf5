"""How every lmdq CLI ends: :func:`run_cli` turns an error into one ``error:`` line on stderr and the
exit code :class:`lmdq.errors.ExitCode` documents, never a traceback or click's usage block."""

from __future__ import annotations

import sys
from collections.abc import Callable

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

from lmdq.errors import ExitCode, LmdqError
from lmdq.logs.redaction import redact_text

__all__ = ["run_cli", "usage_line"]


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
    except Exception as e:
        _redis_failure(e)
        raise
    else:
        # non-standalone click returns a typer.Exit's code (and a command's return value: None)
        if isinstance(code, int) and not isinstance(code, bool) and code:
            sys.exit(code)


def _redis_failure(e: Exception) -> None:
    """Exit with one line if ``e`` is Redis going away or refusing a write; return otherwise.

    redis is not imported here: a command that never talked to Redis (``--help``) has no redis-py in
    ``sys.modules`` (issue 49: start-up imports only what the command needs), and then ``e`` cannot
    be one of its errors."""
    redis = sys.modules.get("redis")
    if redis is None:
        return
    if isinstance(e, (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError)):
        _fail(f"Redis refused the write: {_one_line(e)}", ExitCode.redis_refused)
    if isinstance(e, (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError)):
        _fail(f"lost the connection to Redis: {_one_line(e)}", ExitCode.redis_unavailable)


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
