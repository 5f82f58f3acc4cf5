"""Redis connections from a URL: checked URLs, timeouts on every client, and ONE retry policy.

``redis://`` and ``rediss://`` (TLS) URLs with user/password are passed to redis-py once they are
known to mean what they say. ``redis+sentinel://`` (``rediss+sentinel://``: TLS) names Redis
Sentinels and a service instead of a server: the client asks the sentinels for the current primary
at every (re)connect, through redis-py's Sentinel client, so a failover needs no human (see
:func:`parse_sentinel_url` and docs/deploy.md). A malformed URL, a wrong password or an unreachable
server becomes one :class:`RedisUnavailable` line naming the redacted URL, not a traceback.

Retries live in one place. The client itself only reconnects once, at once, when a pooled
connection was dropped (a restarted Redis, an idle connection cut by a proxy): that is not a backoff
layer, just redis-py noticing a dead socket. Timeouts are never retried by the client (a command may
have run). Everything else, waiting for a Redis that is away, is :class:`RetryPolicy` through
:func:`with_reconnect`, used by the producer (at start) and the worker (around each operation).
"""

from __future__ import annotations

import random
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar, cast
from urllib.parse import unquote, urlsplit

import redis
from redis import BlockingConnectionPool
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)

from lmdq.errors import RedisUnavailable
from lmdq.logs.redaction import redact_text, redact_url
from lmdq.settings import CommonSettings

__all__ = [
    "RETRYABLE_ERRORS", "Refusal", "RetryPolicy", "SentinelTarget", "check_redis_url", "connect", "parse_sentinel_url",
    "redact_url", "refusal", "server_address", "with_reconnect",
]

T = TypeVar("T")

RETRYABLE_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError)
"""Errors that mean "Redis is (re)starting or unreachable": wait and retry, never give up work."""

_CREDENTIAL_ERRORS = (redis.AuthenticationError, redis.exceptions.AuthorizationError)
"""Subclasses of ConnectionError that retrying cannot fix: the credentials were refused."""


class Refusal(str, Enum):
    """Why a reachable Redis refused a write on purpose: the server is fine, later (or the primary) works."""

    out_of_memory = "out_of_memory"
    read_only = "read_only"
    misconf = "misconf"


# Inside a Lua script (or a pipeline) a refusal arrives as a plain ResponseError ("Error running script
# ...: -OOM command not allowed when used memory > 'maxmemory'"), so the server's own wording is matched
# as well as redis-py's classes.
_REFUSAL_TEXTS = (
    (Refusal.out_of_memory, redis.exceptions.OutOfMemoryError, ("OOM command not allowed",
                                                               "command not allowed when used memory")),
    (Refusal.read_only, redis.exceptions.ReadOnlyError, ("READONLY", "write against a read only replica")),
    (Refusal.misconf, None, ("MISCONF",)),
)


def refusal(err: BaseException) -> Refusal | None:
    """The reason a reachable Redis refused a write (out of memory under ``maxmemory``, a read-only
    replica, a failed RDB save), or None for any other error. The one classifier: the producer turns a
    refusal into one line (exit 5), the worker keeps its results and retries."""
    if not isinstance(err, redis.ResponseError):
        return None
    msg = str(err)
    for kind, cls, texts in _REFUSAL_TEXTS:
        if (cls is not None and isinstance(err, cls)) or any(t in msg for t in texts):
            return kind
    return None

_SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
_SCHEMES = ("redis", "rediss", "unix", *_SENTINEL_SCHEMES)
# Forms shown in messages are examples that parse as URLs and hold no '@': the CLI passes every message
# through redact_text, which reads a scheme:// up to the line's last '@' as one URL (a password may
# hold spaces), so a template like "redis://[[user]:password@]host" after a URL would hide both.
_URL_FORM = ("expected redis://host:6379/0, rediss://host:6380/0 (TLS), unix:///run/redis.sock or "
             "redis+sentinel://host1:26379,host2:26379/mymaster (a password goes before the host: "
             "':PASSWORD' and an at sign)")
_SENTINEL_FORM = ("expected redis+sentinel://host1:26379,host2:26379/mymaster or .../mymaster/0 (sentinels, "
                  "then the service they monitor, then the database)")
_SENTINEL_OPTIONS = frozenset({"sentinel_username", "sentinel_password"})
_SERVICE = re.compile(r"[A-Za-z0-9._\-]{1,128}")
DEFAULT_SENTINEL_PORT = 26379
_HOST = re.compile(r"\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+")

_NO_SUCH_NAME = frozenset(
    getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA", "EAI_ADDRFAMILY") if hasattr(socket, name)
)
"""getaddrinfo answers that mean "no such host" (EAI_AGAIN, a DNS hiccup, is waited for like any outage)."""

_DEFAULTS = CommonSettings.model_fields
_CONNECT_TIMEOUT_S: float = _DEFAULTS["redis_connect_timeout_s"].default
_SOCKET_TIMEOUT_S: float = _DEFAULTS["redis_socket_timeout_s"].default
_WAIT_S: float = _DEFAULTS["redis_wait_s"].default

SLOW_CONNECT_NOTICE_S = 1.0
"""After this long without an answer, :func:`connect` says what it is waiting for."""


@dataclass(frozen=True)
class RetryPolicy:
    """lmdq's one backoff for a Redis that is away: capped, jittered, exponential.

    Retry ``n`` (0-based) sleeps a random time in ``[d/2, d]`` with ``d = min(cap_s, base_s * 2**n)``
    ("equal jitter": a fleet of workers that lost Redis together does not come back in lock step).
    At most ``retries`` retries; with ``deadline_s``, no retry starts that could not finish in time,
    judged by how long the last attempt took (so a frozen Redis, whose every attempt lasts a socket
    timeout, is not tried a second time past the deadline).
    """

    retries: int = 30
    base_s: float = 0.1
    cap_s: float = 5.0
    deadline_s: float | None = None

    @classmethod
    def for_startup(cls, s: CommonSettings | None = None) -> RetryPolicy:
        """A command's first contact: wait up to ``LMDQ_REDIS_WAIT_S`` for Redis, then give up."""
        return cls(retries=10_000, deadline_s=s.redis_wait_s if s is not None else _WAIT_S)

    def delay(self, retry: int, rand: Callable[[], float] = random.random) -> float:
        """Seconds to sleep before retry number ``retry`` (0-based)."""
        full = min(self.cap_s, self.base_s * 2.0 ** min(retry, 62))
        return full / 2 + float(rand()) * full / 2

    @property
    def max_sleep_s(self) -> float:
        """The most time all retries can spend sleeping (the attempts' own time comes on top)."""
        total = sum(min(self.cap_s, self.base_s * 2.0 ** min(n, 62)) for n in range(min(self.retries, 100_000)))
        return total if self.deadline_s is None else min(total, self.deadline_s)


DEFAULT_POLICY = RetryPolicy()


def with_reconnect(
    fn: Callable[[], T],
    *,
    on_retry: Callable[[Exception, float], None] | None = None,
    policy: RetryPolicy | None = None,
    sleep: Callable[[float], object] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """``fn()``, retried while Redis is away (:data:`RETRYABLE_ERRORS`) under ``policy``.

    What a caller gets: ``fn``'s value; or, at once, any error that is not retryable and refused
    credentials; or, once the policy is spent, the last retryable error. The wait is at most
    ``policy.max_sleep_s`` of sleeping (about 2 min for the default 30 retries) plus the attempts'
    own time, each bounded by the client's connect and socket timeouts. ``on_retry(error, delay)``
    is called before each sleep (for logging). Use it around idempotent operations only:
    a timed-out command may have run.
    """
    p = policy or DEFAULT_POLICY
    start = clock()
    retry = 0
    while True:
        began = clock()
        try:
            return fn()
        except RETRYABLE_ERRORS as e:
            if isinstance(e, _CREDENTIAL_ERRORS) or retry >= p.retries:
                raise
            delay = p.delay(retry)
            if p.deadline_s is not None:
                now = clock()
                if now - start + delay + (now - began) > p.deadline_s:
                    raise
            if on_retry:
                on_retry(e, delay)
            sleep(delay)
            retry += 1


class _ReconnectOnce(Retry):
    """redis-py's Retry limited to what the client should do itself: reconnect once, at once, on a
    dropped connection (never on a timeout: the command may have run; never on refused credentials)."""

    def __init__(self) -> None:
        super().__init__(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))

    def call_with_retry(
        self, do: Callable[[], T], fail: Callable[..., Any], is_retryable: Any = None, *args: Any, **kwargs: Any
    ) -> T:
        def retryable(e: Exception) -> bool:
            return not isinstance(e, _CREDENTIAL_ERRORS) and (is_retryable is None or bool(is_retryable(e)))

        return super().call_with_retry(do, fail, retryable, *args, **kwargs)


def check_redis_url(url: str) -> None:
    """Raise :class:`RedisUnavailable` unless ``url`` is a Redis URL that means what it says.

    redis-py accepts URLs that silently mean something else: ``redis://:pa/ss@host`` connects to
    localhost with password ``pa`` (the ``/`` ends the host part), ``redis:/host`` to localhost, a
    path that is not a number to db 0. The message names the redacted URL and the problem, never a
    part of the URL (a "port" that fails to parse may be a password).
    """
    shown = redact_url(url)

    def bad(why: str) -> RedisUnavailable:
        return RedisUnavailable(f"invalid Redis URL {shown!r}: {why}")

    if not isinstance(url, str) or not url.strip():
        raise bad(f"empty; {_URL_FORM}")
    if any(c <= " " or c == "\x7f" for c in url):
        raise bad("it holds spaces or control characters (percent-encode them in a password)")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise bad(_URL_FORM)
    if scheme.lower() not in _SCHEMES:
        raise bad(f"the scheme is not redis, rediss, unix or redis+sentinel; {_URL_FORM}")
    if scheme.lower() in _SENTINEL_SCHEMES:
        parse_sentinel_url(url)
        return
    at = rest.rfind("@")
    host_and_tail = rest[at + 1:] if at >= 0 else rest
    end = min((i for i in (host_and_tail.find(c) for c in "/?#") if i >= 0), default=len(host_and_tail))
    authority = (rest[: at + 1] if at >= 0 else "") + host_and_tail[:end]
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unbalanced '[' in the host
        raise bad(f"no valid host; {_URL_FORM}") from None
    if parts.netloc != authority:
        raise bad("the user name or password holds '/', '?' or '#': percent-encode them ('/' is %2F, '?' %3F, "
                  "'#' %23)")
    try:
        port = parts.port
    except ValueError:
        raise bad("the port is not a number from 1 to 65535 (a password goes before the host: ':PASSWORD' "
                  "and an at sign)") from None
    if parts.fragment:
        raise bad("it has a '#fragment' (a '#' in a password must be written %23)")
    if scheme.lower() == "unix":
        if not parts.path:
            raise bad("no socket path; expected unix:///path/to/socket")
        return
    host = parts.netloc.rpartition("@")[2]
    host = host[: host.rfind(":")] if port is not None and not host.endswith("]") else host
    if not host or not _HOST.fullmatch(host):
        raise bad(f"no valid host; {_URL_FORM}")
    if port == 0:
        raise bad("the port is not a number from 1 to 65535")
    if parts.path not in ("", "/") and not re.fullmatch(r"/[0-9]{1,5}", parts.path):
        raise bad("the path is not a database number (e.g. /0)")


@dataclass(frozen=True)
class SentinelTarget:
    """What a ``redis+sentinel://`` URL says: where the sentinels are and which service they watch."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False


def parse_sentinel_url(url: str) -> SentinelTarget:
    """``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]``, checked.

    The user and password (percent-encoded) are the Redis servers' (primary and replicas); sentinels
    that require a password of their own get it from the ``sentinel_password`` (and
    ``sentinel_username``) query option. A sentinel's port defaults to 26379. ``rediss+sentinel``
    connects to the servers and the sentinels with TLS. Raises :class:`RedisUnavailable` naming the
    redacted URL and the problem, never a part of the URL.
    """
    shown = redact_url(url)

    def bad(why: str) -> RedisUnavailable:
        return RedisUnavailable(f"invalid Redis Sentinel URL {shown!r}: {why}")

    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in _SENTINEL_SCHEMES:
        raise bad(_SENTINEL_FORM)
    if any(c <= " " or c == "\x7f" for c in url):
        raise bad("it holds spaces or control characters (percent-encode them in a password)")
    at = rest.rfind("@")
    userinfo, after = (rest[:at], rest[at + 1:]) if at >= 0 else ("", rest)
    if any(c in userinfo for c in "/?#"):
        raise bad("the user name or password holds '/', '?' or '#': percent-encode them ('/' is %2F, '?' %3F, "
                  "'#' %23)")
    end = min((i for i in (after.find(c) for c in "/?#") if i >= 0), default=len(after))
    hosts, tail = after[:end], after[end:]
    if "#" in tail:
        raise bad("it has a '#fragment' (a '#' in a password must be written %23)")
    path, _, query = tail.partition("?")
    sentinels: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, port = item, DEFAULT_SENTINEL_PORT
        head, colon, port_text = item.rpartition(":")
        if colon and not item.endswith("]"):
            if not re.fullmatch(r"[0-9]{1,5}", port_text) or not 0 < int(port_text) < 65536:
                raise bad("a sentinel's port is not a number from 1 to 65535 (a password goes before the first "
                          "host: ':PASSWORD' and an at sign)")
            host, port = head, int(port_text)
        if not host or not _HOST.fullmatch(host):
            raise bad(f"a sentinel has no valid host; {_SENTINEL_FORM}")
        sentinels.append((host.strip("[]"), port))
    parts = path.split("/")[1:] if path else []
    if not parts or not parts[0]:
        raise bad(f"no service name (the name the sentinels monitor, e.g. /mymaster); {_SENTINEL_FORM}")
    if not _SERVICE.fullmatch(parts[0]):
        raise bad("the service name may hold only letters, digits, '.', '_' and '-' (at most 128)")
    if len(parts) > 2 or (len(parts) == 2 and not re.fullmatch(r"[0-9]{1,5}", parts[1])):
        raise bad("after the service name only a database number may follow (e.g. /mymaster/0)")
    options: dict[str, str] = {}
    for item in query.split("&") if query else []:
        key, eq, value = item.partition("=")
        if key not in _SENTINEL_OPTIONS or not eq:
            raise bad("the only query options are sentinel_username=... and sentinel_password=...")
        options[key] = unquote(value)
    user, colon, password = userinfo.partition(":")
    if userinfo and not colon:  # redis+sentinel://S3cret@host: the "user name" is the password
        raise bad("the URL has a user name but no password (a password alone is written ':PASSWORD' before the "
                  "at sign)")
    return SentinelTarget(
        sentinels=tuple(sentinels), service=parts[0], db=int(parts[1]) if len(parts) == 2 else 0,
        username=unquote(user) or None, password=unquote(password) if colon else None,
        sentinel_username=options.get("sentinel_username") or None,
        sentinel_password=options.get("sentinel_password") or None,
        ssl=scheme.lower().startswith("rediss"),
    )


class _DemotionAware:
    """redis-py drops a Sentinel connection whose server answers a plain command with READONLY (the
    primary was demoted), so the next connect asks the sentinels again; but a write inside a Lua script
    or a pipeline arrives as a ResponseError that merely quotes READONLY, and the connection would keep
    talking to the replica. Here that is a ConnectionError too: the pool reconnects to the new primary
    and the callers' ordinary retry re-runs the call (nothing was written: a replica takes no write)."""

    connection_pool: Any

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        except redis.ResponseError as e:
            if self.connection_pool.is_master and refusal(e) is Refusal.read_only:
                self.disconnect()  # type: ignore[attr-defined]
                raise redis.ConnectionError("the Redis primary was demoted to a replica (READONLY): "
                                            "reconnecting to the new primary") from e
            raise


class _SentinelConnection(_DemotionAware, SentinelManagedConnection):
    pass


class _SentinelSSLConnection(_DemotionAware, SentinelManagedSSLConnection):
    pass


class _Sentinel(Sentinel):
    """redis-py's Sentinel client, saying in one short line why no primary was found: its own message
    is the repr of every sentinel's client (a screen of connection settings per sentinel), which the
    worker would log at every retry."""

    def discover_master(self, service_name: str) -> tuple[str, int]:
        problems: list[str] = []
        for i, sentinel in enumerate(self.sentinels):
            kw = sentinel.connection_pool.connection_kwargs
            where = f"{kw.get('host')}:{kw.get('port')}"
            try:
                masters: Any = sentinel.sentinel_masters()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                problems.append(f"{where}: {type(e).__name__}: {e}")
                continue
            state = masters.get(service_name)
            if not state:
                problems.append(f"{where}: monitors no service {service_name!r}")
            elif not self.check_master_state(state, service_name):  # type: ignore[no-untyped-call]
                problems.append(f"{where}: the primary it knows is down or not a primary")
            else:
                self.sentinels[0], self.sentinels[i] = sentinel, self.sentinels[0]  # ask it first next time
                return str(state["ip"]), int(state["port"])
        raise MasterNotFoundError(f"no sentinel names a primary for {service_name!r} ({'; '.join(problems)})")


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """A Sentinel pool that makes a thread wait for a free connection (as :func:`connect`'s
    ``max_connections`` promises) instead of failing with "Too many connections"."""


def server_address(client: redis.Redis) -> str:
    """host:port (or socket path) of the client's server, for messages: never the URL, so never a
    password. A Sentinel client names its service and the primary it last connected to."""
    pool = client.connection_pool
    if isinstance(pool, SentinelConnectionPool):
        addr = pool.master_address
        at = f" (primary {addr[0]}:{addr[1]})" if addr else ""
        return f"Sentinel service {pool.service_name!r}{at}"
    kw = pool.connection_kwargs
    if kw.get("path"):
        return str(kw["path"])
    return f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}"


def connect(
    url: str,
    *,
    settings: CommonSettings | None = None,
    check: bool = True,
    policy: RetryPolicy | None = None,
    on_slow: Callable[[str], None] | None = None,
    max_connections: int | None = None,
) -> redis.Redis:
    """A client for ``url`` with connect and socket timeouts on every connection.

    Timeouts come from ``settings`` (``LMDQ_REDIS_CONNECT_TIMEOUT_S``, ``LMDQ_REDIS_SOCKET_TIMEOUT_S``;
    their declared defaults without it). With ``check`` the server is pinged under ``policy``
    (default: :meth:`RetryPolicy.for_startup`, i.e. up to ``LMDQ_REDIS_WAIT_S`` for a Redis that is
    restarting or unreachable; its first answer is due within the connect timeout), so a missing or
    frozen Redis and bad credentials fail here, early and clearly, as one-line
    :class:`RedisUnavailable` errors. If the first answer takes longer than
    :data:`SLOW_CONNECT_NOTICE_S`, ``on_slow`` gets one line saying what we are waiting for.

    With ``max_connections`` the client's pool holds at most that many connections and a thread that
    finds them all busy waits for one (up to the socket timeout) instead of failing with "Too many
    connections" (redis-py's default pool fails past 100): a worker with hundreds of job threads.
    """
    check_redis_url(url)
    shown = redact_url(url)
    connect_timeout_s = settings.redis_connect_timeout_s if settings is not None else _CONNECT_TIMEOUT_S
    socket_timeout_s = settings.redis_socket_timeout_s if settings is not None else _SOCKET_TIMEOUT_S
    client = _client(url, shown, connect_timeout_s, socket_timeout_s, max_connections)
    if not check:
        return client
    # The check is part of connecting: its first answer (after TCP, TLS and AUTH) gets the connect
    # timeout, so a frozen Redis is given up on after ~5 s, not a full socket timeout.
    probe = _client(url, shown, connect_timeout_s, connect_timeout_s)
    notice = _SlowNotice(f"waiting for Redis at {shown} ...", on_slow) if on_slow is not None else None
    try:
        with_reconnect(lambda: _ping(probe), policy=policy or RetryPolicy.for_startup(settings))
    except _UnknownHost as e:
        raise RedisUnavailable(f"cannot reach Redis at {shown}: the host name does not resolve "
                               f"({_said(e.__cause__ or e)})") from e
    except redis.AuthenticationError as e:
        raise RedisUnavailable(f"Redis at {shown} refused the credentials: {_said(e)}{_auth_hint(url)}") from e
    except redis.ResponseError as e:
        if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
            raise RedisUnavailable(f"Redis at {shown} needs a (correct) password: {_said(e)}{_auth_hint(url)}") from e
        raise RedisUnavailable(f"Redis at {shown} refused PING: {_said(e)}") from e
    except (redis.RedisError, OSError, UnicodeError, ValueError, TypeError) as e:
        # OSError/UnicodeError/ValueError: e.g. a host name the resolver cannot even encode;
        # TypeError: a URL query option this kind of connection does not take.
        raise RedisUnavailable(f"cannot reach Redis at {shown}: {_said(e)}") from e
    finally:
        if notice is not None:
            notice.stop()
        probe.close()
        if isinstance(probe.connection_pool, SentinelConnectionPool):
            probe.connection_pool.sentinel_manager.close()
    return client


class _UnknownHost(Exception):
    """The resolver says the name does not exist (not "try again"): a typo, not worth waiting for."""


def _ping(client: redis.Redis) -> None:
    try:
        client.ping()
    except redis.ConnectionError as e:
        cause = e.__cause__ or e.__context__
        if isinstance(cause, socket.gaierror) and cause.errno in _NO_SUCH_NAME:
            raise _UnknownHost(str(e)) from e
        raise


class _SlowNotice:
    """Calls ``say(message)`` once if not stopped within :data:`SLOW_CONNECT_NOTICE_S`.

    The lock makes it all-or-nothing: once :meth:`stop` returns, the notice has either been said
    in full or never will be, so it cannot land after (or inside) the error line that may follow.
    """

    def __init__(self, message: str, say: Callable[[str], None]) -> None:
        self._message, self._say = message, say
        self._lock = threading.Lock()
        self._stopped = False
        self._timer = threading.Timer(SLOW_CONNECT_NOTICE_S, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if not self._stopped:
                self._say(self._message)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        self._timer.cancel()


def _client(url: str, shown: str, connect_timeout_s: float, socket_timeout_s: float,
            max_connections: int | None = None) -> redis.Redis:
    kw: dict[str, Any] = {
        "socket_connect_timeout": connect_timeout_s,
        "socket_timeout": socket_timeout_s,
        "retry": _ReconnectOnce(),
        "health_check_interval": 30,
        **({} if url[:5].lower() == "unix:" else {"socket_keepalive": True}),  # TCP only
    }
    if url.partition("://")[0].lower() in _SENTINEL_SCHEMES:
        return _sentinel_client(parse_sentinel_url(url), kw, max_connections, socket_timeout_s)
    try:
        if max_connections is None:
            return redis.Redis.from_url(url, **kw)
        pool = redis.BlockingConnectionPool.from_url(url, max_connections=max(1, max_connections),
                                                     timeout=socket_timeout_s, **kw)
        client = redis.Redis(connection_pool=pool)
        client.auto_close_connection_pool = True
        return client
    except (ValueError, TypeError) as e:  # a bad query option: redis-py names the option, not its value
        raise RedisUnavailable(f"invalid Redis URL {shown!r}: {_said(e)}") from None


def _sentinel_client(t: SentinelTarget, kw: dict[str, Any], max_connections: int | None,
                     socket_timeout_s: float) -> redis.Redis:
    """A client of the service's current primary: every new connection asks the sentinels where it is,
    and a connection to a primary demoted to replica (READONLY) is dropped as a ConnectionError, so the
    callers' ordinary reconnect (:func:`with_reconnect`) lands on the new primary."""
    tls = {"ssl": True} if t.ssl else {}
    sentinel_kw: dict[str, Any] = {
        "socket_connect_timeout": kw["socket_connect_timeout"], "socket_timeout": kw["socket_timeout"],
        "socket_keepalive": True, "retry": _ReconnectOnce(), **tls,
        **({"username": t.sentinel_username} if t.sentinel_username else {}),
        **({"password": t.sentinel_password} if t.sentinel_password else {}),
    }
    # through Any: redis-py typed Sentinel in 8.2 and not before, and the lock may move either way
    sentinel: Any = cast(Any, _Sentinel)(list(t.sentinels), sentinel_kwargs=sentinel_kw)
    conn_kw: dict[str, Any] = {**kw, "db": t.db, "username": t.username, "password": t.password,
                               "connection_class": _SentinelSSLConnection if t.ssl else _SentinelConnection}
    if max_connections is not None:
        conn_kw.update(connection_pool_class=_BlockingSentinelPool, max_connections=max(1, max_connections),
                       timeout=socket_timeout_s)
    client: redis.Redis = sentinel.master_for(t.service, **conn_kw)
    return client


def _auth_hint(url: str) -> str:
    """The commonest slip: ``redis://PASSWORD@host`` makes the password a user name."""
    userinfo, at, _ = url.partition("://")[2].rpartition("@")
    if at and ":" not in userinfo:
        return " (the URL has a user name but no password: write redis://:PASSWORD@host)"
    return ""


def _said(e: BaseException) -> str:
    """An exception's text for a one-line message: redacted (it may quote a URL), on one line."""
    return " ".join(redact_text(f"{type(e).__name__}: {e}").split())
