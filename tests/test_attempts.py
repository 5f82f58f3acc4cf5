"""What a request's ``max_attempts`` is spent on (issue 13): engine errors for the job's requests, and
nothing else. Also the ``retry`` command and the completion window, the other ways a request ends
without a completion."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import redis

from lmdq.contract import BatchStatus, ResultStatus
from lmdq.redis.keys import BatchField, Keys, queue_name
from lmdq.results.store import ResultStore
from tests.conftest import run_cli, start_worker
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


def test_engine_errors_retried_up_to_max_attempts_request_errors_not(tmp_path: Path, env: dict[str, str],
                                                                     client: redis.Redis, prefix: str) -> None:
    rows = [
        {"custom_id": "engine-boom", "prompt": "[[sim:engine-error]]"},
        {"custom_id": "same-job-as-boom", "prompt": "innocent bystander"},
        {"custom_id": "request-error", "prompt": "x [[sim:error]]"},
        {"custom_id": "ok", "prompt": "fine"},
    ]
    bid = submit(write_jsonl(tmp_path / "p.jsonl", rows), env, "--batch-size", "2", "--max-new-tokens", "4")["id"]
    log = tmp_path / "w.log"
    w = start_worker(*SIM, "--sim-step-ms", "1", "--max-attempts", "3", "--burst", env=env, log=log)
    assert w.wait(60) == 0
    b = wait_batch(client, prefix, bid)
    assert b.status is BatchStatus.completed
    assert (b.request_counts.completed, b.request_counts.failed) == (1, 3)
    res = {r.custom_id: r for r in results_of(client, prefix, bid)}
    for cid in ("engine-boom", "same-job-as-boom"):  # the whole call failed: retried, then failed
        r = res[cid]
        assert r.status is ResultStatus.failed and r.attempt == 3 and r.finish_reason is not None
        assert r.error is not None and r.error.code == "engine_error" and "simulated engine failure" in r.error.message
    bad = res["request-error"]  # a per-request error is an answer, not retried
    assert bad.status is ResultStatus.failed and bad.attempt == 1
    assert bad.error is not None and bad.error.code == "internal_error"
    assert res["ok"].status is ResultStatus.completed and res["ok"].attempt == 1
    retried = [e for e in events(log) if e.get("event") == "engine error; job will be retried"]
    assert [e["attempt"] for e in retried] == [1, 2, 3]
    from rq.registry import FailedJobRegistry

    assert FailedJobRegistry(queue_name("sim", "normal", prefix), connection=client).get_job_ids() == [f"{bid}-000000"]


def test_retry_command_resubmits_failed_requests_as_new_batch(tmp_path: Path, env: dict[str, str],
                                                              client: redis.Redis, prefix: str) -> None:
    """First worker's context is too small for one prompt; `retry` sends the failures to a bigger one."""
    rows = [{"custom_id": f"ok-{i}", "prompt": f"short {i}"} for i in range(5)]
    rows.insert(2, {"custom_id": "too-long", "prompt": " ".join(["w"] * 100), "params": {"max_new_tokens": 3}})
    rows.append({"custom_id": "always-bad", "messages": [{"role": "user", "content": "[[sim:error]]"}]})
    orig = submit(write_jsonl(tmp_path / "p.jsonl", rows), env, "--batch-size", "3", "--max-new-tokens", "5",
                   "--metadata", "team=eval", "--priority", "high")
    bid = orig["id"]
    # not ended yet: nothing to retry
    early = run_cli("producer", "retry", bid, env=env)
    assert early.returncode == 1 and "is queued; retry it once it has ended" in early.stderr.decode()
    start_worker(*SIM, "--sim-step-ms", "1", "--session-len", "64", "--burst", env=env).wait(60)
    b = wait_batch(client, prefix, bid)
    assert (b.request_counts.completed, b.request_counts.failed) == (5, 2)

    p = run_cli("producer", "retry", bid, "--json", env=env)
    assert p.returncode == 0, p.stderr.decode()
    new = json.loads(p.stdout)
    assert new["created"] is True and new["id"] != bid and new["status"] == "queued"
    assert new["metadata"] == {"team": "eval", "retry_of": bid}
    assert new["request_counts"]["total"] == 2 and new["priority"] == "high"
    assert new["params"]["max_new_tokens"] == 5
    start_worker(*SIM, "--sim-step-ms", "1", "--burst", env=env).wait(60)
    nb = wait_batch(client, prefix, new["id"])
    assert (nb.request_counts.completed, nb.request_counts.failed) == (1, 1)
    res = {r.custom_id: r for r in results_of(client, prefix, new["id"])}
    assert [r.custom_id for r in results_of(client, prefix, new["id"])] == ["too-long", "always-bad"]
    assert res["too-long"].status is ResultStatus.completed and res["too-long"].generate_token_len == 3
    assert res["always-bad"].error is not None and res["always-bad"].error.code == "internal_error"
    # the original batch is untouched
    assert ResultStore(client, keys=Keys(prefix)).batches.get(bid).request_counts == b.request_counts
    # the retry of the retry has one request left; a batch with nothing failed says so clearly
    again = [json.loads(run_cli("producer", "retry", new["id"], "--json", "--idempotency-key", "r2", env=env).stdout)
             for _ in range(2)]
    assert again[0]["request_counts"]["total"] == 1 and again[0]["id"] == again[1]["id"]
    assert again[0]["created"] is True and again[1]["created"] is False
    ok_only = submit(write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "fine"}]), env)["id"]
    start_worker(*SIM, "--sim-step-ms", "1", "--burst", env=env).wait(60)
    nothing = run_cli("producer", "retry", ok_only, env=env)
    err = nothing.stderr.decode()
    assert nothing.returncode == 1 and "has no failed requests to retry" in err and "Traceback" not in err


def test_completion_window_expires_requests_not_started(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                                         prefix: str) -> None:
    ids = [f"r{i}" for i in range(10)]
    f = write_jsonl(tmp_path / "p.jsonl", [{"custom_id": c, "prompt": c} for c in ids])
    sub = submit(f, env, "--completion-window", "1h", "--batch-size", "4")
    assert sub["completion_window_s"] == 3600.0 and sub["expires_at"] == pytest.approx(sub["created_at"] + 3600.0)
    # The window passes with no worker: its deadline is put one second behind the Redis server's clock,
    # which is the clock the worker judges expiry by (no sleeping, no race with the wall clock; issue 13).
    sec, usec = client.time()
    client.hset(Keys(prefix).batch(sub["id"]), BatchField.expires_at.value, sec + usec / 1e6 - 1.0)
    assert start_worker(*SIM, "--sim-step-ms", "1", "--burst", env=env).wait(60) == 0
    b = wait_batch(client, prefix, sub["id"])
    assert b.status is BatchStatus.expired and b.expired_at is not None
    assert b.request_counts.expired == 10 and b.request_counts.done == 10 and b.request_counts.completed == 0
    res = assert_exactly_once(client, prefix, sub["id"], ids)
    assert all(r.status is ResultStatus.expired and r.error is not None and r.error.code == "expired" for r in res)
    # expired requests can be resubmitted
    p = run_cli("producer", "retry", sub["id"], "--include-expired", "--json", env=env)
    assert p.returncode == 0, p.stderr.decode()
    new = json.loads(p.stdout)
    assert new["request_counts"]["total"] == 10 and new["completion_window_s"] == 3600.0
    assert start_worker(*SIM, "--sim-step-ms", "1", "--burst", env=env).wait(60) == 0
    nb = wait_batch(client, prefix, new["id"])
    assert nb.status is BatchStatus.completed and nb.request_counts.completed == 10


def test_four_sigterm_drains_of_a_busy_worker_fail_nothing(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                                           prefix: str, procs: list[subprocess.Popen[bytes]]) -> None:
    """Issue 13: three SIGTERM drains used to fail requests (`max_attempts_exceeded`, attempt 4 of 3).
    A drain charges nothing: the same jobs interrupted four times (default max_attempts 3) still
    complete, each request exactly once, with attempt 1."""
    n = 48
    ids = [f"r{i}" for i in range(n)]
    bid = submit(write_jsonl(tmp_path / "p.jsonl", [{"custom_id": c, "prompt": f"p {c}"} for c in ids]), env,
                 "--batch-size", "8", "--max-new-tokens", "300")["id"]
    # 300 tokens at >= 5 ms a step: no request can finish within the 0.3 s drain
    wargs = (*SIM, "--sim-step-ms", "5", "--sim-max-batch", "64", "--drain-timeout", "0.3", "--heartbeat-ttl", "2")
    k = Keys(prefix)
    first_job = f"{bid}-000000"
    for d in range(4):
        log = tmp_path / f"d{d}.log"
        w = start_worker(*wargs, "--worker-name", f"d{d}", env=env, log=log)
        procs.append(w)
        wait_for(lambda d=d: owners(client, prefix).get(first_job) == f"d{d}", 60, f"d{d} to hold the first job")
        w.send_signal(signal.SIGTERM)
        assert w.wait(30) == 0
        assert stopped_stats(log)["requeued"] >= 1
        no_traceback(log)
    assert client.hget(k.runs(), first_job) == b"4"  # the same job, interrupted four times ...
    assert client.hlen(k.attempts()) == 0  # ... and charged nothing
    assert ResultStore(client, keys=k).batches.get(bid).request_counts.failed == 0
    assert start_worker(*SIM, "--sim-step-ms", "1", "--sim-max-batch", "64", "--burst", env=env).wait(120) == 0
    b = wait_batch(client, prefix, bid)
    assert b.status is BatchStatus.completed and (b.request_counts.completed, b.request_counts.failed) == (n, 0)
    res = assert_exactly_once(client, prefix, bid, ids)
    assert all(r.status is ResultStatus.completed and r.attempt == 1 for r in res)
