"""Queue metrics for Prometheus, read from Redis by ONE small process: ``lmdq-producer exporter`` or
``python -m lmdq.metrics`` (the command line is :mod:`lmdq.metrics.cli`).

Why not the workers: every worker exported the same queue depth, so ``sum by (model)`` counted it
once per replica, and at zero replicas (KEDA scaled the workers away, jobs waiting) the series
vanished exactly when it mattered. The exporter holds no GPU and runs at 1 replica whatever the
queue, so queue-level series exist once, also at zero workers; workers keep their own series
(tokens, requests, latency, engine health: :mod:`lmdq.worker.health`).

Redis is read by ONE collector thread every ``LMDQ_EXPORTER_INTERVAL_S`` (:class:`SnapshotCollector`),
never by a scrape: a scrape serves the last snapshot and its age, so any number of scrapers cost
Redis nothing and answer at once, and a frozen Redis cannot hold them. A read walks the model and
queue sets with short SCAN calls within a budget (:data:`lmdq.metrics.queue_stats.SCAN_CALLS`), then takes two pipelined
round trips whatever the number of models; the whole read has ``LMDQ_EXPORTER_READ_TIMEOUT_S`` of
Redis time. Redis content is untrusted: names are decoded with replacement, counts that are not
integers count 0, and the number of models, workers and batches read is capped. A Redis that is
away, or a read still waiting past its budget, makes the scrape answer ``lmdq_exporter_redis_up 0``
(and no queue series: stale depth must not drive an autoscaler), never an HTTP error: the exporter
never exits because of Redis.

Series (``model`` is the served name, as the workers label theirs):

======================================== ====================================================
``lmdq_queue_depth{model,priority}``     jobs waiting in the model's RQ queue of that priority
``lmdq_jobs_running{model}``             jobs claimed by workers and not yet released
``lmdq_workers{model}``                  live workers (heartbeat record present)
``lmdq_batches{status}``                 the newest ``LMDQ_EXPORTER_MAX_BATCHES`` batches by status
``lmdq_workers_needed{model}``           workers needed to meet every open deadline (issue 46; 0: none)
``lmdq_exporter_redis_up``               1 when the last read succeeded and none is overdue
``lmdq_exporter_snapshot_age_seconds``   seconds since the served snapshot's read began
``lmdq_exporter_scrape_seconds``         how long the last read of Redis took
``lmdq_exporter_truncated``              1 when the last read stopped at its SCAN budget
======================================== ====================================================
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import redis
import structlog
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from lmdq.metrics.queue_stats import Snapshot, read_snapshot
from lmdq.metrics.settings import EXPORTER_FLAGS, ExporterSettings, load_settings
from lmdq.redis.connection import connect, redact_url
from lmdq.redis.keys import Keys

__all__ = ["EXPORTER_FLAGS", "ExporterSettings", "QueueCollector", "SnapshotCollector", "View", "load_settings",
           "run", "serve", "start_metrics_server"]

log = structlog.get_logger("lmdq.metrics.exporter")


@dataclass(frozen=True)
class View:
    """What a scrape serves: the last good snapshot (or None), whether Redis is up, and ages."""

    snapshot: Snapshot | None
    up: bool
    #: seconds since the served snapshot's read began (None: no snapshot yet)
    age_s: float | None
    #: seconds the last finished read took
    took_s: float


class SnapshotCollector:
    """ONE thread that reads Redis every ``interval_s`` and keeps the last snapshot; scrapes only look.

    Why: read at scrape time, every scrape was a Redis read under a lock, so 200 scrapers queued for
    seconds behind each other and a frozen Redis held every one for a socket timeout (Prometheus gave
    up at 10 s and never saw ``redis_up 0``). Now a scrape costs no Redis command and answers at
    once, and Redis is read once per interval whatever the number of scrapers.

    Redis is judged down when the last read failed, or when a read has been running longer than
    ``timeout_s`` (a frozen Redis: the read is still waiting on its socket), so ``redis_up`` turns
    0 at most ``interval_s + timeout_s`` after Redis stops answering. ``clock`` is monotonic time
    (a test may pass its own).
    """

    def __init__(self, client: redis.Redis, keys: Keys, *, max_batches: int = 1000, interval_s: float = 5.0,
                 timeout_s: float = 3.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.keys = keys
        self.max_batches = max_batches
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None
        self._read_at: float | None = None  # when the served snapshot's read began
        self._ok = False
        self._took = 0.0
        self._reading_since: float | None = None
        self._failing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reads = 0  # finished reads, good or not (tests wait on it)
        self._missing: set[str] = set()  # batches last seen projected to miss their deadline

    def collect_once(self) -> bool:
        """One read of Redis; True when it gave a new snapshot."""
        t0 = self._clock()
        with self._lock:
            self._reading_since = t0
        try:
            snap = read_snapshot(self.client, self.keys, max_batches=self.max_batches, timeout_s=self.timeout_s)
        except (redis.RedisError, OSError) as e:
            with self._lock:
                self._ok, self._took, self._reading_since = False, self._clock() - t0, None
                self.reads += 1
            if not self._failing:  # one line per outage, not one per read
                log.warning("exporter.redis_unavailable", error=f"{type(e).__name__}: {e}")
            self._failing = True
            return False
        with self._lock:
            self._snapshot, self._read_at, self._ok = snap, t0, True
            self._took, self._reading_since = self._clock() - t0, None
            self.reads += 1
        if self._failing:
            log.info("exporter.redis_back")
        self._failing = False
        self._warn_deadlines(snap)
        return True

    def _warn_deadlines(self, snap: Snapshot) -> None:
        """One log line per batch as soon as its projected finish passes its deadline (issue 46), and one
        when it is back on time: said before the deadline is missed, not after."""
        missing = {o.batch_id: o for o in snap.outlooks if o.misses}
        for bid, o in missing.items():
            if bid not in self._missing:
                log.warning("batch projected to miss its deadline", batch_id=bid, deadline=o.deadline,
                            projected_finish=o.finish, basis=o.basis)
        for o in snap.outlooks:
            if o.batch_id in self._missing and not o.misses:
                log.info("batch back on time for its deadline", batch_id=o.batch_id, deadline=o.deadline,
                         projected_finish=o.finish, basis=o.basis)
        self._missing = set(missing)

    def view(self) -> View:
        """The state a scrape serves (no Redis call)."""
        now = self._clock()
        with self._lock:
            stuck = self._reading_since is not None and now - self._reading_since > self.timeout_s
            age = None if self._read_at is None else now - self._read_at
            return View(snapshot=self._snapshot, up=self._ok and not stuck, age_s=age, took_s=self._took)

    def start(self) -> None:
        """Read now, then every ``interval_s`` on a daemon thread (the first read is done on return)."""
        self.collect_once()
        self._thread = threading.Thread(target=self._loop, name="lmdq-exporter-collector", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.collect_once()
            except Exception:  # noqa: BLE001 - the collector must outlive anything Redis sends
                log.exception("exporter.collect_crashed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 5)


class QueueCollector(Collector):
    """Turns the :class:`SnapshotCollector`'s last snapshot into gauges at each scrape, without
    touching Redis. Every family is declared on every scrape, empty while Redis is down (stale
    queue depth must not drive an autoscaler), so dashboards and alerts always find the names."""

    def __init__(self, client: redis.Redis, keys: Keys, *, max_batches: int = 1000, interval_s: float = 5.0,
                 timeout_s: float = 3.0) -> None:
        self.snapshots = SnapshotCollector(client, keys, max_batches=max_batches, interval_s=interval_s,
                                           timeout_s=timeout_s)

    def collect(self) -> Iterator[Metric]:
        v = self.snapshots.view()
        up = GaugeMetricFamily("lmdq_exporter_redis_up",
                               "1 when the last read of Redis succeeded and no read is overdue.")
        up.add_metric([], 1.0 if v.up else 0.0)
        age = GaugeMetricFamily("lmdq_exporter_snapshot_age_seconds",
                                "Seconds since the read of the last good snapshot began (grows while Redis is away).")
        if v.age_s is not None:
            age.add_metric([], v.age_s)
        took = GaugeMetricFamily("lmdq_exporter_scrape_seconds", "Seconds the last read of Redis took.")
        took.add_metric([], v.took_s)
        truncated = GaugeMetricFamily("lmdq_exporter_truncated",
                                      "1 when the last read hit its SCAN budget or model cap (series may be missing).")
        depth = GaugeMetricFamily("lmdq_queue_depth", "Jobs waiting in the model's queue of this priority.",
                                  labels=["model", "priority"])
        running = GaugeMetricFamily("lmdq_jobs_running", "Jobs claimed by workers and not yet released.",
                                    labels=["model"])
        workers = GaugeMetricFamily("lmdq_workers", "Live workers of the model (heartbeat record present).",
                                    labels=["model"])
        batches = GaugeMetricFamily("lmdq_batches", "Batches by status, among the newest LMDQ_EXPORTER_MAX_BATCHES.",
                                    labels=["status"])
        needed = GaugeMetricFamily("lmdq_workers_needed", "Workers the model needs to meet every open deadline "
                                   "(earliest first; 0: no open deadline batch). KEDA scales on it.",
                                   labels=["model"])
        snap = v.snapshot
        if v.up and snap is not None:
            for model in sorted({m.model for m in snap.models} | set(snap.workers_needed)):
                needed.add_metric([model], float(snap.workers_needed.get(model, 0)))
            truncated.add_metric([], 1.0 if snap.truncated else 0.0)
            for m in snap.models:
                for prio, n in m.depth.items():
                    depth.add_metric([m.model, prio], float(n))
                running.add_metric([m.model], float(m.running))
                workers.add_metric([m.model], float(m.workers))
            for status, n in snap.batches.items():
                batches.add_metric([status], float(n))
        yield from (up, age, took, truncated, depth, running, workers, batches, needed)


class _Server(ThreadingWSGIServer):
    """/metrics over HTTP, a thread per scrape; a deep accept queue, so 200 scrapers connecting at
    once are accepted at once instead of retrying their SYNs (the stdlib default queue is 5)."""

    request_queue_size = 1024


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        """No access log on stderr: scrapes are not events."""


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> tuple[Any, int]:
    """/metrics of ``registry`` on ``host:port`` (IPv6 when the host has a ':'), served by a daemon
    thread, a thread per scrape; returns (server, bound port)."""
    family, bind = (socket.AF_INET6, host.strip("[]")) if ":" in host else (socket.AF_INET, host)
    server_class = type("_BoundServer", (_Server,), {"address_family": family})
    server: Any = make_server(bind, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="lmdq-exporter-http", daemon=True).start()
    return server, int(server.server_address[1])


def serve(s: ExporterSettings) -> tuple[Any, int]:
    """Read Redis once, start the collector thread and the /metrics server (daemon threads); returns
    (server, bound port). ``server.collector`` is the :class:`SnapshotCollector`."""
    # The collector's connection: every reply within the read budget (a frozen Redis is given up on
    # after LMDQ_EXPORTER_READ_TIMEOUT_S, not a full socket timeout); a Redis that is away shows as
    # redis_up 0, it never stops the exporter.
    budget = min(s.redis_socket_timeout_s, s.exporter_read_timeout_s)
    conn = s.model_copy(update={"redis_socket_timeout_s": budget,
                                "redis_connect_timeout_s": min(s.redis_connect_timeout_s, budget)})
    client = connect(s.redis_url, settings=conn, check=False)
    registry = CollectorRegistry(auto_describe=False)
    queue = QueueCollector(client, Keys(s.key_prefix), max_batches=s.exporter_max_batches,
                           interval_s=s.exporter_interval_s, timeout_s=budget)
    registry.register(queue)
    queue.snapshots.start()
    server, port = start_metrics_server(registry, s.exporter_host, s.exporter_port)
    server.collector = queue.snapshots
    log.info("exporter.serving", host=s.exporter_host, port=port, redis=redact_url(s.redis_url),
             prefix=s.key_prefix, interval_s=s.exporter_interval_s, read_timeout_s=budget)
    return server, port


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
    server.collector.stop()
    log.info("exporter.stopped")
