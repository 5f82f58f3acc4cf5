"""lmdq workers in RQ's worker registry: `rq info` and rq-dashboard (rq's ``Worker.all``) list them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import redis
from rq.worker import Worker as RqWorker

from lmdq.redis.keys import Keys, queue_names, rq_worker_key, rq_workers_by_queue_key, rq_workers_key
from lmdq.registry.store import WorkerRegistry
from tests.conftest import run_cli, start_worker
from tests.helpers import wait_batch, write_jsonl


def _rq_info(redis_url: str, *queues: str) -> str:
    p = subprocess.run([sys.executable, "-m", "rq.cli", "info", "-u", redis_url, "--only-workers", *queues],
                       capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr.decode()
    return p.stdout.decode()


def _rq_worker(client: redis.Redis, name: str) -> RqWorker | None:
    return next((w for w in RqWorker.all(connection=client) if w.name == name), None)


def test_registry_writes_an_rq_worker_record(client: redis.Redis, prefix: str) -> None:
    reg = WorkerRegistry(client, keys=Keys(prefix), name=f"{prefix}-w", model="m/x", ttl_s=5)
    reg.register(pid=4242)
    sec, _ = client.time()
    w = _rq_worker(client, reg.name)
    assert w is not None, "rq's Worker.all does not list the lmdq worker"
    assert w.queue_names() == queue_names("m/x", prefix) and w.pid == 4242
    assert w.get_state() == "idle"
    assert w.birth_date is not None and w.last_heartbeat is not None
    server_now = datetime.fromtimestamp(sec, timezone.utc).replace(tzinfo=None)
    assert abs((w.birth_date.replace(tzinfo=None) - server_now).total_seconds()) < 5  # the server's clock
    assert 0 < client.ttl(rq_worker_key(reg.name)) <= 6  # a killed worker's record expires
    q = queue_names("m/x", prefix)[0]
    assert rq_worker_key(reg.name) in {k.decode() for k in client.smembers(rq_workers_by_queue_key(q))}

    reg.beat(busy=True, done=3, failed=1)
    w = _rq_worker(client, reg.name)
    assert w is not None and w.get_state() == "busy"
    assert (w.successful_job_count, w.failed_job_count) == (3, 1)
    reg.beat()
    w = _rq_worker(client, reg.name)
    assert w is not None and w.get_state() == "idle"

    reg.deregister()
    assert _rq_worker(client, reg.name) is None
    assert not client.sismember(rq_workers_key(), rq_worker_key(reg.name))
    assert not client.sismember(rq_workers_by_queue_key(q), rq_worker_key(reg.name))


def test_utc_stamp_matches_python_across_dates(client: redis.Redis) -> None:
    """The script's own civil-date arithmetic, checked against Python for leap days and centuries."""
    from lmdq.registry.store import RQ_CLOCK

    probe = RQ_CLOCK.source.replace("redis.call('TIME')", "{ARGV[1], ARGV[2]}")
    script = client.register_script(probe + "return utc()")
    for ts in (0, 951782400, 951868799, 1709164800, 4107542399, 1767225599, 1767225600):
        got = script(args=[ts, 123456]).decode()
        want = datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.123456Z")
        assert got == want, (ts, got, want)


def test_rq_info_lists_a_running_worker_with_its_queues(tmp_path: Path, env: dict[str, str], redis_url: str,
                                                        client: redis.Redis, prefix: str) -> None:
    name = f"{prefix}-rqw"
    log = tmp_path / "worker.log"
    w = start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "50",
                     "--worker-name", name, env={**env, "LMDQ_HEARTBEAT_TTL": "3"}, log=log)
    try:
        queues = queue_names("sim", prefix)
        deadline = time.monotonic() + 60
        while _rq_worker(client, name) is None:
            assert w.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        out = _rq_info(redis_url, *queues)
        line = next((x for x in out.splitlines() if x.startswith(name)), None)
        assert line is not None, out
        for q in queues:
            assert q in line, line
        assert "1 workers" in out, out

        # busy while it holds a job (state set by the heartbeat, every TTL/3 = 1 s)
        rows = [{"custom_id": "r0", "prompt": "p"}]
        p = run_cli("producer", "submit", str(write_jsonl(tmp_path / "p.jsonl", rows)), "--model", "sim",
                    "--max-new-tokens", "100000", "--json", env=env)  # runs until cancelled below
        assert p.returncode == 0, p.stderr.decode()
        batch_id = json.loads(p.stdout)["id"]
        deadline = time.monotonic() + 60
        while (rw := _rq_worker(client, name)) is None or rw.get_state() != "busy":
            assert time.monotonic() < deadline, "worker never shown busy"
            time.sleep(0.1)
        job_id = rw.get_current_job_id()  # RQ's executions under the same worker name
        assert job_id is not None and job_id.startswith(batch_id)

        # the job ends (cancelled), so RQ's records of it end too: nothing left with a TTL behind
        assert run_cli("producer", "cancel", batch_id, env=env).returncode == 0
        wait_batch(client, prefix, batch_id)
        deadline = time.monotonic() + 60
        while client.exists(f"rq:executions:{job_id}"):
            assert time.monotonic() < deadline, "the job's RQ execution record outlived the job"
            time.sleep(0.1)
        w.send_signal(signal.SIGTERM)
        assert w.wait(60) == 0, log.read_text()[-2000:]
        assert _rq_worker(client, name) is None
        assert name not in _rq_info(redis_url, *queues)
    finally:
        if w.poll() is None:
            w.kill()
