"""lmdq.jobs.queue' budget counters and server-clock leases, and lmdq.registry.store, against a real Redis.

Issue 13: only a charged re-queue spends an attempt; runs and engine crashes are counted apart, in
the same atomic step as the release; lease times are the Redis server's clock."""

from __future__ import annotations

import time

import redis

from lmdq.contract import Batch, BatchStatus, RequestCounts
from lmdq.jobs.queue import Charge, JobQueue
from lmdq.redis.keys import Keys, queue_name
from lmdq.registry.store import WorkerRegistry
from lmdq.results.store import ResultStore
from tests.helpers import commit_staged, stage_jobs


def _queue(client: redis.Redis, prefix: str, bid: str = "b", n_jobs: int = 1) -> tuple[JobQueue, list[str]]:
    jq = JobQueue(client, keys=Keys(prefix))
    ResultStore(client, keys=Keys(prefix)).batches.create(
        Batch(id=bid, model="sim", status=BatchStatus.queued, batch_size=1,
              request_counts=RequestCounts(total=n_jobs), created_at=time.time()))
    q = queue_name("sim", "normal", prefix)
    stage_jobs(client, jq, bid, q, n_jobs)
    commit_staged(client, Keys(prefix), bid, "sim", n_jobs, n_jobs)
    return jq, [q]


def test_only_charged_requeues_spend_attempts_runs_and_crashes_counted_apart(client: redis.Redis,
                                                                               prefix: str) -> None:
    jq, qs = _queue(client, prefix)
    c = jq.claim(qs, model="sim", worker="w", lease_s=30)
    assert c is not None and (c.run, c.attempt, c.crashes, c.killer) == (1, 1, 0, None)
    assert jq.requeue(c, worker="w")  # a drain: free
    c = jq.claim(qs, model="sim", worker="w", lease_s=30)
    assert c is not None and (c.run, c.attempt) == (2, 1)
    assert jq.requeue(c, worker="w", charge=Charge.attempt)  # the engine failed it: one attempt
    c = jq.claim(qs, model="sim", worker="w", lease_s=30)
    assert c is not None and (c.run, c.attempt, c.charges) == (3, 2, 1)
    assert jq.requeue(c, worker="w", charge=Charge.crash, killer=0)  # the engine died with it alone
    c = jq.claim(qs, model="sim", worker="w", lease_s=30)
    assert c is not None and (c.run, c.attempt, c.crashes, c.killer) == (4, 2, 1, 0)
    assert not jq.requeue(c, worker="someone-else", charge=Charge.attempt)  # fenced: nothing counted
    assert jq.finish(c, worker="w")
    k = Keys(prefix)
    assert client.hlen(k.runs()) == client.hlen(k.attempts()) == client.hlen(k.crashes()) == 0  # done: dropped


def test_untrusted_counters_read_back_as_zero(client: redis.Redis, prefix: str) -> None:
    jq, qs = _queue(client, prefix)
    k = Keys(prefix)
    job_id = client.lindex(f"rq:queue:{qs[0]}", 0).decode()  # type: ignore[union-attr]
    client.hset(k.attempts(), job_id, "lots")
    client.hset(k.crashes(), mapping={job_id: "-3", f"{job_id}:killer": "x"})
    c = jq.claim(qs, model="sim", worker="w", lease_s=30)
    assert c is not None and (c.charges, c.crashes, c.killer) == (0, 0, None)


def test_leases_are_on_the_server_clock(client: redis.Redis, prefix: str) -> None:
    jq, qs = _queue(client, prefix, n_jobs=2)
    sec, usec = client.time()
    now = sec + usec / 1e6
    c = jq.claim(qs, model="sim", worker="w", lease_s=30)
    assert c is not None
    score = client.zscore(Keys(prefix).leases(), c.job_id)
    assert score is not None and now + 29 < score < now + 31
    short = jq.claim(qs, model="sim", worker="w", lease_s=0.05)
    assert short is not None
    time.sleep(0.2)
    assert jq.reap() == [(short.job_id, "w")]  # expired by the server's clock, whatever ours says
    start = jq.begin(c, batch_id="b", indices=[0], worker="w", ttl_s=60)
    assert start.status is BatchStatus.queued and not start.expired and start.finished == set()
    assert abs(start.server_now - time.time()) < 5


def test_registry_records_worker_model_and_cancellations(client: redis.Redis, prefix: str) -> None:
    k = Keys(prefix)
    reg = WorkerRegistry(client, keys=k, name="w1", model="m", ttl_s=5)
    reg.register(pid=123)
    rec = client.hgetall(k.worker("w1"))
    assert rec[b"model"] == b"m" and rec[b"pid"] == b"123" and 0 < client.ttl(k.worker("w1")) <= 6
    assert client.sismember(k.workers(), "w1") and client.hexists(k.models(), "m")
    before = float(rec[b"last_heartbeat"])
    time.sleep(0.01)
    reg.beat()
    assert float(client.hget(k.worker("w1"), "last_heartbeat")) > before  # type: ignore[arg-type]
    client.sadd(k.cancelled(), "b1", "b2")
    assert reg.cancelled_batches() == {"b1", "b2"} and reg.ping()
    reg.deregister()
    assert not client.exists(k.worker("w1")) and not client.sismember(k.workers(), "w1")
    assert client.hexists(k.models(), "m")  # the model stays known
