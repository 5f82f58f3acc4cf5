"""The queue exporter (lmdq.metrics.exporter) as deployed: its own process, a real redis-server, real HTTP
scrapes parsed as Prometheus text. Queue depth exists once per Redis, also with no worker running."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis
from prometheus_client.parser import text_string_to_metric_families

from lmdq.jobs.queue import JobQueue
from lmdq.redis.keys import Keys, queue_names
from lmdq.registry.store import WorkerRegistry
from tests.conftest import ROOT, RedisServer, free_port, run_cli
from tests.helpers import write_jsonl

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int, timeout: float = 10) -> Samples:
    """One scrape, with Prometheus' default scrape timeout (10 s)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def fresh(port: int) -> Samples:
    """A scrape whose snapshot was read after this call began (what changed in Redis before the call is
    in it): the exporter serves the collector's last read, so wait for a read that started later."""
    since = time.monotonic()
    while True:
        t1 = time.monotonic()
        m = scrape(port)
        age = m.get(("lmdq_exporter_snapshot_age_seconds", ()))
        if age is not None and m[("lmdq_exporter_redis_up", ())] == 1 and t1 - age > since:
            return m
        assert time.monotonic() - since < 60, "no fresh snapshot in 60 s"
        time.sleep(0.05)


def wait_up(port: int, want: float) -> Samples:
    """Scrape until ``lmdq_exporter_redis_up`` is ``want`` (each scrape must answer within 10 s)."""
    deadline = time.monotonic() + 60
    while True:
        m = scrape(port)
        if m[("lmdq_exporter_redis_up", ())] == want:
            return m
        assert time.monotonic() < deadline, f"redis_up never became {want}"
        time.sleep(0.05)


def start_exporter(env: dict[str, str], port: int, log: Path, *args: str,
                   interval_s: str = "0.1") -> subprocess.Popen[bytes]:
    out = open(log, "wb")  # noqa: SIM115 - closed with the process
    p = subprocess.Popen([sys.executable, "-m", "lmdq.producer", "exporter", "--port", str(port),
                          "--host", "127.0.0.1", *args], env={**env, "LMDQ_EXPORTER_INTERVAL_S": interval_s},
                         stdout=out, stderr=out, cwd=ROOT)
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
    m = fresh(port)  # no worker has ever run: the backlog is visible at zero replicas
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
    m = fresh(port)
    assert m[("lmdq_workers", (("model", "sim"),))] == 1
    assert m[("lmdq_jobs_running", (("model", "sim"),))] == 1
    assert m[("lmdq_queue_depth", (("model", "sim"), ("priority", "high")))] == 1  # high drains first
    # one series per (model, priority): sum by (model) is the backlog, counted once
    assert sum(v for (name, lab), v in m.items() if name == "lmdq_queue_depth") == 6
    reg.deregister()
    assert fresh(port)[("lmdq_workers", (("model", "sim"),))] == 0

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
        m = wait_up(port, 0)  # answers, not HTTP errors: Prometheus records redis_up 0
        assert not any(name == "lmdq_queue_depth" for name, _ in m)
        assert exp.poll() is None
        srv.start()
        wait_up(port, 1)
    finally:
        srv.cleanup()


def _commands(client: redis.Redis) -> int:
    """Commands the server has processed (this INFO call not yet counted)."""
    return int(client.info("stats")["total_commands_processed"])


def test_frozen_redis_gives_redis_up_0_within_the_scrape_timeout(tmp_path: Path, env: dict[str, str],
                                                                  procs: list[subprocess.Popen[bytes]]) -> None:
    """Issue 29: with Redis frozen every scrape blocked for a socket timeout behind the one before it,
    so 20 concurrent scrapes all missed Prometheus' 10 s timeout and ``redis_up 0`` was never seen.
    The exporter at its defaults (read every 5 s, 3 s of Redis time a read): redis-server SIGSTOPped,
    rounds of 20 concurrent scrapes with a 10 s timeout all answer, and report redis_up 0 (and the
    snapshot's age) while Redis is still frozen; after SIGCONT, redis_up 1 again."""
    srv = RedisServer().start()
    assert srv.proc is not None
    try:
        port = free_port()
        exp = start_exporter({**env, "LMDQ_REDIS_URL": srv.url}, port, tmp_path / "exporter.log", interval_s="5")
        procs.append(exp)
        assert scrape(port)[("lmdq_exporter_redis_up", ())] == 1
        srv.proc.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            seen: list[Samples] = []
            with ThreadPoolExecutor(20) as pool:
                while not any(m[("lmdq_exporter_redis_up", ())] == 0 for m in seen):
                    # bd9ca4b: these time out (each waited ~10 s in Redis, one after another)
                    seen = list(pool.map(lambda _: scrape(port, timeout=10), range(20)))
                    assert time.monotonic() - frozen_at < 60, "redis_up stayed 1 with Redis frozen"
            down = next(m for m in seen if m[("lmdq_exporter_redis_up", ())] == 0)
            assert not any(name == "lmdq_queue_depth" for name, _ in down)
            assert down[("lmdq_exporter_snapshot_age_seconds", ())] > 3  # the last good read, growing older
        finally:
            srv.proc.send_signal(signal.SIGCONT)
        wait_up(port, 1)
        assert exp.poll() is None
    finally:
        srv.cleanup()


def test_200_concurrent_scrapes_with_10000_batches_answer_without_touching_redis(
        tmp_path: Path, env: dict[str, str], procs: list[subprocess.Popen[bytes]]) -> None:
    """Issue 29: with 10,000 batches, 200 concurrent scrapes took p50 7.6 s / p95 62 s (each read Redis
    under one lock) and 15 timed out. Now one collector reads, scrapes serve its snapshot: 200
    concurrent scrapes all answer, agree, and Redis processes no command for them (counted exactly)."""
    srv = RedisServer().start()
    try:
        client = redis.Redis.from_url(srv.url)
        k = Keys(env["LMDQ_KEY_PREFIX"])
        statuses = ("completed", "in_progress", "failed", "cancelled")
        with client.pipeline(transaction=False) as p:
            for i in range(10_000):
                p.hset(k.batch(f"batch_{i:05d}"), "status", statuses[i % 4])
                p.zadd(k.batches(), {f"batch_{i:05d}": i})
            p.execute()
        port = free_port()
        # one read at start, then none for an hour: every scrape below is served from memory
        exp = start_exporter({**env, "LMDQ_REDIS_URL": srv.url}, port, tmp_path / "exporter.log", interval_s="3600")
        procs.append(exp)
        before = _commands(client)
        started = time.monotonic()
        with ThreadPoolExecutor(200) as pool:
            got = list(pool.map(lambda _: (scrape(port, timeout=10), time.monotonic() - started), range(200)))
        after = _commands(client)
        assert after - before == 1  # the first INFO: no scrape touched Redis (bd9ca4b: thousands of commands)
        took = sorted(t for _, t in got)
        print(f"200 concurrent scrapes, 10,000 batches: p50 {took[100]:.3f} s, p95 {took[190]:.3f} s, "
              f"max {took[-1]:.3f} s")
        batches = [{lab: v for (name, lab), v in m.items() if name == "lmdq_batches"} for m, _ in got]
        assert all(b == batches[0] for b in batches)
        assert sum(batches[0].values()) == 1000  # the newest LMDQ_EXPORTER_MAX_BATCHES
        assert all(m[("lmdq_exporter_redis_up", ())] == 1 and m[("lmdq_exporter_truncated", ())] == 0 for m, _ in got)
    finally:
        srv.cleanup()


def test_a_read_walks_junk_sets_within_its_scan_budget(client: redis.Redis, prefix: str) -> None:
    """A models hash of 50,000 junk names: the read takes at most SCAN_CALLS short HSCANs (no HKEYS of
    the whole hash), serves at most MAX_MODELS models and says it was cut short."""
    from lmdq.metrics.exporter import SnapshotCollector
    from lmdq.metrics.queue_stats import MAX_MODELS, SCAN_CALLS

    k = Keys(prefix)
    with client.pipeline(transaction=False) as p:
        for start in range(0, 50_000, 5000):
            p.hset(k.models(), mapping={f"junk-{i}": "1" for i in range(start, start + 5000)})
        p.execute()
    try:
        def calls(cmd: str) -> int:
            return int(client.info("commandstats").get(f"cmdstat_{cmd}", {}).get("calls", 0))

        hscan, hkeys = calls("hscan"), calls("hkeys")
        collector = SnapshotCollector(client, k, interval_s=3600, timeout_s=30)
        assert collector.collect_once()
        snap = collector.view().snapshot
        assert snap is not None and snap.truncated and len(snap.models) == MAX_MODELS
        assert 0 < calls("hscan") - hscan <= SCAN_CALLS and calls("hkeys") == hkeys
    finally:
        client.delete(k.models())
