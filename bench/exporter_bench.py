"""``lmdq-bench exporter``: concurrent scrapes of the queue exporter, read at scrape vs from a snapshot.

Issue 29 measured p50 7.6 s / p95 62 s for 200 concurrent scrapes with 10,000 batches in Redis: every
scrape read Redis, one at a time. The exporter now serves the last snapshot of ONE collector. Both
ways run here side by side in one process, on the same Redis and data: "at_scrape" is the exporter's
own collector made to read Redis inside each scrape (bd9ca4b's behaviour), "snapshot" is the exporter
as shipped. Numbers: scrape latency percentiles, scrapes that missed Prometheus' 10 s timeout, and
Redis commands per scrape (``INFO stats``, exact).
"""

from __future__ import annotations

import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from lmdq.batches.records import BatchHashes
from lmdq.metrics.exporter import QueueCollector, start_metrics_server
from lmdq.redis.connection import connect
from lmdq.redis.keys import BatchField, Keys
from lmdq.redis.server import info
from lmdq_bench.keyspace import delete

__all__ = ["run_exporter_bench", "table"]

SCRAPE_TIMEOUT_S = 10.0
"""Prometheus' default scrape timeout: a scrape slower than this is a failed scrape."""


class _AtScrape(QueueCollector):
    """bd9ca4b's exporter: a read of Redis inside every scrape, one scrape at a time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self.snapshots.collect_once()
            yield from super().collect()


def _serve(collector: QueueCollector) -> tuple[Any, int]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return start_metrics_server(registry, "127.0.0.1", 0)  # the exporter's own server, as deployed


def _scrape(port: int) -> float | None:
    """Seconds one scrape took, or None when it failed or passed the scrape timeout."""
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as r:
            r.read()
    except OSError:
        return None
    took = time.monotonic() - t0
    return took if took <= SCRAPE_TIMEOUT_S else None


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _round(client: redis.Redis, port: int, scrapes: int) -> dict[str, Any]:
    before = int(info(client, "stats")["total_commands_processed"])
    with ThreadPoolExecutor(scrapes) as pool:
        got = list(pool.map(lambda _: _scrape(port), range(scrapes)))
    commands = int(info(client, "stats")["total_commands_processed"]) - before - 1  # not the first INFO
    ok = sorted(t for t in got if t is not None)
    return {"scrapes": scrapes, "failed": scrapes - len(ok), "p50_s": round(_pct(ok, 0.5), 4),
            "p95_s": round(_pct(ok, 0.95), 4), "max_s": round(ok[-1] if ok else float("nan"), 4),
            "redis_commands_per_scrape": round(commands / scrapes, 2)}


def run_exporter_bench(redis_url: str, *, batches: int = 10_000, scrapes: int = 200,
                       log: Callable[[str], None] = print) -> dict[str, Any]:
    """Fill ``batches`` batch records, then ``scrapes`` concurrent scrapes each way."""
    client = connect(redis_url)
    keys = Keys(f"bench{uuid.uuid4().hex[:8]}")
    statuses = ("completed", "in_progress", "failed", "cancelled")
    records = BatchHashes(client, keys=keys)  # status-only records: all the exporter reads of a batch
    for i in range(batches):
        records.write(f"batch_{i:06d}", {BatchField.status.value: statuses[i % 4]}, created_at=i, ttl_s=86_400)
    log(f"{batches:,} batches in Redis; {scrapes} concurrent scrapes each way")
    out: dict[str, Any] = {"batches": batches}
    try:
        for name, cls in (("at_scrape", _AtScrape), ("snapshot", QueueCollector)):
            collector = cls(connect(redis_url, check=False), keys, interval_s=5.0, timeout_s=SCRAPE_TIMEOUT_S)
            if cls is QueueCollector:
                collector.snapshots.start()
            server, port = _serve(collector)
            try:
                out[name] = _round(client, port, scrapes)
            finally:
                server.shutdown()
                collector.snapshots.stop()
            log(f"{name}: {out[name]}")
    finally:
        delete(client, [*(keys.batch(f"batch_{i:06d}") for i in range(batches)), keys.batches()])
    out["p95_ratio"] = round(out["at_scrape"]["p95_s"] / max(out["snapshot"]["p95_s"], 1e-6), 1)
    return out


def table(res: dict[str, Any]) -> str:
    rows = [f"{'':10s} {'p50 s':>8s} {'p95 s':>8s} {'max s':>8s} {'failed':>7s} {'Redis cmds/scrape':>18s}"]
    for name in ("at_scrape", "snapshot"):
        r = res[name]
        rows.append(f"{name:10s} {r['p50_s']:>8.3f} {r['p95_s']:>8.3f} {r['max_s']:>8.3f} {r['failed']:>7d} "
                    f"{r['redis_commands_per_scrape']:>18.2f}")
    rows.append(f"p95 at_scrape / snapshot: {res['p95_ratio']}x")
    return "\n".join(rows)
