"""The demo (scripts/quickstart.py, README command 1) leaves nothing behind: its own redis-server
stops and its data folder goes with it (bd9ca4b kept an appendonly file in /tmp after every run)."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import redis

from tests.conftest import ROOT


def test_the_demo_redis_leaves_no_file_in_tmp() -> None:
    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "scripts" / "quickstart.py")
    assert spec is not None and spec.loader is not None
    qs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qs)
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("lmdq-quickstart-redis-*"))
    with qs.local_redis() as url:
        c = redis.Redis.from_url(url)
        c.set("k", "v" * 1000)
        (new,) = set(tmp.glob("lmdq-quickstart-redis-*")) - before
        assert c.config_get("appendonly")["appendonly"] == "no"
    assert not new.exists()
    assert set(tmp.glob("lmdq-quickstart-redis-*")) == before
    try:
        c.ping()
        raise AssertionError("the demo's redis-server is still up")
    except redis.ConnectionError:
        pass
