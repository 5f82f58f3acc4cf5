"""The worker's HTTP side: liveness, readiness and Prometheus metrics on one small port.

``/healthz``  200 while the main loop beats (Kubernetes liveness, Docker HEALTHCHECK). Before the
              first beat the worker is still starting (loading its model) and counts as alive:
              start-up is bounded by the startup probe, which waits on ``/readyz``. 503 once the
              engine died (the worker is about to exit; a supervisor may restart it sooner).
``/readyz``   200 only if the engine is loaded and alive, Redis answers and the worker is not draining; the
              503 body lists why not.
``/metrics``  Prometheus text format, from a registry of this instance only (several instances can
              live in one process, e.g. in tests).

The server is the standard library's ``ThreadingHTTPServer`` in a daemon thread: probes must be
answered while the engine keeps the main thread and the GIL busy, and a scrape must never be able
to block the worker's shutdown. The worker loop owns the state and calls the setters; handlers
only read it.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["WorkerHealth", "TTFT_BUCKETS", "LATENCY_BUCKETS", "REDIS_CHECK_CACHE_S"]

log = structlog.get_logger(__name__)

# Offline batches run hundreds of sequences per GPU at once, so first tokens and whole requests
# take far longer than in interactive serving: the buckets reach 10 min and 1 h.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LATENCY_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)

REDIS_CHECK_CACHE_S = 2.0
"""How long a Redis check result is reused: probes and scrapes must not hammer Redis."""

_COMPLETED = "completed"


@dataclass(frozen=True)
class _RedisCheck:
    ok: bool
    at: float
    error: str | None = None


class WorkerHealth:
    """Health state and metrics of one worker, and the HTTP server that exposes them.

    Every metric carries the labels ``model`` and ``worker``. All methods are thread-safe.
    """

    def __init__(
        self,
        *,
        worker_name: str,
        model: str,
        liveness_timeout_s: float = 120.0,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if liveness_timeout_s <= 0:
            raise ValueError(f"liveness_timeout_s must be > 0, got {liveness_timeout_s!r}")
        self.worker_name = worker_name
        self.model = model
        self.liveness_timeout_s = float(liveness_timeout_s)
        self.registry = registry if registry is not None else CollectorRegistry()

        self._lock = threading.Lock()
        self._redis_lock = threading.Lock()
        self._engine_loaded = False
        self._draining = False
        self._engine_dead: str | None = None
        self._last_beat: float | None = None
        self._redis_check_fn: Callable[[], bool] | None = None
        self._redis_cached: _RedisCheck | None = None
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

        labels = ("model", "worker")
        values = {"model": model, "worker": worker_name}
        reg = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + extra, registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg).labels(**values)

        self._completed = counter("lmdq_requests_completed", "Requests that finished with a result.").labels(**values)
        self._failed_family = counter(
            "lmdq_requests_failed",
            "Requests that ended without a completion, by final status (failed, cancelled, expired).",
            ("status",),
        )
        self._tokens_in = counter("lmdq_tokens_input", "Prompt tokens of finished requests.").labels(**values)
        self._tokens_out = counter("lmdq_tokens_output", "Generated tokens of finished requests.").labels(**values)
        self._tokens_prefilled = counter(
            "lmdq_tokens_prefilled",
            "Prompt tokens the engine computed (shared n-sample prefills and prefix-cache hits excluded).",
        ).labels(**values)

        # Queue depth is not a worker's: lmdq.metrics.exporter serves it once per Redis, also at zero workers.
        self._requests_in_flight = gauge("lmdq_requests_in_flight", "Requests inside the engine now.")
        self._jobs_in_flight = gauge("lmdq_jobs_in_flight", "Jobs this worker holds now.")
        self._engine_load = gauge("lmdq_engine_load_seconds", "Seconds the engine took to load (0 until loaded).")
        self._ready = gauge("lmdq_worker_ready", "1 when /readyz would answer 200.")
        self._ready.set_function(lambda: 1.0 if self.readiness()[0] else 0.0)
        self._draining_gauge = gauge("lmdq_worker_draining", "1 once the worker is draining for shutdown.")
        self._beat_age = gauge("lmdq_heartbeat_age_seconds", "Seconds since the main loop last beat (NaN before).")
        self._beat_age.set_function(self._read_beat_age)

        self._ttft = Histogram(
            "lmdq_time_to_first_token_seconds",
            "Time from a request entering the engine to its first generated token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=reg,
        ).labels(**values)
        self._latency = Histogram(
            "lmdq_request_latency_seconds",
            "Time from a request entering the engine to its final token.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        ).labels(**values)

    # ------------------------------------------------------------------ state from the worker

    def set_engine_loaded(self, load_seconds: float) -> None:
        """The engine is up; readiness may turn green. Counts as a beat (load can outlast the
        liveness timeout)."""
        self._engine_load.set(max(0.0, float(load_seconds)))
        with self._lock:
            self._engine_loaded = True
            self._last_beat = time.monotonic()

    def set_redis_check(self, fn: Callable[[], bool]) -> None:
        """``fn`` answers "is Redis reachable?" (e.g. a PING with a short socket timeout). It is
        called by ``/readyz`` at most once per ``REDIS_CHECK_CACHE_S``; an exception means no."""
        with self._redis_lock:
            self._redis_check_fn = fn
            self._redis_cached = None

    def set_in_flight(self, *, requests: int, jobs: int) -> None:
        self._requests_in_flight.set(requests)
        self._jobs_in_flight.set(jobs)

    def request_finished(
        self,
        *,
        status: str,
        input_tokens: int,
        output_tokens: int,
        ttft_s: float | None,
        latency_s: float | None,
        prefill_tokens: int | None = None,
    ) -> None:
        """Account one request that reached a final status (``lmdq.contract.ResultStatus``:
        'completed' counts as completed, anything else as failed with that status). ``prefill_tokens``:
        prompt tokens the engine really computed (a shared or cached prefill computes fewer than
        ``input_tokens``); None counts ``input_tokens``."""
        status = str(getattr(status, "value", status))
        if status == _COMPLETED:
            self._completed.inc()
        else:
            self._failed_family.labels(model=self.model, worker=self.worker_name, status=status).inc()
        self._tokens_in.inc(max(0, int(input_tokens)))
        self._tokens_prefilled.inc(max(0, int(input_tokens if prefill_tokens is None else prefill_tokens)))
        self._tokens_out.inc(max(0, int(output_tokens)))
        if ttft_s is not None and math.isfinite(ttft_s) and ttft_s >= 0:
            self._ttft.observe(ttft_s)
        if latency_s is not None and math.isfinite(latency_s) and latency_s >= 0:
            self._latency.observe(latency_s)

    def mark_draining(self) -> None:
        """Shutdown has begun: ``/readyz`` answers 503 from now on (``/healthz`` is unaffected)."""
        with self._lock:
            self._draining = True
        self._draining_gauge.set(1)

    def mark_engine_dead(self, why: str) -> None:
        """The engine is gone for good: ``/healthz`` and ``/readyz`` answer 503 from now on, so a
        supervisor that probes restarts the worker even before it exits by itself."""
        with self._lock:
            self._engine_dead = why or "engine dead"
        self._draining_gauge.set(1)

    def beat(self) -> None:
        """The main loop is alive; call it every iteration."""
        now = time.monotonic()
        with self._lock:
            self._last_beat = now

    # ------------------------------------------------------------------ checks

    def liveness(self) -> tuple[bool, dict[str, Any]]:
        """(alive, details). Alive until the loop has not beaten for ``liveness_timeout_s``."""
        with self._lock:
            last, dead = self._last_beat, self._engine_dead
        if dead is not None:
            return False, {"status": "engine dead", "detail": dead}
        if last is None:
            return True, {"status": "starting", "detail": "no heartbeat yet (engine loading)"}
        age = time.monotonic() - last
        details = {"last_beat_age_s": round(age, 3), "liveness_timeout_s": self.liveness_timeout_s}
        if age > self.liveness_timeout_s:
            return False, {"status": "stalled", **details}
        return True, {"status": "ok", **details}

    def readiness(self) -> tuple[bool, list[str]]:
        """(ready, reasons it is not)."""
        with self._lock:
            loaded, draining, dead = self._engine_loaded, self._draining, self._engine_dead
        reasons: list[str] = []
        if dead is not None:
            reasons.append(f"engine dead: {dead}")
        if not loaded:
            reasons.append("engine not loaded")
        if draining:
            reasons.append("draining")
        redis_ok, redis_error = self._check_redis()
        if not redis_ok:
            reasons.append(f"redis unreachable: {redis_error}" if redis_error else "redis unreachable")
        return not reasons, reasons

    def _check_redis(self) -> tuple[bool, str | None]:
        with self._redis_lock:
            fn = self._redis_check_fn
            if fn is None:
                return False, "no redis check configured"
            cached = self._redis_cached
            now = time.monotonic()
            if cached is not None and now - cached.at < REDIS_CHECK_CACHE_S:
                return cached.ok, cached.error
            try:
                ok, error = bool(fn()), None
            except Exception as e:  # the probe must answer, whatever the check raises
                ok, error = False, f"{type(e).__name__}: {e}"
                log.warning("health.redis_check_failed", error=error)
            self._redis_cached = _RedisCheck(ok=ok, at=time.monotonic(), error=error)
            return ok, error

    def _read_beat_age(self) -> float:
        with self._lock:
            last = self._last_beat
        return math.nan if last is None else time.monotonic() - last

    def metrics_text(self) -> bytes:
        """The Prometheus exposition of this instance's registry."""
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ HTTP server

    def serve(self, host: str = "0.0.0.0", port: int = 8000) -> int:
        """Start the HTTP server in a daemon thread; ``port=0`` picks a free port. Returns the
        bound port."""
        with self._lock:
            if self._server is not None:
                raise RuntimeError(f"health server already serving on port {self._server.server_address[1]}")
            server = _Server((host, port), _make_handler(self))
            self._server = server
            self._thread = threading.Thread(
                target=server.serve_forever,
                kwargs={"poll_interval": 0.1},
                name=f"lmdq-health-{server.server_address[1]}",
                daemon=True,
            )
            self._thread.start()
        bound = int(server.server_address[1])
        log.info("health.serving", host=host, port=bound)
        return bound

    def shutdown(self) -> None:
        """Stop the server (idempotent)."""
        with self._lock:
            server, thread = self._server, self._thread
            self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck request never holds up interpreter exit
    allow_reuse_address = True


def _make_handler(health: WorkerHealth) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "lmdq-worker"
        sys_version = ""
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._dispatch(send_body=True)

        def do_HEAD(self) -> None:
            self._dispatch(send_body=False)

        def _dispatch(self, *, send_body: bool) -> None:
            path = self.path.split("?", 1)[0]
            try:
                if path == "/healthz":
                    alive, details = health.liveness()
                    self._json(HTTPStatus.OK if alive else HTTPStatus.SERVICE_UNAVAILABLE, details, send_body)
                elif path == "/readyz":
                    ready, reasons = health.readiness()
                    body = {"status": "ready" if ready else "not ready", "reasons": reasons}
                    body.update(model=health.model, worker=health.worker_name)
                    self._json(HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE, body, send_body)
                elif path == "/metrics":
                    self._send(HTTPStatus.OK, health.metrics_text(), CONTENT_TYPE_LATEST, send_body)
                else:
                    self._json(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: {path}"}, send_body)
            except Exception as e:  # answer 500 rather than drop the connection
                log.exception("health.handler_failed", path=path)
                self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(e).__name__}: {e}"}, send_body)

        def _json(self, status: HTTPStatus, body: dict[str, Any], send_body: bool) -> None:
            payload = (json.dumps(body, sort_keys=True) + "\n").encode()
            self._send(status, payload, "application/json", send_body)

        def _send(self, status: HTTPStatus, payload: bytes, content_type: str, send_body: bool) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if send_body:
                self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # probes every few seconds would flood the worker's log

    return Handler
