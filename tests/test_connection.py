"""lmdq.redis.connection and lmdq.logs.redaction: redaction that cannot fail, checked URLs, timeouts, one retry policy.

The CLI-level behaviour (exit codes, frozen Redis, the URL corpus through a subprocess) is in
tests/test_cli_boundary.py; these are the units, against a real redis-server where a server matters.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Iterator

import pytest
import redis

from lmdq.cli.run import run_cli
from lmdq.errors import ExitCode, RedisRefused, RedisUnavailable
from lmdq.logs.redaction import redact_text, redact_url
from lmdq.redis.connection import RETRYABLE_ERRORS, RetryPolicy, check_redis_url, connect, with_reconnect
from lmdq.settings import CommonSettings

# ---------------------------------------------------------------------------------------------
# Redaction


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:S3cret/PW@127.0.0.1:6438/0", "redis://***@127.0.0.1:6438/0"),
        ("redis://:S3c#ret@127.0.0.1:6438/0", "redis://***@127.0.0.1:6438/0"),
        ("redis://:S3c?ret@127.0.0.1:6438/0", "redis://***@127.0.0.1:6438/0"),
        ("redis://S3cretPW@127.0.0.1:6438/0", "redis://***@127.0.0.1:6438/0"),  # no ':': the name is the secret
        ("redis://user:pw@host:6379/2", "redis://***@host:6379/2"),
        ("redis:/:S3cret@127.0.0.1:6438/0", "<unparseable redis URL>"),
        ("redis://user:S3cret@127.0.0.1:abc/0", "<unparseable redis URL>"),
        ("redis://:S3cret", "<unparseable redis URL>"),  # '@host' forgotten: ':S3cret' is not a port
        ("redis://:12345", "<unparseable redis URL>"),  # nor is a numeric password without a host
        ("redis://localhost:6379/0", "redis://localhost:6379/0"),
        ("redis://[::1]:6379/0", "redis://[::1]:6379/0"),
        ("unix:///run/redis.sock?db=1&password=x", "unix:///run/redis.sock?db=1&password=***"),
        ("redis://h/0?S3cret", "redis://h/0?***"),
        ("redis://h/0#S3cret", "redis://h/0#***"),
        ("redis://h//user:S3cret", "redis://h/***"),
        ("rediss://lmdq:s3cret@redis.example:6380/2?ssl_cert_reqs=required&ssl_ca_certs=/etc/ssl/ca.pem",
         "rediss://***@redis.example:6380/2?ssl_cert_reqs=required&ssl_ca_certs=/etc/ssl/ca.pem"),
        ("s3://bucket/prefix/results-000000.jsonl", "s3://bucket/prefix/results-000000.jsonl"),
        ("localhost:6379", "<unparseable URL>"),
        ("QzJx://u:pw@host:1/0", "***://***@host:1/0"),  # an unknown "scheme" may be a password too
        ("", "<unparseable URL>"),
    ],
)
def test_redact_url_cases(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert redact_url(shown) == shown  # idempotent: logs may redact an already redacted URL


def test_redact_url_of_non_strings_never_raises() -> None:
    for value in (None, 42, b"redis://:pw@h", object()):
        assert redact_url(value) == "<unparseable URL>"


# Capitals that neither 'REDIS' nor '<unparseable ... URL>' hold, and URL punctuation.
_SECRET_ALPHABET = "ABCFGHJKMNOPQTVWXYZ" + "/?#@:%!&=+ \t\n\\[]"
_HOST_ALPHABET = string.ascii_lowercase + string.digits + ".-"


def _random_url(rng: random.Random, secret: str) -> str:
    """A URL-ish string carrying ``secret`` the ways careless users put passwords in URLs."""
    scheme = rng.choice(["redis", "rediss", "unix", "REDIS", "http", "s3", "", "redis:", "re dis"])
    sep = rng.choice(["://", ":/", ":", "//", ":///", "://"])
    host = "".join(rng.choice(_HOST_ALPHABET) for _ in range(rng.randint(0, 12)))
    port = rng.choice(["", ":6379", ":", ":99999", ":abc", ":" + "".join(rng.choices(string.digits, k=3))])
    user = rng.choice(["", "user", "lmdq:"])
    userinfo = rng.choice([f":{secret}@", f"{user}:{secret}@", f"{secret}@", f"{user}{secret}@@", f"@{secret}@"])
    tail = rng.choice(["", "/0", "/12", "/x", "?db=1", "#", "?ssl_cert_reqs=none", "/0?a=b&c"])
    return f"{scheme}{sep}{userinfo}{host}{port}{tail}"


def test_redact_url_never_raises_and_never_shows_the_secret_for_random_urls() -> None:
    """Property-style, fixed seed: 20,000 mangled URLs with a secret in the userinfo, plus random junk.

    The secret is drawn from an alphabet neither a host nor lmdq's own wording uses (capitals and URL
    punctuation), so any 3-character piece of it in the output is a leak, not a coincidence."""
    rng = random.Random(20261201)
    for _ in range(20_000):
        secret = "".join(rng.choice(_SECRET_ALPHABET) for _ in range(rng.randint(3, 16)))
        url = _random_url(rng, secret)
        out = redact_url(url)
        pieces = {secret[i:i + 3] for i in range(len(secret) - 2)}
        leaked = [p for p in pieces if p in out and p.strip() == p and not set(p) <= set("/?#:&=")]
        assert not leaked, (url, out, leaked)
    junk_alphabet = string.printable + "\x00\x7f\u2603\udc80"
    for _ in range(20_000):
        junk = "".join(rng.choice(junk_alphabet) for _ in range(rng.randint(0, 40)))
        if rng.random() < 0.5:
            junk = rng.choice(["redis://", "rediss://", "unix://"]) + junk
        assert isinstance(redact_url(junk), str)
        assert isinstance(redact_text(junk), str)


def test_redact_text_hides_every_url_in_free_text() -> None:
    text = "retry failed for redis://:Qz7/Kx9@127.0.0.1:1/0, then rediss://u:Wv8Jy@x:2/1. done"
    out = redact_text(text)
    assert "Qz7" not in out and "Kx9" not in out and "Wv8" not in out and "8Jy" not in out
    assert out.startswith("retry failed for redis://***@") and out.endswith(" done")
    assert redact_text("nothing to hide: 127.0.0.1:6379") == "nothing to hide: 127.0.0.1:6379"
    # a multi-line message (submit's list of bad lines): a URL never reaches into the next line
    lines = "f.jsonl:2: field 'url': got 'http://x/y'\nf.jsonl:3: field 'prompt': got 'mail a@b.c'"
    assert redact_text(lines) == lines


# ---------------------------------------------------------------------------------------------
# URL checks: malformed URLs are one clear RedisUnavailable (exit 3), never a part of the password


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis://:Qz7/Kx9@127.0.0.1:6438/0", "percent-encode"),
        ("redis://:Qz7#Kx9@127.0.0.1:6438/0", "percent-encode"),
        ("redis://:Qz7?Kx9@127.0.0.1:6438/0", "percent-encode"),
        ("redis:/:QzKx@127.0.0.1:6438/0", "expected redis://"),
        ("redis://user:QzKx@127.0.0.1:abc/0", "the port is not a number"),
        ("redis://QzJxWv:6379x/0", "the port is not a number"),
        ("redis://h:0/0", "from 1 to 65535"),
        ("http://u:QzKx@h", "the scheme is not redis, rediss, unix or redis+sentinel"),
        ("redis://:QzKx@/0", "no valid host"),
        ("redis://:QzKx@h:6379/zz", "not a database number"),
        ("redis://:QzKx@h:6379/0#QzKx", "fragment"),
        ("redis://:Qz Kx@h:6379/0", "spaces or control characters"),
        ("", "empty"),
    ],
)
def test_malformed_urls_are_one_clear_error(url: str, why: str) -> None:
    with pytest.raises(RedisUnavailable) as exc:
        check_redis_url(url)
    msg = str(exc.value)
    assert msg.startswith("invalid Redis URL ") and why in msg and "\n" not in msg
    assert "Qz" not in msg and "Kx" not in msg
    assert exc.value.exit_code == ExitCode.redis_unavailable == 3


@pytest.mark.parametrize(
    "url",
    ["redis://localhost:6379/0", "redis://h", "rediss://u:p%2Fw@h:6380/2?ssl_cert_reqs=none", "redis://[::1]:1/",
     "unix:///run/redis.sock?db=2", "REDIS://h:1/0", "redis://:p@ss@h:1/0"],
)
def test_well_formed_urls_pass_the_check(url: str) -> None:
    check_redis_url(url)


# ---------------------------------------------------------------------------------------------
# Timeouts and the client's own (single, immediate) reconnect


def test_every_client_has_timeouts_from_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    c = connect("redis://127.0.0.1:1/0", check=False)
    kw = c.connection_pool.connection_kwargs
    assert (kw["socket_connect_timeout"], kw["socket_timeout"]) == (5.0, 10.0)  # the declared defaults
    monkeypatch.setenv("LMDQ_REDIS_CONNECT_TIMEOUT_S", "1.5")
    monkeypatch.setenv("LMDQ_REDIS_SOCKET_TIMEOUT_S", "2.5")
    kw = connect("redis://127.0.0.1:1/0", settings=CommonSettings(), check=False).connection_pool.connection_kwargs
    assert (kw["socket_connect_timeout"], kw["socket_timeout"]) == (1.5, 2.5)
    retry = kw["retry"]
    assert retry.get_retries() == 1  # one immediate reconnect for a dropped connection, no backoff layer


def test_a_dropped_connection_is_reconnected_once_transparently(redis_url: str) -> None:
    c = connect(redis_url)
    assert c.ping()
    other = redis.Redis.from_url(redis_url)
    my_id = c.client_id()
    assert other.client_kill_filter(_id=my_id) == 1  # the server drops our pooled connection
    assert c.set("lmdq-test-reconnect", b"1") and c.client_id() != my_id


def test_a_command_timeout_is_not_retried_by_the_client(redis_url: str) -> None:
    """A timed-out command may have run: the client must not resend it (with_reconnect decides)."""
    s = CommonSettings(redis_url=redis_url, redis_socket_timeout_s=0.3)
    c = connect(redis_url, settings=s)
    calls = []
    original = c.connection_pool.get_connection

    def counting(*a: object, **kw: object) -> object:
        calls.append(1)
        return original(*a, **kw)

    c.connection_pool.get_connection = counting  # type: ignore[method-assign]
    with pytest.raises(redis.TimeoutError):
        c.execute_command("DEBUG", "SLEEP", "1")
    assert len(calls) == 1


def test_connect_refused_credentials_fail_at_once_without_retries(redis_url: str) -> None:
    srv_url = redis_url.replace("redis://", "redis://nobody:QzKxWv@")
    with pytest.raises(RedisUnavailable) as exc:
        connect(srv_url, policy=RetryPolicy(retries=50, base_s=5.0))  # would take minutes if retried
    assert "QzKx" not in str(exc.value) and "***@" in str(exc.value)


def test_connect_gives_up_on_a_closed_port_under_the_startup_policy() -> None:
    from tests.conftest import free_port

    retries: list[float] = []
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(RedisUnavailable, match="cannot reach Redis at redis://127.0.0.1:.*ConnectionError"):
        connect(url, policy=RetryPolicy(retries=3, base_s=0.01))
    with pytest.raises(redis.ConnectionError):
        with_reconnect(connect(url, check=False).ping, policy=RetryPolicy(retries=3, base_s=0.01),
                       on_retry=lambda e, d: retries.append(d))
    assert len(retries) == 3


# ---------------------------------------------------------------------------------------------
# RetryPolicy / with_reconnect: injected clock and sleep, so nothing races the wall clock


class _FakeTime:
    def __init__(self, attempt_s: float = 0.0) -> None:
        self.now = 0.0
        self.attempt_s = attempt_s
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s

    def failing(self, error: Exception, succeed_after: int | None = None) -> Callable[[], str]:
        calls = [0]

        def fn() -> str:
            calls[0] += 1
            self.now += self.attempt_s
            if succeed_after is not None and calls[0] > succeed_after:
                return "ok"
            raise error

        return fn


def test_policy_delays_are_capped_jittered_exponential() -> None:
    p = RetryPolicy(retries=30, base_s=0.1, cap_s=5.0)
    rng = random.Random(7)
    for n in range(30):
        full = min(5.0, 0.1 * 2**n)
        for _ in range(50):
            d = p.delay(n, rng.random)
            assert full / 2 <= d <= full
    assert p.delay(10_000, lambda: 1.0) == 5.0  # no overflow far out
    assert 120 < p.max_sleep_s < 130  # "about 2 minutes" as documented (0.1 .. 5 s, 30 retries)


def test_with_reconnect_retries_then_succeeds_and_reports_each_retry() -> None:
    t = _FakeTime()
    seen: list[tuple[str, float]] = []
    out = with_reconnect(t.failing(redis.ConnectionError("down"), succeed_after=3), sleep=t.sleep, clock=t.clock,
                         on_retry=lambda e, d: seen.append((str(e), d)))
    assert out == "ok" and len(t.sleeps) == 3 and [s for _, d in seen for s in [d]] == t.sleeps
    assert all(msg == "down" for msg, _ in seen)


def test_with_reconnect_gives_up_after_the_policy_with_the_last_error() -> None:
    t = _FakeTime()
    with pytest.raises(redis.TimeoutError):
        with_reconnect(t.failing(redis.TimeoutError("frozen")), policy=RetryPolicy(retries=4), sleep=t.sleep,
                       clock=t.clock)
    assert len(t.sleeps) == 4
    # the policy's cap bounds every sleep
    t = _FakeTime()
    with pytest.raises(redis.ConnectionError):
        with_reconnect(t.failing(redis.ConnectionError("x")), policy=RetryPolicy(retries=2, cap_s=0.15), sleep=t.sleep,
                       clock=t.clock)
    assert len(t.sleeps) == 2 and max(t.sleeps) <= 0.15


@pytest.mark.parametrize("error", [redis.AuthenticationError("WRONGPASS"), redis.ResponseError("ERR wrong type"),
                                   ValueError("not a redis problem")])
def test_with_reconnect_raises_at_once_what_waiting_cannot_fix(error: Exception) -> None:
    t = _FakeTime()
    with pytest.raises(type(error)):
        with_reconnect(t.failing(error), sleep=t.sleep, clock=t.clock)
    assert t.sleeps == []


def test_deadline_never_starts_an_attempt_that_cannot_finish_in_time() -> None:
    """A frozen Redis: each attempt lasts a socket timeout (10 s). With a 10 s deadline there is
    exactly one attempt; with a refused port (attempts take no time) it retries until the deadline."""
    frozen = _FakeTime(attempt_s=10.0)
    with pytest.raises(redis.TimeoutError):
        with_reconnect(frozen.failing(redis.TimeoutError("t")), policy=RetryPolicy.for_startup(), sleep=frozen.sleep,
                       clock=frozen.clock)
    assert frozen.sleeps == [] and frozen.now == 10.0
    refused = _FakeTime(attempt_s=0.0)
    with pytest.raises(redis.ConnectionError):
        with_reconnect(refused.failing(redis.ConnectionError("c")), policy=RetryPolicy.for_startup(),
                       sleep=refused.sleep, clock=refused.clock)
    assert len(refused.sleeps) >= 3 and refused.now <= 10.0
    assert RetryPolicy.for_startup(CommonSettings(redis_wait_s=0)).deadline_s == 0


def test_retryable_errors_stay_importable_for_the_worker() -> None:
    assert redis.ConnectionError in RETRYABLE_ERRORS and redis.TimeoutError in RETRYABLE_ERRORS


# ---------------------------------------------------------------------------------------------
# run_cli: Redis errors after the connection was made are exit codes, not tracebacks


@pytest.mark.parametrize(
    ("error", "code", "text"),
    [
        (redis.TimeoutError("Timeout reading from socket"), 3, "lost the connection to Redis"),
        (redis.ConnectionError("Error 111 connecting to\nredis://:QzKx@h:1/0"), 3, "lost the connection to Redis"),
        (redis.exceptions.OutOfMemoryError("OOM command not allowed"), 5, "Redis refused the write"),
        (redis.exceptions.ReadOnlyError("READONLY You can't write"), 5, "Redis refused the write"),
        (RedisRefused("Redis refused the batch: OOM"), 5, "Redis refused the batch"),
    ],
)
def test_run_cli_maps_redis_errors_to_one_line_and_an_exit_code(error: Exception, code: int, text: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    def app(**_: object) -> None:  # a click app: run_cli calls it with standalone_mode=False
        raise error

    with pytest.raises(SystemExit) as exc:
        run_cli(app)
    assert exc.value.code == code
    err = capsys.readouterr().err
    assert err.startswith(f"error: {text}") and err.count("\n") == 1 and "QzKx" not in err


def test_a_password_written_as_a_user_name_gets_a_hint() -> None:
    from tests.conftest import RedisServer

    srv = RedisServer(password="Right-Pass-0").start()
    try:
        with pytest.raises(RedisUnavailable) as exc:
            connect(f"redis://QzJxKvWb@127.0.0.1:{srv.port}/0")
        msg = str(exc.value)
        assert "user name but no password: write redis://:PASSWORD@host" in msg and "QzJ" not in msg
    finally:
        srv.cleanup()


def test_slow_connect_says_once_what_it_waits_for() -> None:
    import socket
    import time

    said: list[str] = []
    with socket.socket() as hole:  # accepts TCP (into the backlog), never answers
        hole.bind(("127.0.0.1", 0))
        hole.listen(4)
        port = hole.getsockname()[1]
        s = CommonSettings(redis_connect_timeout_s=3.0, redis_wait_s=0)
        with pytest.raises(RedisUnavailable, match="Timeout"):
            connect(f"redis://:QzJxKvWb@127.0.0.1:{port}/0", settings=s, on_slow=said.append)
    assert said == [f"waiting for Redis at redis://***@127.0.0.1:{port}/0 ..."]
    time.sleep(0.2)
    assert len(said) == 1


def test_a_stopped_notice_never_speaks() -> None:
    import time

    from lmdq.redis.connection import SLOW_CONNECT_NOTICE_S, _SlowNotice

    said: list[str] = []
    _SlowNotice("x", said.append).stop()
    time.sleep(SLOW_CONNECT_NOTICE_S + 0.5)  # past the due time: stopped means never, not "not yet"
    assert said == []


def test_a_host_name_that_does_not_exist_fails_at_once_a_dns_hiccup_is_waited_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The resolver is replaced (no DNS here: only 127.0.0.0/8): EAI_NONAME is a typo, not an outage."""
    import socket

    answer: list[int] = [socket.EAI_NONAME]

    def resolver(*_: object, **__: object) -> object:
        raise socket.gaierror(answer[0], "resolver says no")

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    slow = RetryPolicy(retries=5, base_s=30.0)  # minutes, were the unknown name retried
    with pytest.raises(RedisUnavailable, match="the host name does not resolve") as exc:
        connect("redis://:QzJxKvWb@no-such-host.invalid:6379/0", policy=slow)
    assert "QzJ" not in str(exc.value)
    answer[0] = socket.EAI_AGAIN
    with pytest.raises(RedisUnavailable, match="cannot reach Redis at") as exc:
        connect("redis://no-such-host.invalid:6379/0", policy=RetryPolicy(retries=2, base_s=0.01))
    assert "does not resolve" not in str(exc.value)


@pytest.fixture()
def structlog_restored() -> Iterator[None]:
    """configure_logging binds the (captured) stderr of this test: give later tests theirs back."""
    import structlog

    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_log_lines_never_carry_a_password_in_a_url(capsys: pytest.CaptureFixture[str],
                                                   structlog_restored: None) -> None:
    """The structlog processor is the net under every log call, tracebacks included."""
    from lmdq.logs.config import configure_logging, get_logger

    configure_logging("json", "INFO")
    log = get_logger("t")
    log.info("connected", url="redis://:Qz7/Kx9@127.0.0.1:1/0", note="also s3://AKQZ:WvJy@bucket/p")
    try:
        raise redis.ConnectionError("Error for rediss://u:Qz7Kx9@h:2/0")
    except redis.ConnectionError:
        log.exception("failed")
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "redis://***@127.0.0.1:1/0" in err and "s3://***@bucket/p" in err
    for piece in ("Qz7", "Kx9", "AKQ", "WvJ"):
        assert piece not in err, err
