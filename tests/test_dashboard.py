"""The Grafana dashboard (deploy/grafana/lmdq-dashboard.json) queries only series lmdq exports: each
metric name in its PromQL is checked against the names a real worker health registry and a real
queue exporter (against a real redis-server) expose."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lmdq.metrics.exporter import QueueCollector
from lmdq.redis.keys import Keys
from lmdq.registry.store import WorkerRegistry
from lmdq.worker.health import WorkerHealth

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "lmdq-dashboard.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _series_names(text: str) -> set[str]:
    """Every series name a scrape of ``text`` can yield (a labelled counter with no sample yet still
    declares its family)."""
    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        names.update(fam.name + s for s in _SUFFIXES.get(fam.type, ("",)))
    return names


def _exported(client: redis.Redis, prefix: str) -> set[str]:
    worker = WorkerHealth(worker_name="w", model="m")
    reg = CollectorRegistry(auto_describe=False)
    workers = WorkerRegistry(client, keys=Keys(prefix), name=f"{prefix}-w", model="m", ttl_s=5)
    workers.register(pid=1)  # so the exporter has a model to serve series for
    reg.register(QueueCollector(client, Keys(prefix)))
    try:
        return _series_names(worker.metrics_text().decode()) | _series_names(generate_latest(reg).decode())
    finally:
        workers.deregister()  # no record left to expire under other tests sharing this Redis


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def test_dashboard_queries_only_exported_metrics(client: redis.Redis, prefix: str) -> None:
    dash = json.loads(DASHBOARD.read_text())
    exported = _exported(client, prefix)
    assert {"lmdq_queue_depth", "lmdq_jobs_running", "lmdq_workers", "lmdq_tokens_output_total",
            "lmdq_request_latency_seconds_bucket", "lmdq_heartbeat_age_seconds"} <= exported
    used: set[str] = set()
    exprs = [t["expr"] for p in _panels(dash) for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["definition"])
    assert exprs
    for expr in exprs:
        names = set(re.findall(r"\blmdq_[a-z0-9_]+", expr))
        assert names, f"a query with no lmdq metric: {expr}"
        unknown = names - exported
        assert not unknown, f"{expr}: not exported by lmdq: {sorted(unknown)}"
        used |= names
    # the list: queue depth, throughput, running, failed, worker count, engine health
    for must in ("lmdq_queue_depth", "lmdq_tokens_output_total", "lmdq_requests_completed_total",
                 "lmdq_jobs_running", "lmdq_requests_failed_total", "lmdq_workers", "lmdq_worker_ready",
                 "lmdq_heartbeat_age_seconds", "lmdq_exporter_redis_up"):
        assert must in used, must


def test_dashboard_is_importable_grafana_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    panels = _panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        assert {"x", "y", "w", "h"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            # the data source is the dashboard's variable: importable into any Grafana
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]
    # queue series come from the exporter, one per model and priority: summed, never max()'d over
    # copies repeated by every worker (as before the exporter)
    for p in panels:
        for t in p.get("targets", []):
            assert "max(lmdq_queue_depth" not in t["expr"].replace(" ", "")
