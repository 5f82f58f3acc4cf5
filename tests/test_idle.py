"""Idle workers sleep in Redis instead of polling (lmdq.jobs.wakeup, worker.idle), and a worker's connection
pool never runs out (connect(max_connections=...)). Costs are counted on the server (INFO), never timed."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import redis

from lmdq.contract import BatchStatus
from lmdq.jobs.queue import JobQueue
from lmdq.redis.keys import Keys, queue_name, rq_queue_key
from lmdq.redis.scripts import WAKE
from tests.conftest import start_worker
from tests.faultkit import SIM, events, no_traceback, stopped_stats, submit, wait_for
from tests.helpers import ThreadWorker, wait_batch, write_jsonl

MODEL = "sim"


def _enqueue(client: redis.Redis, prefix: str, n: int, *, batch_size: int = 1, tokens: int = 4) -> str:
    """A batch of ``n`` requests, enqueued the way the producer does it (ledger commit: one Lua call)."""
    from lmdq.contract import GenerationParams
    from lmdq.testing import enqueue_requests

    return enqueue_requests(client, Keys(prefix), MODEL, [{"prompt": f"question {i}"} for i in range(n)],
                            batch_size=batch_size, params=GenerationParams(max_new_tokens=tokens))


def _blocked(client: redis.Redis) -> int:
    return int(client.info("clients")["blocked_clients"])


def _commands(client: redis.Redis) -> int:
    return int(client.info("stats")["total_commands_processed"])


# ---- the wake list: pushed wherever jobs become visible -----------------------------------------


def test_wake_key_lua_names_the_same_key_as_keys_wake(client: redis.Redis) -> None:
    """The release and reap scripts derive the wake list from a job's in-flight list on the server."""
    probe = "".join(f.source for f in WAKE.closure()) + "return lmdq_wake_key(ARGV[1]) or ''"
    for prefix in ("lmdq", "a:inflight:b", "t-1"):
        for model in ("sim", "HuggingFaceTB/SmolLM2-135M", "m:inflight:x"):
            k = Keys(prefix)
            got = client.eval(probe, 0, k.inflight(model))
            assert got.decode() == k.wake(model), (prefix, model)
    assert client.eval(probe, 0, "not-an-inflight-list") == b""  # a forged owner entry wakes nothing


def test_commit_requeue_and_reap_each_leave_one_token(client: redis.Redis, prefix: str) -> None:
    k = Keys(prefix)
    wake = k.wake(MODEL)
    _enqueue(client, prefix, 3)
    assert client.lrange(wake, 0, -1) == [b"1"]
    _enqueue(client, prefix, 2)  # a second commit does not pile up tokens nobody takes
    assert client.llen(wake) == 1
    client.delete(wake)
    jq = JobQueue(client, keys=k)
    queues = [queue_name(MODEL, p, prefix) for p in ("high", "normal", "low")]
    claims = jq.claim_many(queues, model=MODEL, worker="w1", lease_s=30, n=5)
    assert len(claims) == 5 and client.llen(wake) == 0  # a claim pushes nothing
    assert jq.release(claims[0], worker="w1", requeue=True)
    assert client.llen(wake) == 1
    client.delete(wake)
    assert jq.release(claims[1], worker="w1")  # done: no new work, no token
    assert client.llen(wake) == 0
    client.zadd(k.leases(), {c.job_id: 0 for c in claims[2:]})  # their holder "died"
    assert len(jq.reap()) == 3
    assert client.llen(wake) == 1
    assert client.llen(k.inflight(MODEL)) == 0  # nothing but job ids ever goes on the in-flight list


# ---- idle workers ---------------------------------------------------------------------------------


def _counted(client: redis.Redis) -> tuple[int, int]:
    """(BLPOP calls, every other command but this test's own INFO and CONFIG) as the server counts them
    (commands run inside a script included)."""
    stats = client.info("commandstats")
    blpop = int(stats.get("cmdstat_blpop", {}).get("calls", 0))
    others = sum(int(v["calls"]) for k, v in stats.items()
                 if k not in ("cmdstat_blpop", "cmdstat_info", "cmdstat_config"))
    return blpop, others


def test_idle_worker_costs_a_handful_of_commands(own_redis: str, prefix: str) -> None:
    """Polling cost ~79 commands/s per idle worker (20 claim scripts/s); blocking costs one BLPOP and one
    claim round per idle_wait_s. Counted by the server per block, not per second of wall clock: the
    heartbeat and staging watch are put far apart (their own periods, not idleness), then the commands
    sent over three blocks are divided by three (a loaded machine can only make blocks rarer, never
    cheaper or dearer)."""
    client = redis.Redis.from_url(own_redis)
    w = ThreadWorker(own_redis, prefix, idle_wait_s=1.0, heartbeat_ttl_s=600.0, staging_lease_s=3600.0)
    try:
        wait_for(lambda: _counted(client)[0] >= 2, 60, "the worker to end two blocks")  # start-up is over
        b0, c0 = _counted(client)
        wait_for(lambda: _counted(client)[0] >= b0 + 3, 60, "three more blocks")
        b1, c1 = _counted(client)
        per_block = (c1 - c0) / (b1 - b0)
        # one round: the claim script (3 queues, the lease set and the idle roster's count, inside Lua) and
        # the roster's mark; the sampling above can catch one extra round at either end: (3 + 1) / 3 of it at most
        assert per_block < 30, f"an idle worker sent {per_block:.1f} commands per block"
        assert w.worker._counts["jobs"] == 0
    finally:
        w.stop()


def test_job_submitted_while_blocked_is_picked_up_by_its_token(own_redis: str, prefix: str) -> None:
    client = redis.Redis.from_url(own_redis)
    w = ThreadWorker(own_redis, prefix, idle_wait_s=60.0)  # the timeout cannot be what wakes it
    try:
        wait_for(lambda: _blocked(client) == 1, 30, "the worker to block on its wake list")
        bid = _enqueue(client, prefix, 4)
        assert wait_batch(client, prefix, bid, timeout=45).status is BatchStatus.completed
        assert w.worker.idle is not None and w.worker.idle.tokens >= 1
    finally:
        w.stop()


def test_a_batch_wakes_every_idle_worker_one_after_another(own_redis: str, prefix: str) -> None:
    """One token per commit: a worker woken by it that claims a full share passes it on."""
    client = redis.Redis.from_url(own_redis)
    workers = [ThreadWorker(own_redis, prefix, step_ms=20, idle_wait_s=60.0, jobs_in_flight=2) for _ in range(3)]
    try:
        wait_for(lambda: _blocked(client) == 3, 30, "three workers to block")
        bid = _enqueue(client, prefix, 24, tokens=20)  # 24 jobs of ~0.4 s; each worker holds 2
        assert wait_batch(client, prefix, bid, timeout=45).status is BatchStatus.completed
        for r in workers:
            assert r.worker.idle is not None and r.worker.idle.tokens >= 1
            assert r.worker._counts["jobs"] > 0
    finally:
        for r in workers:
            r.stop()


def test_sigterm_while_blocked_exits_without_waiting_for_the_block(own_redis: str, prefix: str, tmp_path: Path,
                                                                   procs: list[subprocess.Popen[bytes]]) -> None:
    import os

    client = redis.Redis.from_url(own_redis)
    env = dict(os.environ, LMDQ_REDIS_URL=own_redis, LMDQ_KEY_PREFIX=prefix, LMDQ_LOG_FORMAT="json",
               LMDQ_HEALTH_PORT="0", PYTHONUNBUFFERED="1", LMDQ_IDLE_WAIT_S="60")
    log = tmp_path / "w.log"
    w = start_worker(*SIM, env=env, log=log)
    procs.append(w)
    wait_for(lambda: _blocked(client) == 1, 60, "the worker to block on its wake list")
    t = time.monotonic()
    w.send_signal(signal.SIGTERM)
    assert w.wait(30) == 0
    assert time.monotonic() - t < 20  # far less than the 60 s block
    assert stopped_stats(log)["jobs"] == 0
    no_traceback(log)
    wait_for(lambda: _blocked(client) == 0, 10, "the block to end with the process")


def test_poll_mode_still_works(redis_url: str, client: redis.Redis, prefix: str) -> None:
    """LMDQ_IDLE_WAIT_S=0: no blocking command (a Redis proxy without BLPOP); claims on poll_interval_s."""
    w = ThreadWorker(redis_url, prefix, idle_wait_s=0, poll_interval_s=0.02)
    try:
        time.sleep(0.3)
        bid = _enqueue(client, prefix, 3)
        assert wait_batch(client, prefix, bid, timeout=30).status is BatchStatus.completed
        assert w.worker.idle is None
    finally:
        w.stop()


# ---- the connection pool ----------------------------------------------------------------------------


def test_worker_holding_hundreds_of_jobs_never_runs_out_of_connections(tmp_path: Path, env: dict[str, str],
                                                                      client: redis.Redis, prefix: str,
                                                                      procs: list[subprocess.Popen[bytes]]) -> None:
    """One-request jobs on a 256-slot engine: the worker holds ~200 jobs, one thread each, whose results
    land in bursts. redis-py's default pool failed past 100 connections ("Too many connections": 6
    store episodes in this very run before the fix); the worker's blocking pool (32 + 4) makes a thread
    wait for a connection instead."""
    from lmdq.worker.settings import WorkerSettings

    n = 600
    rows = [{"custom_id": f"r{i}", "prompt": f"p{i}"} for i in range(n)]
    bid = submit(write_jsonl(tmp_path / "p.jsonl", rows), env, "--batch-size", "1", "--max-new-tokens", "128")["id"]
    log = tmp_path / "w.log"
    before = int(client.info("clients")["connected_clients"])
    # Requests of 128 steps x 25 ms (3.2 s at least): far longer than the worker needs to fill its 256
    # slots and lookahead (claims come in batches), so a loaded CI machine cannot make the first ones
    # finish before it holds 100 jobs (at 32 x 5 ms a CI run saw it peak at 97).
    w = start_worker(*SIM, "--sim-max-batch", "256", "--sim-step-ms", "25", "--burst", env=env, log=log)
    procs.append(w)
    inflight = Keys(prefix).inflight(MODEL)
    most = clients = 0
    while w.poll() is None:
        most = max(most, int(client.llen(inflight)))
        clients = max(clients, int(client.info("clients")["connected_clients"]) - before)
        time.sleep(0.05)
    assert w.returncode == 0
    assert most > 100, f"the worker held at most {most} jobs"
    assert clients <= WorkerSettings().redis_pool_size + 1, clients  # + the start-up check's probe
    b = wait_batch(client, prefix, bid, timeout=10)
    assert b.status is BatchStatus.completed and b.request_counts.completed == n
    stats = stopped_stats(log)
    assert stats["requeued"] == 0 and stats["jobs"] == n and stats["store_episodes"] == 0, stats
    text = log.read_text()
    for bad in ("Too many connections", "No connection available", "redis failed while running job"):
        assert bad not in text
    assert not [e for e in events(log) if e.get("level") in ("error", "critical")]
    assert client.llen(rq_queue_key(queue_name(MODEL, "normal", prefix))) == 0
