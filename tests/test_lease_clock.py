"""Leases on a clock that never runs backwards (issue 29): a step back of the Redis host's clock must
not keep a dead worker's jobs leased for the length of the step.

The step is simulated deterministically instead of changing the real clock: what a step back of 1 h
leaves behind is leases stamped 1 h ahead of the server's TIME and (since this fix) a lease clock
whose last reading is 1 h ahead. Both are written as the lease scripts would have written them an
hour "earlier"; then only elapsed server time may decide when the leases expire.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import redis

from lmdq.contract import Batch, BatchStatus, RequestCounts
from lmdq.jobs.queue import JobQueue
from lmdq.redis.keys import Keys, queue_name
from lmdq.results.store import ResultStore
from tests.conftest import start_worker
from tests.faultkit import SIM, assert_exactly_once, events, owners, submit, wait_for
from tests.helpers import commit_staged, stage_jobs, wait_batch, write_jsonl

STEP_S = 3600.0


def _server_now(client: redis.Redis) -> float:
    sec, usec = client.time()
    return float(sec) + float(usec) / 1e6


def step_clock_back(client: redis.Redis, keys: Keys, step_s: float = STEP_S) -> None:
    """Make the Redis state what a step back of ``step_s`` of the server's clock leaves: every lease
    (and the lease clock's last reading) ``step_s`` ahead of TIME now."""
    leases = {m.decode(): s for m, s in client.zrange(keys.leases(), 0, -1, withscores=True)}
    assert leases, "nothing leased: the step would test nothing"
    with client.pipeline() as p:
        p.zadd(keys.leases(), {m: s + step_s for m, s in leases.items()})
        p.hset(f"{keys.leases()}:clock", mapping={"raw": _server_now(client) + step_s, "offset": 0})
        p.execute()


def _queue(client: redis.Redis, prefix: str, n_jobs: int) -> tuple[JobQueue, list[str]]:
    k = Keys(prefix)
    jq = JobQueue(client, keys=k)
    ResultStore(client, keys=k).batches.create(Batch(id="b", model="sim", status=BatchStatus.queued, batch_size=1,
                                                   request_counts=RequestCounts(total=n_jobs), created_at=time.time()))
    q = queue_name("sim", "normal", prefix)
    stage_jobs(client, jq, "b", q, n_jobs)
    commit_staged(client, k, "b", "sim", n_jobs, n_jobs)
    return jq, [q]


def test_dead_workers_lease_expires_by_elapsed_time_after_the_clock_steps_back_1h(client: redis.Redis,
                                                                                   prefix: str) -> None:
    """The scripts alone: a 1 s lease of a dead worker, then the clock steps back an hour. The reaper
    gets it after about a second of elapsed server time; a live worker's 30 s lease, extended after
    the step, is not reaped; the lease clock never ran backwards."""
    k = Keys(prefix)
    jq, qs = _queue(client, prefix, n_jobs=2)
    dead = jq.claim(qs, model="sim", worker="dead", lease_s=1.0)
    alive = jq.claim(qs, model="sim", worker="alive", lease_s=30.0)
    assert dead is not None and alive is not None
    step_clock_back(client, k)
    assert jq.heartbeat([alive], worker="alive", lease_s=30.0) == []  # the live one extends after the step
    reaped: list[tuple[str, str]] = []

    def reap() -> bool:
        reaped.extend(jq.reap())
        return bool(reaped)

    # bd9ca4b: the lease is an hour ahead of TIME, so this waits an hour (times out here)
    wait_for(reap, 30, "the dead worker's lease to be reaped", interval=0.1)
    assert reaped == [(dead.job_id, "dead")]
    score = client.zscore(k.leases(), alive.job_id)
    assert score is not None
    clock = client.hgetall(f"{k.leases()}:clock")
    assert float(clock[b"offset"]) >= STEP_S - 1  # the step was seen and absorbed
    lease_now = float(clock[b"raw"]) + float(clock[b"offset"])
    assert lease_now < score <= lease_now + 30  # extended on the lease clock, not an hour further


def test_dead_workers_jobs_rerun_promptly_after_a_1h_clock_step_back(tmp_path: Path, env: dict[str, str],
                                                                    client: redis.Redis, prefix: str,
                                                                    procs: list[subprocess.Popen[bytes]]) -> None:
    """Issue 29: a dead worker's 4 jobs sat unreaped for 3,558 s after the Redis host's clock jumped back
    1 h. A worker holding 4 jobs is SIGKILLed, the clock steps back 1 h, a second worker starts: it
    reaps them after one heartbeat TTL of elapsed time and the batch completes, exactly once."""
    n = 8
    ids = [f"r{i}" for i in range(n)]
    bid = submit(write_jsonl(tmp_path / "p.jsonl", [{"custom_id": c, "prompt": f"p {c}"} for c in ids]), env,
                 "--batch-size", "1", "--max-new-tokens", "400")["id"]
    hold = (*SIM, "--sim-step-ms", "1000", "--jobs-in-flight", "4", "--heartbeat-ttl", "2")
    a = start_worker(*hold, "--worker-name", "doomed", env=env, log=tmp_path / "a.log")
    procs.append(a)
    wait_for(lambda: list(owners(client, prefix).values()).count("doomed") == 4, 60, "the worker to hold 4 jobs")
    a.send_signal(signal.SIGKILL)
    a.wait(10)
    step_clock_back(client, Keys(prefix))
    lb = tmp_path / "b.log"
    b = start_worker(*SIM, "--sim-step-ms", "1", "--heartbeat-ttl", "2", "--worker-name", "alive", env=env, log=lb)
    procs.append(b)
    batch = wait_batch(client, prefix, bid, timeout=60)  # bd9ca4b: 4 of 8 for an hour
    b.send_signal(signal.SIGTERM)
    assert b.wait(30) == 0
    assert batch.status is BatchStatus.completed and batch.request_counts.completed == n
    assert_exactly_once(client, prefix, bid, ids)
    requeued = [e for e in events(lb) if e.get("event") == "re-queued job of a dead worker"]
    assert {e["dead_worker"] for e in requeued} == {"doomed"} and len(requeued) == 4
