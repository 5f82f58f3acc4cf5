"""Redis connections from a URL, with clear errors and reconnect-with-backoff.

``redis://`` and ``rediss://`` (TLS) URLs with user/password are passed straight to redis-py.
A wrong password or an unreachable server becomes one :class:`RedisUnavailable` line with the
password redacted, not a traceback.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from lmdq.errors import RedisUnavailable

__all__ = ["connect", "redact_url", "with_reconnect"]

T = TypeVar("T")

_RETRYABLE = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError)


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
            retry=Retry(ExponentialBackoff(cap=5.0, base=0.2), retries),
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
            if i == attempts - 1:
                raise
            if on_retry:
                on_retry(e, delay)
            time.sleep(delay)
            delay = min(cap_s, delay * 2)
    raise AssertionError("unreachable")
