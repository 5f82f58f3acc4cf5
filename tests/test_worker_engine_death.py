"""Engine death (issue 13): a dead engine ends the worker process, never its requests.

The worker stops claiming at once, re-queues what it holds WITHOUT charging an attempt, fails
``/healthz`` and ``/readyz``, and exits with EXIT_ENGINE_DEAD (70) so its supervisor starts a fresh
one. A poison prompt (one that kills every engine it reaches) is isolated: after a job has been in
the engine at two deaths it runs alone, one request at a time, and the request that kills the
engine then ends ``failed`` with ``engine_crash`` while its neighbours complete.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis

from lmdq.contract import BatchStatus, ResultStatus
from lmdq.redis.keys import Keys, queue_name, rq_queue_key
from lmdq.results.store import ResultStore
from tests.conftest import start_worker
from tests.faultkit import SIM, assert_exactly_once, events, no_traceback, owners, submit, wait_for
from tests.helpers import wait_batch, write_jsonl


def _get(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_sim_engine_kill_fails_every_stream_with_engine_dead() -> None:
    from lmdq.worker.engines.base import EngineDead, EngineRequest
    from lmdq.worker.engines.sim import SimEngine

    eng = SimEngine(model_name="sim", step_ms=5)
    try:
        abort = threading.Event()
        reqs = [EngineRequest(index=i, prompt=f"p{i}") for i in range(3)]
        first = eng.stream(reqs, abort)
        next(first)  # running
        assert eng.alive()
        eng.kill()
        with pytest.raises(EngineDead, match="killed from outside"):
            list(first)
        assert not eng.alive()
        with pytest.raises(EngineDead):
            list(eng.stream(reqs, abort))
        poisoned = SimEngine(model_name="sim", step_ms=5)
        with pytest.raises(EngineDead, match="poison prompt"):
            list(poisoned.stream([EngineRequest(index=0, prompt="fine"),
                                  EngineRequest(index=1, prompt=f"x {SimEngine.poison_marker}")], abort))
        assert not poisoned.alive()
        poisoned.close()
    finally:
        eng.close()


def test_engine_killed_mid_batch_worker_exits_70_requeues_uncharged_health_fails(
        tmp_path: Path, env: dict[str, str], redis_url: str, client: redis.Redis, prefix: str) -> None:
    """In-process worker with its health endpoint; the sim engine is killed while jobs stream. With
    max_attempts=1, one charged attempt would fail the re-run: every request must still complete."""
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.health import WorkerHealth
    from lmdq.worker.outcomes import EXIT_ENGINE_DEAD
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    n = 60
    ids = [f"r{i}" for i in range(n)]
    bid = submit(write_jsonl(tmp_path / "p.jsonl", [{"custom_id": c, "prompt": f"p {c}"} for c in ids]), env,
                 "--batch-size", "6", "--max-new-tokens", "40")["id"]
    eng = SimEngine(model_name="sim", step_ms=10, max_batch=16)
    health = WorkerHealth(worker_name="dying", model="sim")
    port = health.serve("127.0.0.1", 0)
    health.set_redis_check(lambda: True)
    health.set_engine_loaded(0.1)
    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, heartbeat_ttl_s=2, health_port=0, max_attempts=1,
                       worker_name="dying")
    w = Worker(engine=eng, client=client, settings=s, health=health, capacity=16)
    codes: list[int] = []
    th = threading.Thread(target=lambda: codes.append(w.run()), daemon=True)
    th.start()
    store = ResultStore(client, keys=Keys(prefix))
    try:
        wait_for(lambda: store.batches.get(bid).request_counts.done >= 6 and owners(client, prefix), 60,
                 "results and held jobs")
        assert _get(f"http://127.0.0.1:{port}/healthz")[0] == 200
        assert _get(f"http://127.0.0.1:{port}/readyz")[0] == 200
        held = len(owners(client, prefix))
        done_before = store.batches.get(bid).request_counts.done
        t = time.monotonic()
        eng.kill()
        th.join(60)
        assert not th.is_alive(), "the worker did not exit after its engine died"
        elapsed = time.monotonic() - t
        assert codes == [EXIT_ENGINE_DEAD] and elapsed < 45
        code, body = _get(f"http://127.0.0.1:{port}/healthz")
        assert code == 503 and body["status"] == "engine dead", body
        code, body = _get(f"http://127.0.0.1:{port}/readyz")
        assert code == 503 and any("engine dead" in str(r) for r in body["reasons"]), body  # type: ignore[union-attr]
    finally:
        w.stop()
        th.join(30)
        health.shutdown()
    k = Keys(prefix)
    assert client.zcard(k.leases()) == 0 and w.stats["requeued"] >= 1  # the held jobs were given back ...
    queued = client.llen(rq_queue_key(queue_name("sim", "normal", prefix)))
    assert queued >= w.stats["requeued"]  # ... to the queue (nothing ran them since)
    assert client.hlen(k.attempts()) == 0, "an engine death charged an attempt"
    assert client.hlen(k.crashes()) > 0  # the jobs in the engine have the death on record
    assert store.batches.get(bid).request_counts.failed == 0
    # the supervisor's fresh worker (fresh engine) completes everything exactly once
    s2 = WorkerSettings(redis_url=redis_url, key_prefix=prefix, heartbeat_ttl_s=2, health_port=0, max_attempts=1,
                        burst=True)
    assert Worker(engine=SimEngine(model_name="sim", step_ms=1), client=client, settings=s2).run() == 0
    b = wait_batch(client, prefix, bid, timeout=30)
    assert b.status is BatchStatus.completed and b.request_counts.completed == n
    res = assert_exactly_once(client, prefix, bid, ids)
    assert all(r.status is ResultStatus.completed and r.attempt == 1 for r in res)
    assert client.hlen(k.crashes()) == 0 and client.hlen(k.runs()) == 0  # counters go with the done jobs
    print(f"\n[engine-death] {done_before}/{n} done at the kill; held {held} jobs; exit 70 after "
          f"{elapsed:.1f}s; fresh worker completed the rest, all attempt 1")


def test_poison_prompt_fails_alone_with_engine_crash_neighbours_complete(
        tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str,
        procs: list[subprocess.Popen[bytes]]) -> None:
    """A prompt that kills every engine it reaches, in a batch of 24 (jobs of 4). The test plays the
    supervisor: it restarts the worker after each exit. Two deaths with the job in a full engine, a
    third with the poison request alone in it; then that request fails and the batch completes."""
    n, poison = 24, 9
    rows = [{"custom_id": f"r{i}", "prompt": f"p{i}" + (" [[sim:poison]]" if i == poison else "")} for i in range(n)]
    bid = submit(write_jsonl(tmp_path / "p.jsonl", rows), env, "--batch-size", "4", "--max-new-tokens", "20")["id"]
    wargs = (*SIM, "--sim-step-ms", "5", "--sim-max-batch", "64", "--heartbeat-ttl", "2", "--max-attempts", "1",
             "--burst")
    store = ResultStore(client, keys=Keys(prefix))
    codes: list[int] = []
    logs: list[Path] = []
    for i in range(6):  # the bound: a crash-looping fleet would need more
        logs.append(tmp_path / f"w{i}.log")
        w = start_worker(*wargs, "--worker-name", f"w{i}", env=env, log=logs[-1])
        procs.append(w)
        codes.append(w.wait(120))
        if store.batches.get(bid).status.terminal:
            break
    assert codes == [70, 70, 70, 0], codes
    b = wait_batch(client, prefix, bid, timeout=10)
    assert b.status is BatchStatus.completed
    assert (b.request_counts.completed, b.request_counts.failed) == (n - 1, 1)
    res = {r.custom_id: r for r in assert_exactly_once(client, prefix, bid, [f"r{i}" for i in range(n)])}
    bad = res[f"r{poison}"]
    assert bad.status is ResultStatus.failed and bad.error is not None and bad.error.code == "engine_crash"
    assert all(r.status is ResultStatus.completed for c, r in res.items() if c != f"r{poison}")
    assert all(r.attempt == 1 for r in res.values())  # three engine deaths charged nothing
    for lg, code in zip(logs, codes):
        died = [e for e in events(lg) if str(e.get("event", "")).startswith("engine died:")]
        if code == 70:
            assert len(died) == 1 and died[0]["event"].endswith("exiting so the supervisor restarts the worker")
        else:
            assert not died
        no_traceback(lg)
    isolated = [e for lg in logs for e in events(lg)
                if e.get("event") == "request killed the engine while running alone: failing it"]
    assert [e["index"] for e in isolated] == [poison]
    print(f"\n[poison] worker exits {codes}; r{poison} failed engine_crash, {n - 1} neighbours completed")


def test_engine_failing_every_job_at_once_without_saying_so_is_taken_for_dead(
        tmp_path: Path, env: dict[str, str], redis_url: str, client: redis.Redis, prefix: str) -> None:
    """Belt and braces: an engine whose channel broke may fail every stream with a plain EngineError
    while still claiming to be alive. Every job in the engine failing within one window is a death:
    nothing is charged (max_attempts=1 would fail the re-run), the worker exits 70."""
    from lmdq.worker.engines.base import EngineError
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.outcomes import EXIT_ENGINE_DEAD
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    class SilentDeath(SimEngine):
        """Its streams fail with EngineError once broken; alive() keeps saying True."""

        broken = threading.Event()

        def stream(self, requests, abort):  # type: ignore[no-untyped-def]
            for ev in super().stream(requests, abort):
                if self.broken.is_set():
                    raise EngineError("RPC failed: connection reset by peer")
                yield ev

    n = 40
    ids = [f"r{i}" for i in range(n)]
    bid = submit(write_jsonl(tmp_path / "p.jsonl", [{"custom_id": c, "prompt": f"p {c}"} for c in ids]), env,
                 "--batch-size", "5", "--max-new-tokens", "400")["id"]
    eng = SilentDeath(model_name="sim", step_ms=5, max_batch=64)
    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, heartbeat_ttl_s=2, health_port=0, max_attempts=1)
    w = Worker(engine=eng, client=client, settings=s, capacity=64)
    codes: list[int] = []
    th = threading.Thread(target=lambda: codes.append(w.run()), daemon=True)
    th.start()
    try:
        wait_for(lambda: len(owners(client, prefix)) == 8 and eng.steps >= 70, 60, "all 8 jobs streaming")
        eng.broken.set()
        th.join(60)
        assert not th.is_alive() and codes == [EXIT_ENGINE_DEAD]
    finally:
        w.stop()
        th.join(30)
    k = Keys(prefix)
    assert client.hlen(k.attempts()) == 0, "a silent engine death charged an attempt"
    assert ResultStore(client, keys=k).batches.get(bid).request_counts.failed == 0
    s2 = WorkerSettings(redis_url=redis_url, key_prefix=prefix, heartbeat_ttl_s=2, health_port=0, max_attempts=1,
                        burst=True)
    assert Worker(engine=SimEngine(model_name="sim", step_ms=0), client=client, settings=s2,
                  capacity=64).run() == 0
    res = assert_exactly_once(client, prefix, bid, ids)
    assert all(r.status is ResultStatus.completed and r.attempt == 1 for r in res)


def test_one_job_failing_while_others_stream_is_charged_not_a_death(
        tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str) -> None:
    """The other side of the rule: an engine error for one job while the rest of the engine keeps
    working is that job's (charged), and the worker keeps running (exit 0 at the end of a burst)."""
    rows = [{"custom_id": "boom", "prompt": "[[sim:engine-error]]"}] + [
        {"custom_id": f"ok{i}", "prompt": f"p{i}"} for i in range(7)]
    bid = submit(write_jsonl(tmp_path / "p.jsonl", rows), env, "--batch-size", "1", "--max-new-tokens", "100")["id"]
    log = tmp_path / "w.log"
    w = start_worker(*SIM, "--sim-step-ms", "5", "--max-attempts", "2", "--burst", env=env, log=log)
    assert w.wait(120) == 0
    res = {r.custom_id: r for r in assert_exactly_once(client, prefix, bid, [r["custom_id"] for r in rows])}
    assert res["boom"].status is ResultStatus.failed and res["boom"].attempt == 2
    assert res["boom"].error is not None and res["boom"].error.code == "engine_error"
    assert all(r.status is ResultStatus.completed for c, r in res.items() if c != "boom")
    assert not [e for e in events(log) if str(e.get("event", "")).startswith("engine died")]
