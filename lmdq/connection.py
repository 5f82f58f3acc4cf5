"""Redis connections from a URL, with clear errors and reconnect-with-backoff.

``redis://`` and ``rediss://`` (TLS) URLs with user/password are passed straight to redis-py.
A wrong password or an unreachable server becomes one :class:`RedisUnavailable` line with the
password redacted, not a traceback.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from lmdq.errors import RedisUnavailable

__all__ = ["RETRYABLE_ERRORS", "connect", "redact_url", "with_reconnect"]

T = TypeVar("T")

RETRYABLE_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError)
"""Errors that mean "Redis is (re)starting or unreachable": wait and retry, never give up work."""
_RETRYABLE = RETRYABLE_ERRORS

_CREDENTIAL_ERRORS = (redis.AuthenticationError, redis.exceptions.AuthorizationError)
"""Subclasses of ConnectionError that retrying cannot fix: the credentials were refused."""


class _Retry(Retry):
    """redis-py's Retry, except refused credentials fail at once instead of after ~16 s of backoff."""

    def call_with_retry(
        self, do: Callable[[], T], fail: Callable[..., Any], is_retryable: Any = None, *args: Any, **kwargs: Any
    ) -> T:
        def retryable(e: Exception) -> bool:
            return not isinstance(e, _CREDENTIAL_ERRORS) and (is_retryable is None or bool(is_retryable(e)))

        return super().call_with_retry(do, fail, retryable, *args, **kwargs)


# Older redis-py has no is_retryable hook; there, credential errors are retried like any other.
_RETRY_CLASS: type[Retry] = (
    _Retry if "is_retryable" in inspect.signature(Retry.call_with_retry).parameters else Retry
)


def redact_url(url: str) -> str:
    """The URL with any password replaced by '***' (safe to log)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    netloc = f"{user}:***@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def connect(url: str, *, check: bool = True, retries: int = 6) -> redis.Redis:
    """A client for ``url`` that retries transient errors with exponential backoff.

    With ``check`` the server is pinged once so bad credentials fail here, early and clearly.
    """
    try:
        client = redis.Redis.from_url(
            url,
            retry=_RETRY_CLASS(ExponentialBackoff(cap=5.0, base=0.2), retries),
            retry_on_error=list(_RETRYABLE),
            health_check_interval=30,
            socket_keepalive=True,
        )
    except ValueError as e:
        raise RedisUnavailable(f"invalid Redis URL {redact_url(url)!r}: {e}") from e
    if check:
        try:
            client.ping()
        except redis.AuthenticationError as e:
            raise RedisUnavailable(f"Redis at {redact_url(url)} refused the credentials: {e}") from e
        except redis.ResponseError as e:
            if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
                raise RedisUnavailable(f"Redis at {redact_url(url)} needs a (correct) password: {e}") from e
            raise
        except redis.RedisError as e:
            raise RedisUnavailable(f"cannot reach Redis at {redact_url(url)}: {e}") from e
    return client


def with_reconnect(
    fn: Callable[[], T],
    *,
    attempts: int = 30,
    cap_s: float = 5.0,
    on_retry: Callable[[Exception, float], None] | None = None,
) -> T:
    """Call ``fn``, retrying connection errors with capped exponential backoff.

    Used around whole operations (a claim, a result write) so a Redis restart pauses work
    instead of crashing it.
    """
    delay = 0.1
    for i in range(attempts):
        try:
            return fn()
        except _RETRYABLE as e:
            if i == attempts - 1 or isinstance(e, _CREDENTIAL_ERRORS):
                raise
            if on_retry:
                on_retry(e, delay)
            time.sleep(delay)
            delay = min(cap_s, delay * 2)
    raise AssertionError("unreachable")
