"""``LMDQ_GIL_SWITCH_INTERVAL_MS`` (issue 27): an engine that runs inside the worker's process (TurboMind)
takes the GIL for every step's callback, and waits up to the switch interval while the worker's own threads
hold it. The setting must reach the worker process's interpreter before the engine starts; a real
``lmdq-worker`` process (sim engine, burst, real redis-server) says what it set in its own log line."""

from __future__ import annotations

import json

from tests.conftest import run_cli


def test_worker_sets_the_gil_switch_interval_it_is_given(env: dict[str, str]) -> None:
    p = run_cli("lmdq.worker", "--engine", "sim", "--burst", env={**env, "LMDQ_GIL_SWITCH_INTERVAL_MS": "0.5"})
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    lines = [json.loads(ln) for ln in p.stderr.decode().splitlines() if '"gil switch interval"' in ln]
    assert [ln["ms"] for ln in lines] == [0.5], p.stderr.decode()[-2000:]  # read back from sys.getswitchinterval
    p = run_cli("lmdq.worker", "--engine", "sim", "--burst", "--gil-switch-interval-ms", "2", env=env)
    assert p.returncode == 0 and '"ms": 2.0' in p.stderr.decode(), p.stderr.decode()[-2000:]
    p = run_cli("lmdq.worker", "--engine", "sim", "--burst", env=env)  # unset: Python's own 5 ms, no line
    assert p.returncode == 0 and b"gil switch interval" not in p.stderr, p.stderr.decode()[-2000:]
    p = run_cli("lmdq.worker", "--engine", "sim", "--burst", env={**env, "LMDQ_GIL_SWITCH_INTERVAL_MS": "0"})
    assert p.returncode == 2 and b"Traceback" not in p.stderr, p.stderr.decode()[-2000:]
