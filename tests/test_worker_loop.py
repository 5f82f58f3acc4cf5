"""The worker loop (lmdq.worker.runner): held jobs, polling, graceful drain, heartbeats and leases."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

from lmdq.contract import BatchStatus, ResultStatus
from lmdq.keys import Keys, queue_name, rq_queue_key
from tests.conftest import start_worker
from tests.faultkit import (
    SIM,
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
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker, _Held
    from lmdq.worker.settings import WorkerSettings

    submit(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}]), env, "--max-new-tokens", "2")
    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, heartbeat_ttl_s=2, health_port=0)
    w = Worker(engine=SimEngine(model_name="sim", step_ms=1), client=client, settings=s)
    claim = w.jobs.claim(w.queues, model="sim", worker=w.name, lease_s=30)
    assert claim is not None
    old, new = _Held(claim=claim), _Held(claim=claim)
    w._held[claim.job_id] = new  # the loop re-claimed the job while `old` was still finishing
    w._run_job(old)
    assert w._held.get(claim.job_id) is new
    w.engine.close()


def test_busy_worker_polls_the_queue_slowly_idle_worker_fast(tmp_path: Path, env: dict[str, str], redis_url: str,
                                                             client: redis.Redis, prefix: str) -> None:
    """Claims cost Python time that LMDeploy's in-process scheduler competes for: while the worker
    holds a job, an empty queue is polled every busy_poll_interval_s (a finished job wakes it
    anyway); while idle, every poll_interval_s so that new work starts at once."""
    import threading

    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, health_port=0, poll_interval_s=0.02,
                       busy_poll_interval_s=0.5)
    w = Worker(engine=SimEngine(model_name="sim", step_ms=10), client=client, settings=s)
    calls: list[float] = []
    claim_many = w.jobs.claim_many

    def counted(*a: Any, **kw: Any) -> Any:
        calls.append(time.monotonic())
        return claim_many(*a, **kw)

    w.jobs.claim_many = counted  # type: ignore[method-assign]
    th = threading.Thread(target=w.run, daemon=True)
    th.start()
    try:
        time.sleep(0.6)
        idle_calls = len(calls)
        # one job of ~4 s (400 tokens at 10 ms a step)
        bid = submit(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "long"}]), env, "--max-new-tokens", "400")["id"]
        deadline = time.monotonic() + 10
        while not w._held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w._held, "the job was never claimed"
        t0, n0 = time.monotonic(), len(calls)
        time.sleep(2.0)
        assert w._held, "the job ended before the busy window closed"
        busy = len(calls) - n0
        busy_s = time.monotonic() - t0
        assert idle_calls >= 8, f"idle worker polled only {idle_calls} times in 0.6 s (poll_interval 0.02)"
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
