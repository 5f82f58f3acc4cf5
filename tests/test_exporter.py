"""The queue exporter (lmdq.exporter) as deployed: its own process, a real redis-server, real HTTP
scrapes parsed as Prometheus text. Queue depth exists once per Redis, also with no worker running."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import redis
from prometheus_client.parser import text_string_to_metric_families

from lmdq.jobs import JobQueue
from lmdq.keys import Keys, queue_names
from lmdq.registry import WorkerRegistry
from tests.conftest import ROOT, RedisServer, free_port, run_cli
from tests.helpers import write_jsonl

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def start_exporter(env: dict[str, str], port: int, log: Path, *args: str) -> subprocess.Popen[bytes]:
    out = open(log, "wb")  # noqa: SIM115 - closed with the process
    p = subprocess.Popen([sys.executable, "-m", "lmdq.producer", "exporter", "--port", str(port),
                          "--host", "127.0.0.1", *args], env=env, stdout=out, stderr=out, cwd=ROOT)
    deadline = time.monotonic() + 30
    while True:
        try:
            scrape(port)
            return p
        except OSError:
            assert p.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)


def _submit(tmp_path: Path, env: dict[str, str], n: int, *args: str) -> str:
    f = write_jsonl(tmp_path / f"p{n}{'-'.join(args)}.jsonl", [{"prompt": f"p{i}"} for i in range(n)])
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--batch-size", "1",
                "--json", *args, env=env)
    assert p.returncode == 0, p.stderr.decode()
    return str(json.loads(p.stdout)["id"])


def test_exporter_serves_queue_depth_running_and_workers_once(tmp_path: Path, env: dict[str, str],
                                                              client: redis.Redis, prefix: str,
                                                              procs: list[subprocess.Popen[bytes]]) -> None:
    port = free_port()
    exp = start_exporter(env, port, tmp_path / "exporter.log")
    procs.append(exp)
    m = scrape(port)
    assert m[("lmdq_exporter_redis_up", ())] == 1
    assert not any(name == "lmdq_queue_depth" for name, _ in m)  # nothing submitted: no model yet

    _submit(tmp_path, env, 5)
    _submit(tmp_path, env, 2, "--priority", "high")
    m = scrape(port)  # no worker has ever run: the backlog is visible at zero replicas
    depth = {dict(lab)["priority"]: v for (name, lab), v in m.items()
             if name == "lmdq_queue_depth" and dict(lab)["model"] == "sim"}
    assert depth == {"high": 2, "normal": 5, "low": 0}
    assert m[("lmdq_jobs_running", (("model", "sim"),))] == 0
    assert m[("lmdq_workers", (("model", "sim"),))] == 0
    assert m[("lmdq_batches", (("status", "queued"),))] == 2

    # a worker's records, written by the registry workers use, and one claimed job
    k = Keys(prefix)
    reg = WorkerRegistry(client, keys=k, name=f"{prefix}-w", model="sim", ttl_s=30)
    reg.register(pid=1)
    claimed = JobQueue(client, keys=k).claim_many(queue_names("sim", prefix), model="sim", worker=reg.name,
                                                  lease_s=30, n=1)
    assert len(claimed) == 1
    m = scrape(port)
    assert m[("lmdq_workers", (("model", "sim"),))] == 1
    assert m[("lmdq_jobs_running", (("model", "sim"),))] == 1
    assert m[("lmdq_queue_depth", (("model", "sim"), ("priority", "high")))] == 1  # high drains first
    # one series per (model, priority): sum by (model) is the backlog, counted once
    assert sum(v for (name, lab), v in m.items() if name == "lmdq_queue_depth") == 6
    reg.deregister()
    assert scrape(port)[("lmdq_workers", (("model", "sim"),))] == 0

    exp.send_signal(signal.SIGTERM)
    assert exp.wait(30) == 0
    logs = [json.loads(x) for x in (tmp_path / "exporter.log").read_text().splitlines() if x.strip()]
    assert {"exporter.serving", "exporter.stopped"} <= {x["event"] for x in logs}


def test_exporter_outlives_redis_and_says_so(tmp_path: Path, env: dict[str, str],
                                             procs: list[subprocess.Popen[bytes]]) -> None:
    srv = RedisServer().start()
    try:
        port = free_port()
        exp = start_exporter({**env, "LMDQ_REDIS_URL": srv.url, "LMDQ_REDIS_SOCKET_TIMEOUT_S": "2"}, port,
                             tmp_path / "exporter.log")
        procs.append(exp)
        assert scrape(port)[("lmdq_exporter_redis_up", ())] == 1
        srv.stop(kill=True)
        m = scrape(port)  # an answer, not an HTTP error: Prometheus records redis_up 0
        assert m[("lmdq_exporter_redis_up", ())] == 0
        assert not any(name == "lmdq_queue_depth" for name, _ in m)
        assert exp.poll() is None
        srv.start()
        assert scrape(port)[("lmdq_exporter_redis_up", ())] == 1
    finally:
        srv.cleanup()
