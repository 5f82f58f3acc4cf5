"""/healthz, /readyz and /metrics of a RUNNING worker (sim engine), through real HTTP."""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import redis

from tests.conftest import free_port, run_cli, start_worker
from tests.helpers import wait_batch, write_jsonl


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_running_worker_serves_health_ready_and_metrics(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                                        prefix: str) -> None:
    port = free_port()
    w = start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "1", "--health-port",
                     str(port), "--worker-name", "w-health", env={**env, "LMDQ_HEALTH_PORT": str(port)},
                     log=tmp_path / "worker.log")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                code, body = _get(port, "/readyz")
                if code == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-2000:]
            time.sleep(0.1)
        assert _get(port, "/healthz")[0] == 200
        rows = [{"custom_id": f"r{i}", "prompt": f"p {i}"} for i in range(20)]
        rows.append({"custom_id": "bad", "prompt": "x [[sim:error]]"})
        p = run_cli("producer", "submit", str(write_jsonl(tmp_path / "p.jsonl", rows)), "--model", "sim",
                    "--max-new-tokens", "7", "--json", env=env)
        assert p.returncode == 0, p.stderr.decode()
        b = wait_batch(client, prefix, json.loads(p.stdout)["id"])
        assert b.request_counts.completed == 20 and b.request_counts.failed == 1
        time.sleep(0.2)
        code, text = _get(port, "/metrics")
        assert code == 200
        lab = {"model": "sim", "worker": "w-health"}
        assert _metric(text, "lmdq_requests_completed_total", **lab) == 20
        assert _metric(text, "lmdq_requests_failed_total", **lab) == 1
        assert _metric(text, "lmdq_tokens_output_total", **lab) == 20 * 7
        assert _metric(text, "lmdq_tokens_input_total", **lab) > 0
        assert _metric(text, "lmdq_time_to_first_token_seconds_count", **lab) == 20
        assert _metric(text, "lmdq_request_latency_seconds_count", **lab) >= 20
        assert "lmdq_queue_depth" not in text  # lmdq.metrics.exporter's, once per Redis (tests/test_exporter.py)
        assert _metric(text, "lmdq_engine_load_seconds", **lab) >= 0
        assert re.search(r"^lmdq_requests_in_flight\{", text, re.M)
        w.send_signal(signal.SIGTERM)
        assert w.wait(30) == 0
    finally:
        if w.poll() is None:
            w.kill()
