"""Shared pieces of the fault tests: submit through the CLI, read worker logs, wait on conditions, check
that a batch came out exactly once. Every fault test drives REAL processes (producer CLI, sim workers,
redis-server) and checks the guarantee from the outside, by reading what landed in Redis."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from lmdq.contract import Result
from lmdq.redis.keys import Keys, queue_name, rq_queue_key
from lmdq.results.store import ResultStore
from tests.conftest import run_cli
from tests.helpers import results_of

SIM = ("--engine", "sim", "--served-model-name", "sim")


def submit(path: Path, env: dict[str, str], *extra: str) -> dict[str, Any]:
    p = run_cli("producer", "submit", str(path), "--model", "sim", "--allow-unknown-model", "--json", *extra, env=env)
    assert p.returncode == 0, p.stderr.decode()
    return json.loads(p.stdout)  # type: ignore[no-any-return]


def events(log: Path) -> list[dict[str, Any]]:
    """The JSON log lines a worker wrote (non-JSON lines, e.g. a traceback, are kept as text)."""
    out: list[dict[str, Any]] = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            out.append({"event": "<non-json>", "text": line})
    return out


def stopped_stats(log: Path) -> dict[str, Any]:
    [stats] = [e for e in events(log) if e.get("event") == "worker stopped"]
    return stats


def no_traceback(log: Path) -> None:
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-4000:]


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> None:
    """Wait on a condition with a generous deadline (never race the wall clock)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def owners(client: redis.Redis, prefix: str) -> dict[str, str]:
    """job id -> worker name for every live lease."""
    raw = client.hgetall(Keys(prefix).lease_owner())
    return {k.decode(): v.decode().split("\t", 1)[0] for k, v in raw.items()}


def assert_exactly_once(client: redis.Redis, prefix: str, bid: str, ids: list[str]) -> list[Result]:
    """Every input custom_id has exactly one final result; counts and store agree; nothing left over."""
    k = Keys(prefix)
    b = ResultStore(client, keys=k).batches.get(bid)
    res = results_of(client, prefix, bid)
    got = [r.custom_id for r in res]
    missing = set(ids) - set(got)
    dup = len(got) - len(set(got))
    assert not missing, f"{len(missing)} missing, e.g. {sorted(missing)[:5]}"
    assert dup == 0, f"{dup} duplicated custom_ids"
    assert sorted(got) == sorted(ids)
    assert all(r.final for r in res)
    assert client.hlen(k.results(bid)) == len(ids)
    assert b.request_counts.total == b.request_counts.done == len(ids)
    assert client.hlen(k.partials(bid)) == 0
    assert client.zcard(k.leases()) == 0 and client.hlen(k.lease_owner()) == 0
    assert client.llen(k.inflight("sim")) == 0
    assert client.llen(rq_queue_key(queue_name("sim", "normal", prefix))) == 0
    return res
