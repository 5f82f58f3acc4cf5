"""The producer CLI at its boundary, as a user runs it (subprocess, real redis-server): careless and
malformed Redis URLs never print a password nor a traceback (exit 3); a frozen or black-holed Redis is
one line and exit 3 within 15 s, after saying what it waits for; bad settings are exit 2."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from lmdq.redis.keys import Keys, queue_name, rq_queue_key
from tests.conftest import ROOT, RedisServer, free_port, run_cli

PW = "QzJx7/KvW"  # no 3-character piece of it occurs in lmdq's wording, hosts or ports


@pytest.fixture(scope="module")
def locked_redis() -> Iterator[RedisServer]:
    """A real server with a password, so well-formed URLs with wrong credentials meet a real refusal."""
    srv = RedisServer(password="Right-Pass-0").start()
    try:
        yield srv
    finally:
        srv.cleanup()


def _corpus(port: int, closed: int) -> list[tuple[str, str]]:
    """(LMDQ_REDIS_URL, the secret in it): the issue's URLs and the other ways passwords get mangled."""
    h = "127.0.0.1"
    return [
        (f"redis://:S3cret/PW@{h}:6438/0".replace("S3cret/PW", PW), PW),  # the issue's, '/' in the password
        (f"redis://:QzJx#KvW@{h}:{closed}/0", "QzJx#KvW"),
        (f"redis://:QzJx?KvW@{h}:{closed}/0", "QzJx?KvW"),
        (f"redis://QzJxKvWb@{h}:{port}/0", "QzJxKvWb"),  # missing ':': the password parses as a user name
        (f"redis:/:QzJxKvWb@{h}:{port}/0", "QzJxKvWb"),  # 'redis:/'
        (f"redis:QzJxKvWb@{h}:{port}/0", "QzJxKvWb"),
        (f"redis://user:QzJxKvWb@{h}:abc/0", "QzJxKvWb"),  # non-numeric port (a traceback before)
        (f"redis://user:QzJxKvWb@{h}:99999/0", "QzJxKvWb"),
        ("redis://user:QzJxKvWb", "QzJxKvWb"),  # host forgotten: the password parses as a port
        ("redis://:QzJxKvWb", "QzJxKvWb"),
        (f"redis://:Qz@Jx@KvWb@{h}:{port}/0", "Qz@Jx@KvWb"),  # '@' in the password: well-formed, wrong password
        (f"redis://:QzJxKvWb@{h}:{port}/0", "QzJxKvWb"),  # wrong password, real server
        (f"redis://admin:QzJxKvWb@{h}:{port}/0", "QzJxKvWb"),  # unknown ACL user
        (f"redis://:Qz:Jx:KvWb@{h}:{port}/0", "Qz:Jx:KvWb"),
        (f"redis://:QzJx%2FKvWb@{h}:{closed}/0", "QzJx%2FKvWb"),  # percent-encoded, nothing listening
        (f"rediss://:QzJxKvWb@{h}:{port}/0", "QzJxKvWb"),  # TLS to a plain-text server
        (f"http://u:QzJxKvWb@{h}:{port}/0", "QzJxKvWb"),  # wrong scheme
        (f"REDIS://:QzJxKvWb@{h}:{closed}/0", "QzJxKvWb"),
        (f"redis://:QzJx KvWb@{h}:{port}/0", "QzJx KvWb"),  # space
        (f"redis://:QzJx\tKvWb@{h}:{port}/0", "QzJx\tKvWb"),  # tab
        (f"  redis://:QzJxKvWb@{h}:{port}/0", "QzJxKvWb"),  # leading spaces
        (f"redis://:QzJxKvWb@[::1:{port}/0", "QzJxKvWb"),  # unbalanced '['
        (f"redis://:QzJxKvWb@{h}:{port}/notadb", "QzJxKvWb"),
        (f"redis://:QzJxKvWb@{h}:{port}/0#frag", "QzJxKvWb"),
        (f"redis://{h}:{port}/0?password=QzJxKvWb", "QzJxKvWb"),  # redis-py takes a password from the query
        (f"redis://:QzJxKvWb@{h}:{port}/0?socket_timeout=abc", "QzJxKvWb"),
        ("redis://:QzJxKvWb@\u2603\u2603..:6379/0", "QzJxKvWb"),
        ("unix://:QzJxKvWb@/nonexistent/redis.sock", "QzJxKvWb"),
        ("redis://:QzJxKvWb@", "QzJxKvWb"),
        ("://:QzJxKvWb@h", "QzJxKvWb"),
        ("QzJxKvWb", "QzJxKvWb"),
        (f"QzJxKvWb:{h}", "QzJxKvWb"),
    ]


def test_malformed_url_corpus_never_prints_the_password_nor_a_traceback(locked_redis: RedisServer,
                                                                        env: dict[str, str]) -> None:
    corpus = _corpus(locked_redis.port, free_port())
    assert len(corpus) >= 20
    failures = []

    def start(url: str) -> subprocess.Popen[bytes]:
        # LMDQ_REDIS_WAIT_S=0: no waiting for the closed ports, one attempt each; a short connect timeout
        # for the TLS handshake that a plain-text server never completes
        e = {**env, "LMDQ_REDIS_URL": url, "LMDQ_REDIS_WAIT_S": "0", "LMDQ_REDIS_CONNECT_TIMEOUT_S": "2"}
        return subprocess.Popen([sys.executable, "-m", "lmdq.producer", "status", "x"], env=e, cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    for i in range(0, len(corpus), 4):  # four at a time: the CLI's start-up dominates
        group = [(url, secret, start(url)) for url, secret in corpus[i:i + 4]]
        for url, secret, p in group:
            stdout, stderr = p.communicate(timeout=60)
            out = stdout.decode() + stderr.decode()
            pieces = [secret[i:i + 3] for i in range(len(secret) - 2)]
            leaked = [piece for piece in pieces if piece in out]
            lines = stderr.decode().strip().splitlines()
            if lines and lines[0].startswith("waiting for Redis at "):  # the slow-connect notice may come first
                lines = lines[1:]
            if (p.returncode != 3 or leaked or "Traceback" in out or len(lines) != 1
                    or not lines[0].startswith("error: ")):
                failures.append((url, p.returncode, leaked, out))
    assert not failures, "\n".join(map(repr, failures))


def test_redis_url_flag_is_checked_the_same_way(env: dict[str, str]) -> None:
    p = run_cli("producer", "--redis-url", f"redis://:{PW}@127.0.0.1:1/0", "list", env=env)
    err = p.stderr.decode()
    assert p.returncode == 3 and "percent-encode" in err and "QzJ" not in err and "Traceback" not in err


def _assert_one_line_exit_3_in_time(p: subprocess.Popen[bytes], started: float, what: str) -> str:
    out, err_b = p.communicate(timeout=60)
    elapsed = time.monotonic() - started
    err = err_b.decode()
    assert p.returncode == 3, err
    assert elapsed < 15, f"{what}: {elapsed:.1f} s"  # the client gives up after a 5-10 s timeout: huge slack
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: cannot reach Redis at ") and "Timeout" in lines[-1], err
    assert "Traceback" not in err and out == b""
    return err


def test_frozen_redis_status_and_results_exit_3_within_15_s(env: dict[str, str]) -> None:
    """A real redis-server, SIGSTOPped: TCP still connects (the kernel accepts), nothing answers."""
    srv = RedisServer(password="Right-Pass-0").start()
    assert srv.proc is not None
    srv.proc.send_signal(signal.SIGSTOP)
    try:
        e = {**env, "LMDQ_REDIS_URL": srv.url}
        started = time.monotonic()
        status = subprocess.Popen([sys.executable, "-m", "lmdq.producer", "status", "x"], env=e, cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        results = subprocess.Popen([sys.executable, "-m", "lmdq.producer", "results", "x"], env=e, cwd=ROOT,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for name, p in (("status", status), ("results", results)):
            err = _assert_one_line_exit_3_in_time(p, started, name)
            # after ~1 s it said what it is waiting for, with the password redacted
            assert f"waiting for Redis at redis://***@127.0.0.1:{srv.port}/0 ..." in err, err
            assert "Right-Pass" not in err
    finally:
        srv.proc.send_signal(signal.SIGCONT)
        srv.cleanup()


@pytest.fixture()
def black_hole() -> Iterator[int]:
    """A local port that accepts TCP but never answers: the 127.0.0.0/8 stand-in for a dropped route
    (the kernel completes the handshake into the backlog; nobody ever accepts or reads)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield int(s.getsockname()[1])


def test_black_holed_redis_is_one_line_exit_3_within_15_s(black_hole: int, env: dict[str, str]) -> None:
    e = {**env, "LMDQ_REDIS_URL": f"redis://127.0.0.1:{black_hole}/0"}
    started = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "lmdq.producer", "list"], env=e, cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    err = _assert_one_line_exit_3_in_time(p, started, "black hole")
    assert f"waiting for Redis at redis://127.0.0.1:{black_hole}/0 ..." in err


def test_a_redis_that_comes_back_within_the_wait_is_used(env: dict[str, str], tmp_path: Path) -> None:
    """Refused connections are retried (jittered backoff) until LMDQ_REDIS_WAIT_S: the server is started
    only once the CLI has said it is waiting, so the CLI has certainly met a closed port first."""
    port = free_port()
    srv = RedisServer(port=port)
    p = subprocess.Popen([sys.executable, "-m", "lmdq.producer", "list", "--json"], cwd=ROOT,
                         env={**env, "LMDQ_REDIS_URL": f"redis://127.0.0.1:{port}/0", "LMDQ_REDIS_WAIT_S": "60"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stderr is not None
        first = p.stderr.readline().decode()
        assert first.startswith(f"waiting for Redis at redis://127.0.0.1:{port}/0"), first
        srv.start()
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()
    finally:
        p.kill()
        srv.cleanup()


def test_bad_setting_is_one_line_exit_2_naming_the_variable_not_its_value(env: dict[str, str]) -> None:
    p = run_cli("producer", "list", env={**env, "LMDQ_REDIS_SOCKET_TIMEOUT_S": "QzJxKvWb"})
    err = p.stderr.decode()
    assert p.returncode == 2, err
    assert err.startswith("error: invalid setting LMDQ_REDIS_SOCKET_TIMEOUT_S: ") and err.count("\n") == 1
    assert "QzJ" not in err and "Traceback" not in err


def test_help_documents_the_exit_codes(env: dict[str, str]) -> None:
    p = run_cli("producer", "--help", env={**env, "COLUMNS": "200"})
    text = " ".join(p.stdout.decode().split())
    assert p.returncode == 0
    for code in ("0 ok", "2 bad input", "3 Redis unreachable", "4 results shard unreadable", "5 Redis refused"):
        assert code in text, text


def test_careless_lines_are_refused_by_submit_with_file_line_exit_2_nothing_enqueued(
        tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str) -> None:
    """#14's accepted-but-wrong inputs, all in one file: each is reported with file:line, exit 2."""
    f = tmp_path / "careless.jsonl"
    f.write_text("\n".join([
        '{"custom_id": "ok", "prompt": "fine"}',
        '{"custom_id": "ws", "prompt": "   \\t  "}',
        '{"custom_id": "nc", "messages": [{"role": "user"}]}',
        '{"custom_id": "dup", "prompt": "a", "params": {"max_new_tokens": 5, "max_new_tokens": 50}}',
    ]) + "\n")
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", env=env)
    err = p.stderr.decode()
    assert p.returncode == 2, err
    assert f"{f}:2: field 'prompt': expected some text, got only whitespace" in err
    assert f"{f}:3: field 'messages[0].content': expected a string or a list of text parts, got nothing" in err
    assert f"{f}:4: duplicate key 'max_new_tokens' in one JSON object" in err
    assert "Traceback" not in err
    assert client.zcard(Keys(prefix).batches()) == 0 and not client.keys(f"{prefix}:*")
    assert client.llen(rq_queue_key(queue_name("sim", "normal", prefix))) == 0


def test_status_watch_outlives_a_redis_restart(env: dict[str, str]) -> None:
    """A long wait (``status --watch``) is not ended by a Redis restart: its polls wait for Redis under
    the one retry policy and say so once. Each step waits on a condition, never on the clock."""
    from lmdq.contract import Batch, BatchStatus, RequestCounts
    from lmdq.results.store import ResultStore

    srv = RedisServer(aof=True).start()
    w: subprocess.Popen[bytes] | None = None
    try:
        keys = Keys("watch")
        ResultStore(redis.Redis.from_url(srv.url), keys=keys).batches.create(Batch(
            id="b1", model="sim", status=BatchStatus.queued, batch_size=1, request_counts=RequestCounts(total=1),
            created_at=time.time()))
        w = subprocess.Popen([sys.executable, "-m", "lmdq.producer", "status", "b1", "--watch", "--interval", "0.05"],
                             env={**env, "LMDQ_REDIS_URL": srv.url, "LMDQ_KEY_PREFIX": "watch"}, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        probe = redis.Redis.from_url(srv.url)
        deadline = time.monotonic() + 60
        while len(probe.client_list()) < 2:  # the watcher is connected and polling
            assert time.monotonic() < deadline and w.poll() is None
            time.sleep(0.05)
        srv.stop()  # clean shutdown: the AOF keeps the batch
        assert w.stderr is not None
        seen: list[str] = []
        line = w.stderr.readline().decode()
        while "lost Redis" not in line:  # the watcher noticed (rich may draw its bar first)
            assert line, f"the watcher ended instead of waiting for Redis (exit {w.wait(10)}): {seen}"
            seen.append(line)
            line = w.stderr.readline().decode()
        srv.start()
        ResultStore(redis.Redis.from_url(srv.url), keys=keys).batches.transition("b1", [BatchStatus.queued],
                                                                          BatchStatus.cancelled)
        out, err = w.communicate(timeout=120)
        assert w.returncode == 0, err.decode()
        assert out.decode().startswith("b1  cancelled")
    finally:
        if w is not None and w.poll() is None:
            w.kill()
        srv.cleanup()
