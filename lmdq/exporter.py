"""Queue metrics for Prometheus, read from Redis by ONE small process: ``lmdq-producer exporter`` or
``python -m lmdq.exporter``.

Why not the workers: every worker exported the same queue depth, so ``sum by (model)`` counted it
once per replica, and at zero replicas (KEDA scaled the workers away, jobs waiting) the series
vanished exactly when it mattered. The exporter holds no GPU and runs at 1 replica whatever the
queue, so queue-level series exist once, also at zero workers; workers keep their own series
(tokens, requests, latency, engine health: :mod:`lmdq.worker.health`).

Every series is read at scrape time (a custom collector, no background thread), in two pipelined
round trips whatever the number of models. Redis content is untrusted: names are decoded with
replacement, counts that are not integers count 0, and the number of models, workers and batches
read per scrape is capped. A Redis that is away makes the scrape answer ``lmdq_exporter_redis_up 0``
(and nothing else), never an HTTP error: the exporter never exits because of Redis.

Series (``model`` is the served name, as the workers label theirs):

=================================== ======================================================
``lmdq_queue_depth{model,priority}`` jobs waiting in the model's RQ queue of that priority
``lmdq_jobs_running{model}``        jobs claimed by workers and not yet released
``lmdq_workers{model}``             live workers (heartbeat record present)
``lmdq_batches{status}``            the newest ``LMDQ_EXPORTER_MAX_BATCHES`` batches by status
``lmdq_exporter_redis_up``          1 when the last scrape read Redis
``lmdq_exporter_scrape_seconds``    how long reading Redis took
=================================== ======================================================
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import redis
import structlog
import typer
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import Field

from lmdq.cli_options import FlagSpec, model_options
from lmdq.connection import connect, redact_url
from lmdq.contract import BatchStatus
from lmdq.keys import PRIORITY_ORDER, BatchField, Keys, model_slug, queue_name, rq_queue_key
from lmdq.replies import reply_text
from lmdq.settings import CommonSettings

__all__ = ["EXPORTER_FLAGS", "ExporterSettings", "ModelStats", "QueueCollector", "Snapshot", "load_settings", "main",
           "read_snapshot", "run", "serve"]

log = structlog.get_logger("lmdq.exporter")

MAX_MODELS = 1000
"""Models read per scrape at most (a Redis filled with junk names must not blow up a scrape)."""
MAX_WORKERS = 10_000

_RQ_QUEUES = "rq:queues"
_STATUSES = tuple(s.value for s in BatchStatus)


class ExporterSettings(CommonSettings):
    """The exporter's settings (``LMDQ_`` env vars; ``lmdq-producer exporter`` flags override)."""

    exporter_host: str = Field(default="0.0.0.0", description="address the /metrics server binds")
    exporter_port: int = Field(default=8000, ge=0, le=65535, description="port of /metrics (0: any free port)")
    exporter_max_batches: int = Field(
        default=1000, ge=0, le=1_000_000, description="newest batches counted in lmdq_batches per scrape")


@dataclass(frozen=True)
class ModelStats:
    model: str
    #: priority -> jobs waiting
    depth: dict[str, int]
    running: int
    workers: int


@dataclass(frozen=True)
class Snapshot:
    models: list[ModelStats]
    batches: dict[str, int] = field(default_factory=dict)




def _int(raw: Any) -> int:
    try:
        n = int(raw)
    except (TypeError, ValueError):
        return 0
    return max(0, n)


def _slugs_of_queues(members: Any, prefix: str) -> set[str]:
    """Model slugs of RQ queues named ``<prefix>:<slug>:<priority>`` (RQ's queue set holds
    ``rq:queue:<name>``): a batch submitted for a model no worker has served yet still counts."""
    head = rq_queue_key(f"{prefix}:")
    prios = {p.value for p in PRIORITY_ORDER}
    out: set[str] = set()
    for m in members:
        name = reply_text(m)
        if not name.startswith(head):
            continue
        slug, _, prio = name[len(head):].rpartition(":")
        if slug and prio in prios and ":" not in slug:
            out.add(slug)
    return out


def read_snapshot(client: redis.Redis, keys: Keys, *, max_batches: int = 1000) -> Snapshot:
    """Everything the exporter serves, in two pipelined round trips."""
    with client.pipeline(transaction=False) as p:
        p.hkeys(keys.models())
        p.smembers(_RQ_QUEUES)
        p.srandmember(keys.workers(), MAX_WORKERS)
        if max_batches > 0:
            p.zrevrange(keys.batches(), 0, max_batches - 1)
        served, queues, workers, *newest = p.execute()
    names: dict[str, str] = {}  # slug -> served name (the label workers use)
    for raw in sorted(served)[:MAX_MODELS]:
        name = reply_text(raw)
        names.setdefault(model_slug(name), name)
    for slug in sorted(_slugs_of_queues(queues, keys.prefix)):
        if len(names) >= MAX_MODELS:
            break
        names.setdefault(slug, slug)
    slugs = sorted(names)
    worker_names = [reply_text(w) for w in workers]
    batch_ids = [reply_text(b) for b in newest[0]] if newest else []
    with client.pipeline(transaction=False) as p:
        for slug in slugs:
            for prio in PRIORITY_ORDER:
                p.llen(rq_queue_key(queue_name(slug, prio, keys.prefix)))
            p.llen(keys.inflight(slug))
        for w in worker_names:
            p.hget(keys.worker(w), "model")
        for b in batch_ids:
            p.hget(keys.batch(b), BatchField.status.value)
        out = p.execute()
    n_prio = len(PRIORITY_ORDER)
    per_model = n_prio + 1
    live: Counter[str] = Counter()
    for raw in out[len(slugs) * per_model: len(slugs) * per_model + len(worker_names)]:
        if raw is not None:
            live[model_slug(reply_text(raw))] += 1
    statuses: Counter[str] = Counter()
    for raw in out[len(slugs) * per_model + len(worker_names):]:
        if raw is not None and reply_text(raw) in _STATUSES:
            statuses[reply_text(raw)] += 1
    models = []
    for i, slug in enumerate(slugs):
        row = out[i * per_model: (i + 1) * per_model]
        models.append(ModelStats(
            model=names[slug],
            depth={prio.value: _int(row[j]) for j, prio in enumerate(PRIORITY_ORDER)},
            running=_int(row[n_prio]),
            workers=live[slug],
        ))
    return Snapshot(models=models, batches={s: statuses[s] for s in _STATUSES})


class QueueCollector(Collector):
    """Reads a :class:`Snapshot` at every scrape and turns it into gauges."""

    def __init__(self, client: redis.Redis, keys: Keys, *, max_batches: int = 1000) -> None:
        self.client = client
        self.keys = keys
        self.max_batches = max_batches
        self._lock = threading.Lock()  # one Redis read at a time, however many scrapers
        self._failing = False

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("lmdq_exporter_redis_up", "1 when the last scrape read Redis.")
        took = GaugeMetricFamily("lmdq_exporter_scrape_seconds", "Seconds the last scrape spent reading Redis.")
        t0 = time.monotonic()
        with self._lock:
            try:
                snap = read_snapshot(self.client, self.keys, max_batches=self.max_batches)
            except (redis.RedisError, OSError) as e:
                if not self._failing:  # one line per outage, not one per scrape
                    log.warning("exporter.redis_unavailable", error=f"{type(e).__name__}: {e}")
                self._failing = True
                up.add_metric([], 0.0)
                yield up
                return
            if self._failing:
                log.info("exporter.redis_back")
            self._failing = False
        up.add_metric([], 1.0)
        took.add_metric([], time.monotonic() - t0)
        depth = GaugeMetricFamily("lmdq_queue_depth", "Jobs waiting in the model's queue of this priority.",
                                  labels=["model", "priority"])
        running = GaugeMetricFamily("lmdq_jobs_running", "Jobs claimed by workers and not yet released.",
                                    labels=["model"])
        workers = GaugeMetricFamily("lmdq_workers", "Live workers of the model (heartbeat record present).",
                                    labels=["model"])
        for m in snap.models:
            for prio, n in m.depth.items():
                depth.add_metric([m.model, prio], float(n))
            running.add_metric([m.model], float(m.running))
            workers.add_metric([m.model], float(m.workers))
        batches = GaugeMetricFamily("lmdq_batches", "Batches by status, among the newest LMDQ_EXPORTER_MAX_BATCHES.",
                                    labels=["status"])
        for status, n in snap.batches.items():
            batches.add_metric([status], float(n))
        yield from (up, took, depth, running, workers, batches)


def serve(s: ExporterSettings) -> tuple[Any, int]:
    """Start the /metrics server (daemon thread); returns (server, bound port)."""
    client = connect(s.redis_url, settings=s, check=False)  # a Redis that is away shows as redis_up 0
    registry = CollectorRegistry(auto_describe=False)
    registry.register(QueueCollector(client, Keys(s.key_prefix), max_batches=s.exporter_max_batches))
    server, _thread = start_http_server(s.exporter_port, addr=s.exporter_host, registry=registry)
    port = int(server.server_address[1])
    log.info("exporter.serving", host=s.exporter_host, port=port, redis=redact_url(s.redis_url),
             prefix=s.key_prefix)
    return server, port


EXPORTER_FLAGS = [
    FlagSpec(key=name, flat=name.removeprefix("exporter_"), info=ExporterSettings.model_fields[name])
    for name in ("exporter_host", "exporter_port", "exporter_max_batches")
]


def load_settings(**given: Any) -> ExporterSettings:
    """``LMDQ_*`` env vars under the flags given; a bad value is one line naming it, exit 2."""
    from pydantic import ValidationError

    from lmdq.errors import BadSetting

    try:
        return ExporterSettings(**given)
    except ValidationError as e:
        problems = "; ".join(f"LMDQ_{str(err['loc'][0]).upper() if err['loc'] else '?'}: {err['msg']}"
                             for err in e.errors(include_input=False, include_url=False))
        raise BadSetting(f"invalid setting {problems}") from None


def run(s: ExporterSettings) -> None:
    """Serve until SIGTERM/SIGINT (logging already configured)."""
    import signal

    server, _port = serve(s)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(3600):
        pass
    server.shutdown()
    log.info("exporter.stopped")


@model_options(EXPORTER_FLAGS, into="flags")
def command(
    flags: dict[str, Any],
    redis_url: Annotated[str | None, typer.Option(help="env LMDQ_REDIS_URL, then REDIS_URL")] = None,
) -> None:
    """Serve queue depth, running jobs, live workers and batch counts per model on /metrics, read
    from Redis at each scrape. Run ONE per Redis (it needs no GPU; it works at zero workers)."""
    from lmdq.logs import configure_logging

    s = load_settings(**flags, **({"redis_url": redis_url} if redis_url else {}))
    configure_logging(s.log_format, s.log_level)
    run(s)


def main() -> None:
    from lmdq.errors import run_cli

    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
    app.command()(command)
    run_cli(app)


if __name__ == "__main__":
    main()
