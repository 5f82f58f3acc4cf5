"""worker.health against a real server on a free port, through urllib (what probes and
Prometheus do)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmdq.worker import health as health_mod
from lmdq.worker.health import WorkerHealth

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
WORKER = "worker-test-1"


def get(port: int, path: str, method: str = "GET") -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def samples(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    status, body, headers = get(port, "/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(port: int, name: str, **labels: str) -> float:
    key = (name, frozenset({"model": MODEL, "worker": WORKER, **labels}.items()))
    found = samples(port)
    assert key in found, f"{name}{labels} not exported; have {sorted(n for n, _ in found)}"
    return found[key]


@pytest.fixture
def health() -> Iterator[WorkerHealth]:
    h = WorkerHealth(worker_name=WORKER, model=MODEL)
    yield h
    h.shutdown()


@pytest.fixture
def served(health: WorkerHealth) -> tuple[WorkerHealth, int]:
    port = health.serve(host="127.0.0.1", port=0)
    assert port > 0
    return health, port


def make_ready(h: WorkerHealth) -> None:
    h.set_redis_check(lambda: True)
    h.set_engine_loaded(12.5)


# ---------------------------------------------------------------------------- readiness


def test_readyz_503_before_engine_loaded(served: tuple[WorkerHealth, int]) -> None:
    h, port = served
    h.set_redis_check(lambda: True)
    status, body, headers = get(port, "/readyz")
    assert status == 503
    assert headers["Content-Type"] == "application/json"
    doc = json.loads(body)
    assert doc["status"] == "not ready"
    assert doc["reasons"] == ["engine not loaded"]
    assert doc["model"] == MODEL and doc["worker"] == WORKER


def test_readyz_200_when_loaded_and_redis_ok(served: tuple[WorkerHealth, int]) -> None:
    h, port = served
    make_ready(h)
    status, body, _ = get(port, "/readyz")
    assert status == 200
    assert json.loads(body) == {"status": "ready", "reasons": [], "model": MODEL, "worker": WORKER}


def test_readyz_503_when_redis_check_fails(served: tuple[WorkerHealth, int]) -> None:
    h, port = served
    h.set_engine_loaded(1.0)
    h.set_redis_check(lambda: False)
    status, body, _ = get(port, "/readyz")
    assert status == 503
    assert json.loads(body)["reasons"] == ["redis unreachable"]


def test_readyz_503_when_redis_check_raises(served: tuple[WorkerHealth, int]) -> None:
    h, port = served
    h.set_engine_loaded(1.0)

    def boom() -> bool:
        raise ConnectionError("Connection refused")

    h.set_redis_check(boom)
    status, body, _ = get(port, "/readyz")
    assert status == 503
    (reason,) = json.loads(body)["reasons"]
    assert reason.startswith("redis unreachable") and "Connection refused" in reason


def test_readyz_503_without_redis_check(served: tuple[WorkerHealth, int]) -> None:
    h, port = served
    h.set_engine_loaded(1.0)
    status, body, _ = get(port, "/readyz")
    assert status == 503
    assert "no redis check configured" in json.loads(body)["reasons"][0]


def test_readyz_503_while_draining_and_lists_every_reason(served: tuple[WorkerHealth, int]) -> None:
    h, port = served
    make_ready(h)
    assert get(port, "/readyz")[0] == 200
    h.mark_draining()
    status, body, _ = get(port, "/readyz")
    assert status == 503
    assert json.loads(body)["reasons"] == ["draining"]
    # draining does not touch liveness
    assert get(port, "/healthz")[0] == 200


def test_redis_check_result_is_cached(served: tuple[WorkerHealth, int], monkeypatch: pytest.MonkeyPatch) -> None:
    h, port = served
    calls: list[int] = []

    def check() -> bool:
        calls.append(1)
        return True

    h.set_engine_loaded(1.0)
    h.set_redis_check(check)
    for _ in range(5):
        assert get(port, "/readyz")[0] == 200
    assert len(calls) == 1
    monkeypatch.setattr(health_mod, "REDIS_CHECK_CACHE_S", 0.0)
    assert get(port, "/readyz")[0] == 200
    assert len(calls) == 2


def test_redis_recovery_is_seen_after_the_cache_expires(
    served: tuple[WorkerHealth, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    h, port = served
    monkeypatch.setattr(health_mod, "REDIS_CHECK_CACHE_S", 0.05)
    up = threading.Event()
    h.set_engine_loaded(1.0)
    h.set_redis_check(up.is_set)
    assert get(port, "/readyz")[0] == 503
    up.set()
    time.sleep(0.1)
    assert get(port, "/readyz")[0] == 200


# ---------------------------------------------------------------------------- liveness


def test_healthz_200_while_starting_and_while_beating(served: tuple[WorkerHealth, int]) -> None:
    h, port = served
    status, body, _ = get(port, "/healthz")
    assert status == 200 and json.loads(body)["status"] == "starting"
    h.beat()
    status, body, _ = get(port, "/healthz")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_healthz_503_after_liveness_timeout() -> None:
    h = WorkerHealth(worker_name=WORKER, model=MODEL, liveness_timeout_s=0.05)
    try:
        port = h.serve(host="127.0.0.1", port=0)
        h.beat()
        assert get(port, "/healthz")[0] == 200
        time.sleep(0.15)
        status, body, _ = get(port, "/healthz")
        assert status == 503
        doc = json.loads(body)
        assert doc["status"] == "stalled" and doc["last_beat_age_s"] > 0.05
        h.beat()  # the loop recovers
        assert get(port, "/healthz")[0] == 200
    finally:
        h.shutdown()


def test_engine_loaded_counts_as_a_beat() -> None:
    h = WorkerHealth(worker_name=WORKER, model=MODEL, liveness_timeout_s=0.05)
    try:
        port = h.serve(host="127.0.0.1", port=0)
        h.set_engine_loaded(300.0)
        assert get(port, "/healthz")[0] == 200
        time.sleep(0.15)
        assert get(port, "/healthz")[0] == 503
    finally:
        h.shutdown()


def test_liveness_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="liveness_timeout_s"):
        WorkerHealth(worker_name=WORKER, model=MODEL, liveness_timeout_s=0)


# ---------------------------------------------------------------------------- metrics


def test_metrics_counters_after_request_finished(served: tuple[WorkerHealth, int]) -> None:
    h, port = served
    h.request_finished(status="completed", input_tokens=10, output_tokens=20, ttft_s=0.2, latency_s=3.0)
    h.request_finished(status="completed", input_tokens=5, output_tokens=7, ttft_s=None, latency_s=None)
    h.request_finished(status="failed", input_tokens=3, output_tokens=0, ttft_s=None, latency_s=0.1)
    h.request_finished(status="cancelled", input_tokens=1, output_tokens=2, ttft_s=0.3, latency_s=0.4)

    assert value(port, "lmdq_requests_completed_total") == 2
    assert value(port, "lmdq_requests_failed_total", status="failed") == 1
    assert value(port, "lmdq_requests_failed_total", status="cancelled") == 1
    assert value(port, "lmdq_tokens_input_total") == 19
    assert value(port, "lmdq_tokens_output_total") == 29
    assert value(port, "lmdq_time_to_first_token_seconds_count") == 2
    assert value(port, "lmdq_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value(port, "lmdq_request_latency_seconds_count") == 3
    assert value(port, "lmdq_request_latency_seconds_bucket", le="5.0") == 3
    assert value(port, "lmdq_request_latency_seconds_bucket", le="1.0") == 2


def test_status_enum_is_accepted(served: tuple[WorkerHealth, int]) -> None:
    from lmdq.contract import ResultStatus

    h, port = served
    h.request_finished(status=ResultStatus.completed, input_tokens=1, output_tokens=1, ttft_s=None, latency_s=None)
    h.request_finished(status=ResultStatus.expired, input_tokens=0, output_tokens=0, ttft_s=None, latency_s=None)
    assert value(port, "lmdq_requests_completed_total") == 1
    assert value(port, "lmdq_requests_failed_total", status="expired") == 1


def test_metrics_gauges(served: tuple[WorkerHealth, int]) -> None:
    h, port = served
    h.set_in_flight(requests=96, jobs=3)
    make_ready(h)

    assert value(port, "lmdq_requests_in_flight") == 96
    assert value(port, "lmdq_jobs_in_flight") == 3
    assert value(port, "lmdq_engine_load_seconds") == 12.5
    assert value(port, "lmdq_worker_ready") == 1
    assert value(port, "lmdq_worker_draining") == 0
    h.mark_draining()
    assert value(port, "lmdq_worker_ready") == 0
    assert value(port, "lmdq_worker_draining") == 1


def test_workers_do_not_export_queue_depth(served: tuple[WorkerHealth, int]) -> None:
    """Queue depth is lmdq.metrics.exporter's, once per Redis: from every worker it summed N times over."""
    _h, port = served
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert "lmdq_queue_depth" not in text


def test_instances_have_separate_registries() -> None:
    a = WorkerHealth(worker_name="a", model=MODEL)
    b = WorkerHealth(worker_name="b", model=MODEL)
    a.request_finished(status="completed", input_tokens=1, output_tokens=1, ttft_s=None, latency_s=None)
    assert b'worker="a"' in a.metrics_text()
    assert b'worker="a"' not in b.metrics_text()
    assert b"lmdq_requests_completed_total" in b.metrics_text()


# ---------------------------------------------------------------------------- server


def test_unknown_path_404_and_head(served: tuple[WorkerHealth, int]) -> None:
    _, port = served
    assert get(port, "/nope")[0] == 404
    status, body, headers = get(port, "/healthz", method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0


def test_serve_twice_refused_and_shutdown_idempotent(served: tuple[WorkerHealth, int]) -> None:
    h, port = served
    with pytest.raises(RuntimeError, match="already serving"):
        h.serve(host="127.0.0.1", port=0)
    h.shutdown()
    h.shutdown()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)


def test_serves_concurrent_probes(served: tuple[WorkerHealth, int]) -> None:
    h, port = served
    make_ready(h)
    results: list[int] = []

    def probe() -> None:
        results.append(get(port, "/readyz")[0])

    threads = [threading.Thread(target=probe) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert results == [200] * 16
