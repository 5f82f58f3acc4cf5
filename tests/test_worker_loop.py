"""The worker loop (lmdq.worker.runner): held jobs, polling, graceful drain, heartbeats and leases."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis

from lmdq.contract import BatchStatus, ResultStatus
from lmdq.redis.keys import BatchField, Keys, queue_name, rq_queue_key
from tests.conftest import ROOT, start_worker
from tests.faultkit import (
    SIM,
    assert_exactly_once,
    events,
    no_traceback,
    owners,
    stopped_stats,
    submit,
    wait_for,
)
from tests.helpers import results_of, wait_batch, write_jsonl


def test_ending_attempt_never_hides_the_reclaimed_attempt_of_the_same_job(tmp_path: Path, env: dict[str, str],
                                                                          redis_url: str, client: redis.Redis,
                                                                          prefix: str) -> None:
    """A re-queued job can be re-claimed by the same worker before the old attempt's thread has
    cleaned up; that cleanup must not drop the NEW attempt from the held set (it would then get no
    heartbeat, and burst exit / drain would not wait for it: seen as 'sim engine is closed')."""
    from lmdq.worker.attempt import Held
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    submit(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}]), env, "--max-new-tokens", "2")
    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, heartbeat_ttl_s=2, health_port=0)
    w = Worker(engine=SimEngine(model_name="sim", step_ms=1), client=client, settings=s)
    claim = w.jobs.claim(w.queues, model="sim", worker=w.name, lease_s=30)
    assert claim is not None
    old, new = Held(claim=claim), Held(claim=claim)
    w._held[claim.job_id] = new  # the loop re-claimed the job while `old` was still finishing
    w._run_job(old)
    assert w._held.get(claim.job_id) is new
    w.engine.close()


def test_busy_worker_polls_the_queue_slowly_idle_worker_sleeps_until_woken(tmp_path: Path, env: dict[str, str],
                                                                          redis_url: str, client: redis.Redis,
                                                                          prefix: str) -> None:
    """Claims cost Python time that LMDeploy's in-process scheduler competes for: while the worker
    holds a job, an empty queue is polled every busy_poll_interval_s (a finished job wakes it
    anyway); while idle, the worker blocks on its model's wake list (tests/test_idle.py) and the
    submit's token wakes it at once, so it does not poll at all."""
    import threading

    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, health_port=0, poll_interval_s=0.02,
                       busy_poll_interval_s=0.5, idle_wait_s=60)
    w = Worker(engine=SimEngine(model_name="sim", step_ms=10), client=client, settings=s)
    calls: list[float] = []
    claim_fair = w.jobs.claim_fair  # the worker's claim for its model (the fair share judged in the same call)

    def counted(*a: Any, **kw: Any) -> Any:
        calls.append(time.monotonic())
        return claim_fair(*a, **kw)

    w.jobs.claim_fair = counted  # type: ignore[method-assign]
    th = threading.Thread(target=w.run, daemon=True)
    th.start()
    try:
        time.sleep(0.6)
        idle_calls = len(calls)
        # one job of ~4 s (400 tokens at 10 ms a step)
        bid = submit(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "long"}]), env, "--max-new-tokens", "400")["id"]
        deadline = time.monotonic() + 30
        while not w._held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w._held, "the job was never claimed"
        t0, n0 = time.monotonic(), len(calls)
        time.sleep(2.0)
        assert w._held, "the job ended before the busy window closed"
        busy = len(calls) - n0
        busy_s = time.monotonic() - t0
        assert idle_calls <= 2, f"idle worker claimed {idle_calls} times in 0.6 s (it should block)"
        assert w.idle is not None and w.idle.tokens >= 1  # woken by the submit, not by its 60 s timeout
        assert busy <= busy_s / 0.5 + 2, f"busy worker polled {busy} times in {busy_s:.1f} s (busy interval 0.5 s)"
        assert wait_batch(client, prefix, bid, timeout=20).status is BatchStatus.completed
    finally:
        w.stop()
        th.join(30)


def test_sigterm_drain_finishes_held_jobs_and_exits_zero(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                                          prefix: str, procs: list[subprocess.Popen[bytes]]) -> None:
    """Drain timeout long enough: the held job finishes (attempt 1), the queued one stays queued."""
    rows = [{"custom_id": f"r{i}", "prompt": f"p{i}"} for i in range(8)]
    bid = submit(write_jsonl(tmp_path / "p.jsonl", rows), env, "--max-new-tokens", "150", "--batch-size", "4")["id"]
    log = tmp_path / "w.log"
    w = start_worker(*SIM, "--sim-step-ms", "10", "--jobs-in-flight", "1", "--drain-timeout", "30",
                     env=env, log=log)
    procs.append(w)
    wait_for(lambda: bool(owners(client, prefix)), 20, "the worker to hold a job")
    time.sleep(0.3)
    t = time.monotonic()
    w.send_signal(signal.SIGTERM)
    assert w.wait(30) == 0
    assert time.monotonic() - t < 10  # it left as soon as its job was done, not at the drain timeout
    res = results_of(client, prefix, bid)
    assert sorted(r.custom_id for r in res) == ["r0", "r1", "r2", "r3"]
    assert all(r.status is ResultStatus.completed and r.attempt == 1 and r.generate_token_len == 150 for r in res)
    q = [x.decode() for x in client.lrange(rq_queue_key(queue_name("sim", "normal", prefix)), 0, -1)]
    assert q == [f"{bid}-000001"]  # never claimed: still queued, for the next worker
    assert client.zcard(Keys(prefix).leases()) == 0
    assert stopped_stats(log)["requeued"] == 0
    no_traceback(log)


# A worker process whose clock is off: time.time() shifted by OFFSET seconds for the whole process
# (lmdq, RQ, redis-py alike), the system clock untouched.
_SKEWED = """
import runpy, sys, time
_real = time.time
time.time = lambda: _real() + {offset}
sys.argv = ["worker", *sys.argv[1:]]
runpy.run_module("worker", run_name="__main__", alter_sys=True)
"""


def _skewed_worker(offset: float, *args: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-c", _SKEWED.format(offset=offset), *args], env=env, stdout=out,
                            stderr=out, cwd=ROOT)


def test_workers_60s_behind_and_ahead_fail_nothing_leases_and_expiry_on_server_clock(
        tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str,
        procs: list[subprocess.Popen[bytes]]) -> None:
    """Issue 13: with leases on each worker's clock, a worker 60 s behind leased jobs that had already
    expired for everyone else, and one 60 s ahead reaped live leases (32 of 5 runs' requests failed).
    Leases, reaping and the completion window now use the Redis server's TIME."""
    k = Keys(prefix)
    # Expiry: a batch whose window closed a second ago by the server's clock. The worker 60 s behind
    # would think it still open by its own clock; it must expire the requests.
    late = submit(write_jsonl(tmp_path / "late.jsonl", [{"custom_id": f"l{i}", "prompt": "x"} for i in range(4)]),
                  env, "--completion-window", "1h")["id"]
    sec, usec = client.time()
    client.hset(k.batch(late), BatchField.expires_at.value, sec + usec / 1e6 - 1.0)
    behind_log = tmp_path / "behind-burst.log"
    w = _skewed_worker(-60, *SIM, "--sim-step-ms", "1", "--burst", env=env, log=behind_log)
    procs.append(w)
    assert w.wait(60) == 0
    lb = wait_batch(client, prefix, late)
    assert lb.status is BatchStatus.expired and lb.request_counts.expired == 4
    # Leases: two workers, one 60 s behind and one 60 s ahead, share a batch (heartbeat TTL 2 s).
    n = 200
    ids = [f"r{i}" for i in range(n)]
    bid = submit(write_jsonl(tmp_path / "p.jsonl", [{"custom_id": c, "prompt": f"p {c}"} for c in ids]), env,
                 "--batch-size", "10", "--max-new-tokens", "200")["id"]
    wargs = (*SIM, "--sim-step-ms", "10", "--sim-max-batch", "40", "--jobs-in-flight", "4", "--heartbeat-ttl", "2")
    logs = {"behind": tmp_path / "behind.log", "ahead": tmp_path / "ahead.log"}
    workers = {name: _skewed_worker(-60 if name == "behind" else 60, *wargs, "--worker-name", name, env=env,
                                    log=logs[name]) for name in logs}
    procs.extend(workers.values())
    b = wait_batch(client, prefix, bid, timeout=120)
    for w in workers.values():
        w.send_signal(signal.SIGTERM)
    assert all(w.wait(30) == 0 for w in workers.values())
    assert b.status is BatchStatus.completed and (b.request_counts.completed, b.request_counts.failed) == (n, 0)
    res = assert_exactly_once(client, prefix, bid, ids)
    assert all(r.attempt == 1 for r in res)
    assert {r.worker for r in res} == {"behind", "ahead"}  # both held leases all along
    for name, lg in logs.items():
        evs = events(lg)
        assert not [e for e in evs if e.get("event") in ("re-queued job of a dead worker",
                                                          "lease lost (presumed dead); stopping job")], name
        assert stopped_stats(lg)["duplicates"] == 0
        no_traceback(lg)


def test_job_finishing_between_heartbeat_snapshot_and_script_is_not_a_lost_lease(
        tmp_path: Path, env: dict[str, str], redis_url: str, client: redis.Redis, prefix: str) -> None:
    """Issue 17: 'lease lost (presumed dead)' was logged for a job that had simply finished (its thread
    released the lease between the heartbeat's snapshot of held jobs and the heartbeat script). Only a
    job still running whose lease is gone is lost; that one is still stopped and logged."""
    from structlog.testing import capture_logs

    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.outcomes import AbortReason, AttemptEnd, Outcome
    from lmdq.worker.runner import Held, Worker
    from lmdq.worker.settings import WorkerSettings

    submit(write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(2)]), env, "--batch-size", "1")
    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, heartbeat_ttl_s=2, health_port=0)
    with capture_logs() as logs:
        w = Worker(engine=SimEngine(model_name="sim", step_ms=1), client=client, settings=s)
        finishing, running = w.jobs.claim_many(w.queues, model="sim", worker=w.name, lease_s=30, n=2)
        finishing.job = w.jobs.fetch_job(finishing.job_id)
        h_fin, h_run = Held(claim=finishing), Held(claim=running)
        w._held.update({finishing.job_id: h_fin, running.job_id: h_run})
        real = w.jobs.heartbeat

        def racing(claims: Any, **kw: Any) -> list[str]:
            snapshot = list(claims)  # taken while both jobs were held
            w._release(h_fin, AttemptEnd(Outcome.done), w.log)  # ... then the first one finishes
            client.hdel(Keys(prefix).lease_owner(), running.job_id)  # ... and the other's lease is reaped
            return real(snapshot, **kw)

        w.jobs.heartbeat = racing  # type: ignore[method-assign]
        w._heartbeat_once()
        w.engine.close()
    lost = [e for e in logs if e["event"] == "lease lost (presumed dead); stopping job"]
    assert [e["job"] for e in lost] == [running.job_id]
    assert not h_fin.abort.is_set() and h_fin.abort_reason is None
    assert h_run.abort.is_set() and h_run.abort_reason is AbortReason.lost
