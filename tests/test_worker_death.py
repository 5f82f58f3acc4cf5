"""Worker death (issue 5): a worker SIGKILLed or frozen mid-job loses nothing and duplicates nothing.

Real processes (producer CLI, sim workers, redis-server), checked from the outside by reading what
landed in Redis. A dead worker's jobs run again after one heartbeat TTL, uncharged (issue 13)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import redis

from lmdq.contract import BatchStatus, ResultStatus
from lmdq.redis.keys import Keys
from lmdq.results.store import ResultStore
from tests.conftest import start_worker
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
from tests.helpers import wait_batch, write_jsonl


def test_sigkill_worker_three_times_nothing_lost_nothing_duplicated(tmp_path: Path, env: dict[str, str],
                                                                    client: redis.Redis, prefix: str,
                                                                    procs: list[subprocess.Popen[bytes]]) -> None:
    """2 workers, 2000 requests; one worker SIGKILLed 3 times mid-job and restarted. The workers run
    with the default max_attempts (3): worker deaths charge nothing, so three kills cannot fail a job."""
    seed = int(os.environ.get("LMDQ_FAULT_SEED", str(time.time_ns() % 100_000)))
    rng = random.Random(seed)
    n = 2000
    ids = [f"req-{i:04d}" for i in range(n)]
    f = write_jsonl(tmp_path / "p.jsonl", [{"custom_id": c, "prompt": f"question {c}"} for c in ids])
    t0 = time.monotonic()
    bid = submit(f, env, "--max-new-tokens", "20")["id"]
    wargs = (*SIM, "--sim-step-ms", "20", "--sim-max-batch", "32", "--heartbeat-ttl", "2")
    logs: list[Path] = []

    def launch(name: str) -> subprocess.Popen[bytes]:
        logs.append(tmp_path / f"{name}.log")
        procs.append(start_worker(*wargs, "--worker-name", name, env=env, log=logs[-1]))
        return procs[-1]

    survivor = launch("B")
    victim = launch("A0")
    store = ResultStore(client, keys=Keys(prefix))
    windows = [(0.05, 0.25), (0.30, 0.50), (0.55, 0.75)]
    killed_holding = []
    for k, (lo, hi) in enumerate(windows):
        at = int(rng.uniform(lo, hi) * n)
        name = f"A{k}"
        wait_for(lambda at=at: store.batches.get(bid).request_counts.done >= at, 60, f"{at} results")
        wait_for(lambda name=name: name in owners(client, prefix).values(), 30, f"{name} to hold a job")
        time.sleep(rng.uniform(0.0, 0.4))
        holding = sorted(j for j, w in owners(client, prefix).items() if w == name)
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(10) == -signal.SIGKILL
        killed_holding.append(len(holding))
        victim = launch(f"A{k + 1}")
    b = wait_batch(client, prefix, bid, timeout=120)
    elapsed = time.monotonic() - t0
    for w in (survivor, victim):
        w.send_signal(signal.SIGTERM)
    assert survivor.wait(30) == 0 and victim.wait(30) == 0
    assert b.status is BatchStatus.completed and b.request_counts.completed == n

    res = assert_exactly_once(client, prefix, bid, ids)
    assert all(r.status is ResultStatus.completed for r in res)
    reaped = [e for lg in logs for e in events(lg) if e.get("event") == "re-queued job of a dead worker"]
    # A re-run is a request of a reaped job whose result came from a later run (another worker). Issue 13:
    # results no longer count runs as attempts, so re-runs are found from the reaped jobs, not `attempt`.
    batch_size = ResultStore(client, keys=Keys(prefix)).batches.get(bid).batch_size
    reaped_jobs = {e["job"] for e in reaped}
    dead = {f"A{k}" for k in range(3)}
    reruns = [r for r in res if f"{bid}-{r.index // batch_size:06d}" in reaped_jobs and r.worker not in dead]
    assert all(r.attempt == 1 for r in res), "a worker death charged an attempt"
    # Graceful exits report their counters: a finished request that ran again would be a duplicate.
    dups = sum(stopped_stats(lg)["duplicates"] for lg in (logs[0], logs[-1]))
    assert dups == 0, "a request that already had a final result was run again"
    assert len(reaped) >= 3 and len(reruns) > 0
    assert {e["dead_worker"] for e in reaped} <= dead
    for lg in logs:
        no_traceback(lg)
    print(
        f"\n[fault] seed={seed} requests={n} results={len(res)} missing=0 duplicated=0 "
        f"jobs_held_when_killed={killed_holding} jobs_reaped={len(reaped)} "
        f"requests_rerun={len(reruns)} max_attempt={max(r.attempt for r in res)} "
        f"store_rejected_duplicates={dups} elapsed={elapsed:.1f}s"
    )


def test_presumed_dead_worker_late_results_never_overwrite(tmp_path: Path, env: dict[str, str],
                                                           client: redis.Redis, prefix: str,
                                                           procs: list[subprocess.Popen[bytes]]) -> None:
    """A frozen worker (SIGSTOP) loses its leases; when it wakes, its late results change nothing."""
    n = 200
    ids = [f"r{i}" for i in range(n)]
    # spread lengths, so some requests are always about to finish when the worker wakes up
    rows = [{"custom_id": c, "prompt": f"p {c}", "params": {"max_new_tokens": 20 + (i * 7) % 80}}
            for i, c in enumerate(ids)]
    bid = submit(write_jsonl(tmp_path / "p.jsonl", rows), env, "--batch-size", "20")["id"]
    wargs = (*SIM, "--sim-step-ms", "20", "--sim-max-batch", "40", "--heartbeat-ttl", "2")
    la, lb = tmp_path / "a.log", tmp_path / "b.log"
    a = start_worker(*wargs, "--worker-name", "frozen", env=env, log=la)
    procs.append(a)
    wait_for(lambda: "frozen" in owners(client, prefix).values(), 30, "the first worker to hold a job")
    time.sleep(0.8)  # long enough for its shortest requests to finish
    a.send_signal(signal.SIGSTOP)
    frozen_jobs = sorted(j for j, w in owners(client, prefix).items() if w == "frozen")
    assert frozen_jobs
    try:
        b = start_worker(*wargs, "--worker-name", "alive", env=env, log=lb)
        procs.append(b)
        batch = wait_batch(client, prefix, bid, timeout=90)
        assert batch.status is BatchStatus.completed
        before = client.hgetall(Keys(prefix).results(bid))
        counts = batch.request_counts
    finally:
        a.send_signal(signal.SIGCONT)
    time.sleep(3)  # the woken worker heartbeats, learns its leases are gone, stops those jobs
    a.send_signal(signal.SIGTERM)
    b.send_signal(signal.SIGTERM)
    assert a.wait(30) == 0 and b.wait(30) == 0
    assert client.hgetall(Keys(prefix).results(bid)) == before  # nothing overwritten
    assert ResultStore(client, keys=Keys(prefix)).batches.get(bid).request_counts == counts  # nothing recounted
    res = assert_exactly_once(client, prefix, bid, ids)
    lost = [e for e in events(la) if e.get("event", "").startswith("lease lost")]
    assert {e["job"] for e in lost} <= set(frozen_jobs) and lost
    assert stopped_stats(lb)["duplicates"] == 0  # it skipped what the frozen worker had finished
    stats = stopped_stats(la)
    print(f"\n[late] frozen worker held {len(frozen_jobs)} jobs; late duplicate writes rejected: "
          f"{stats['duplicates']}; results by the frozen worker: {sum(r.worker == 'frozen' for r in res)}")
    no_traceback(la)
    no_traceback(lb)
