"""Issue 44: a submit killed while staging never leaves a half batch behind, whoever submitted.

A progressive submit holds a staging lease (``LMDQ_STAGING_LEASE_S``, short here) while it stages. The kill
lands at a known point: SIGKILL as soon as the batch record shows jobs visible and no ``staged_at`` (the
record is polled; the test asserts the kill did land mid-staging). Then either the same submit is run again
(same idempotency key, same file) and resumes the batch, or nobody does and whoever notices first ends it
with every unstaged request ``failed`` / ``submit_interrupted``. Either way ``results`` (lmdq and OpenAI
formats, Parquet) and the API's output + error files hold exactly one line per input custom_id.

No wall-clock race decides an outcome: a re-run waits for the dead submit's lease to lapse; the interrupted
end is asserted within the documented bound (lease + the noticer's period), with slack.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import redis
from openai import OpenAI

from lmdq.contract import BatchStatus, ErrorCode, GenerationParams
from lmdq.redis.keys import BatchField, Keys, queue_name, rq_queue_key
from lmdq.submission.ledger import BatchLedger
from lmdq.submission.submit import SubmitOptions, submit_file
from lmdq_bench.api_bench import ApiProcess
from tests.conftest import ROOT, run_cli, start_worker

F = BatchField
LEASE_S = 2.0
#: docs/reliability.md's bound: the lease + a worker's watch period (half the lease) + answering the unstaged
#: requests; plus, here, the sim worker running the visible jobs and slack for a loaded 2-core machine
BOUND_S = LEASE_S * 1.5 + 10
SIM = ("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "0")


def _write(path: Path, n: int, *, openai: bool = False) -> list[str]:
    ids = [f"r{i}" for i in range(n)]
    with path.open("w") as f:
        for cid in ids:
            if openai:
                f.write(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": "sim", "max_tokens": 2,
                                             "messages": [{"role": "user", "content": cid}]}}) + "\n")
            else:
                f.write(f'{{"custom_id": "{cid}", "prompt": "p {cid}"}}\n')
    return ids


def _kill_mid_staging(proc: subprocess.Popen[bytes], client: redis.Redis, keys: Keys, idem: str,
                      min_jobs: int = 8, timeout: float = 120) -> str:
    """SIGKILL ``proc`` once the batch bound to ``idem`` shows ``min_jobs`` jobs visible and is not staged yet;
    returns the batch id. Fails (rather than passing vacuously) if staging finished before the kill."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        bid = client.get(keys.idempotency(idem))
        if bid is not None:
            vis, staged = client.hmget(keys.batch(bid.decode()), [F.visible_jobs.value, F.staged_at.value])
            if vis is not None and int(vis) >= min_jobs:
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
                assert staged is None and client.hget(keys.batch(bid.decode()), F.staged_at.value) is None, \
                    "staging finished before the kill: the test did not exercise a mid-staging kill"
                return str(bid.decode())
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else proc.returncode
        time.sleep(0.002)
    raise AssertionError("the submit never made its first jobs visible")


def _submit_proc(f: Path, env: dict[str, str], idem: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "lmdq.producer", "submit", str(f), "--model", "sim",
                             "--allow-unknown-model", "--max-new-tokens", "2", "--idempotency-key", idem],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait(client: redis.Redis, keys: Keys, bid: str, timeout: float) -> dict[bytes, bytes]:
    deadline = time.monotonic() + timeout
    while True:
        rec = client.hgetall(keys.batch(bid))
        if rec[b"status"].decode() in ("completed", "failed", "cancelled", "expired"):
            return rec
        assert time.monotonic() < deadline, f"batch {bid} not ended: {rec.get(b'status')!r}"
        time.sleep(0.05)


def audit(env: dict[str, str], bid: str, ids: list[str], tmp: Path) -> dict[str, int]:
    """``results`` of ``bid`` in every export: lmdq JSONL, OpenAI output + errors, Parquet. Each holds exactly
    one line per input custom_id, in input order. Returns the lmdq lines' statuses counted."""
    r = run_cli("lmdq.producer", "results", bid, env=env, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    recs = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["custom_id"] for x in recs] == ids
    assert [x["index"] for x in recs] == list(range(len(ids)))
    out, errs = tmp / f"{bid}.out.jsonl", tmp / f"{bid}.err.jsonl"
    r = run_cli("lmdq.producer", "results", bid, "--format", "openai", "-o", str(out), "--errors-file", str(errs),
                env=env, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    lines = [json.loads(x) for p in (out, errs) if p.exists() for x in p.read_text().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == sorted(ids)
    pqf = tmp / f"{bid}.parquet"
    r = run_cli("lmdq.producer", "results", bid, "-o", str(pqf), env=env, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    assert pq.read_table(pqf, columns=["custom_id"]).column("custom_id").to_pylist() == ids
    counts: dict[str, int] = {}
    for x in recs:
        counts[x["status"]] = counts.get(x["status"], 0) + 1
    return counts


# ------------------------------------------------------------------ lmdq-producer submit, SIGKILLed


def test_a_killed_submit_resumed_by_its_rerun_completes_all_100k(tmp_path: Path, env: dict[str, str],
                                                                 client: redis.Redis, prefix: str,
                                                                 procs: list[subprocess.Popen[bytes]]) -> None:
    """The issue's run: `submit big.jsonl --idempotency-key K1` SIGKILLed after its first jobs were visible;
    the identical command again resumes the batch (it waits for the dead submit's lease), stages exactly the
    jobs that were not visible, and once sim workers ran it `results` holds all 100,000 lines."""
    env = {**env, "LMDQ_STAGING_LEASE_S": str(LEASE_S)}
    keys = Keys(prefix)
    f = tmp_path / "big.jsonl"
    ids = _write(f, 100_000)
    proc = _submit_proc(f, env, "K1")
    procs.append(proc)
    bid = _kill_mid_staging(proc, client, keys, "K1")
    visible = int(client.hget(keys.batch(bid), F.visible_jobs.value) or 0)
    num_jobs = json.loads(client.hget(keys.batch(bid), F.meta.value) or b"{}")["num_jobs"]
    assert 0 < visible < num_jobs

    t0 = time.monotonic()
    r = run_cli("lmdq.producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--max-new-tokens",
                "2", "--idempotency-key", "K1", env=env, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().split()[-1] == bid
    print(f"\nkilled at {visible}/{num_jobs} jobs visible; the re-run resumed it in {time.monotonic() - t0:.1f} s")
    rec = client.hgetall(keys.batch(bid))
    assert rec.get(F.staged_at.value.encode()) and int(rec[F.visible_jobs.value.encode()]) == num_jobs
    assert F.staging_failed.value.encode() not in rec
    # every job exactly once: in the job list and on the queue (no worker ran yet)
    listed = [j.decode() for j in client.lrange(keys.batch_jobs(bid), 0, -1)]
    queued = [j.decode() for j in client.lrange(rq_queue_key(queue_name("sim", "normal", prefix)), 0, -1)]
    assert len(listed) == len(set(listed)) == num_jobs
    assert sorted(queued) == sorted(listed)
    assert not client.exists(keys.staging_lease(bid), keys.request_ids(bid))
    assert not client.sismember(keys.staging(), bid)

    procs.extend(start_worker(*SIM, "--burst", env=env) for _ in range(2))
    rec = _wait(client, keys, bid, 300)
    assert rec[b"status"] == b"completed" and int(rec[b"completed"]) == 100_000
    assert audit(env, bid, ids, tmp_path) == {"completed": 100_000}


def test_a_killed_submit_nobody_reruns_ends_by_itself_within_the_lease(
        tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str,
        procs: list[subprocess.Popen[bytes]]) -> None:
    """No re-run: a running worker's staging watch notices the lapsed lease and ends the batch. The visible
    jobs complete, every other request is answered failed / submit_interrupted, and the batch ends by itself
    within the documented bound (lease + the watch's period: half the lease), with slack for 2 cores."""
    env = {**env, "LMDQ_STAGING_LEASE_S": str(LEASE_S)}
    keys = Keys(prefix)
    f = tmp_path / "mid.jsonl"
    ids = _write(f, 20_000)
    procs.append(start_worker(*SIM, env=env))  # idle, not burst: it must be there when the lease lapses
    proc = _submit_proc(f, env, "K2")
    procs.append(proc)
    bid = _kill_mid_staging(proc, client, keys, "K2")
    killed = time.monotonic()
    rec = _wait(client, keys, bid, LEASE_S * 1.5 + 30)
    took = time.monotonic() - killed
    print(f"\nended {took:.1f} s after the kill (lease {LEASE_S} s)")
    assert took < BOUND_S, took
    visible_reqs = int(rec[F.visible_requests.value.encode()])
    assert 0 < visible_reqs < 20_000
    assert rec[b"status"] == b"completed"
    assert (int(rec[b"completed"]), int(rec[b"failed"])) == (visible_reqs, 20_000 - visible_reqs)
    assert rec[F.staging_failed.value.encode()].decode().startswith(ErrorCode.submit_interrupted.value)
    assert audit(env, bid, ids, tmp_path) == {"completed": visible_reqs, "failed": 20_000 - visible_reqs}
    r = run_cli("lmdq.producer", "results", bid, env=env)
    failed = [json.loads(x) for x in r.stdout.splitlines() if b'"failed"' in x]
    assert {x["error"]["code"] for x in failed} == {"submit_interrupted"}

    # the same submit run again now gets the ended batch back: nothing is adopted as whole or staged again
    r = run_cli("lmdq.producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--max-new-tokens",
                "2", "--idempotency-key", "K2", env=env)
    assert r.returncode == 0 and r.stdout.decode().split()[-1] == bid
    assert client.hget(keys.batch(bid), b"status") == b"completed"


def test_status_of_a_killed_submit_ends_it_and_cancel_answers_every_line(
        tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str,
        procs: list[subprocess.Popen[bytes]]) -> None:
    """The issue's second half, with no worker at all: after the lease lapsed, `status` ends the batch (the
    unstaged requests fail as submit_interrupted), then `cancel` cancels the visible, queued ones: `results`
    has one line per input, never only the visible jobs' lines."""
    env = {**env, "LMDQ_STAGING_LEASE_S": str(LEASE_S)}
    keys = Keys(prefix)
    f = tmp_path / "mid.jsonl"
    ids = _write(f, 20_000)
    proc = _submit_proc(f, env, "K3")
    procs.append(proc)
    bid = _kill_mid_staging(proc, client, keys, "K3")
    while client.exists(keys.staging_lease(bid)):  # the dead submit's lease lapses (bounded: LEASE_S)
        time.sleep(0.05)
    r = run_cli("lmdq.producer", "status", bid, "--json", env=env)
    assert r.returncode == 0, r.stderr.decode()
    vis = int(client.hget(keys.batch(bid), F.visible_requests.value) or 0)
    assert int(client.hget(keys.batch(bid), b"failed") or 0) == 20_000 - vis
    r = run_cli("lmdq.producer", "cancel", bid, env=env)
    assert r.returncode == 0, r.stderr.decode()
    rec = _wait(client, keys, bid, 30)
    assert rec[b"status"] == b"cancelled"
    assert audit(env, bid, ids, tmp_path) == {"cancelled": vis, "failed": 20_000 - vis}


# ------------------------------------------------------------------ every end state: one line per request


def _opts(**kw: object) -> SubmitOptions:
    return SubmitOptions(model="sim", batch_size=10, allow_unknown_model=True, prefix_groups=False,
                         params=GenerationParams(max_new_tokens=2), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("end", ["completed", "cancelled", "cancelled_mid_staging", "failed_mid_staging",
                                 "expired", "interrupted"])
def test_every_end_state_answers_every_request_once(end: str, tmp_path: Path, env: dict[str, str],
                                                    client: redis.Redis, prefix: str) -> None:
    """ids == inputs in lmdq JSONL, OpenAI output + errors and Parquet, whatever ended the batch."""
    keys = Keys(prefix)
    f = tmp_path / "in.jsonl"
    ids = _write(f, 2_000)
    ledger = BatchLedger(client, keys=keys, ttl_s=600, staging_lease_s=LEASE_S)
    hook: Callable[[], None] | None = None

    def current() -> str:
        return next(b.decode() for b in client.zrange(keys.batches(), 0, -1))

    if end == "cancelled_mid_staging":
        def hook() -> None:
            ledger.cancel(current())
    elif end == "failed_mid_staging":
        def hook() -> None:
            with f.open("a") as fh:  # the file changes under the submit: it abandons the batch (cancelled)
                fh.write('{"custom_id": "late", "prompt": "x"}\n')
    elif end == "interrupted":
        def hook() -> None:  # the submitter stalls past its lease: it is as good as dead (its next commit is refused)
            client.delete(keys.staging_lease(current()))

    try:
        batch, _ = submit_file(f, _opts(first_jobs=8, after_first_commit=hook, staging_lease_s=LEASE_S),
                               client=client, keys=keys, ttl_s=600, chunk_jobs=20)
        bid = batch.id
    except Exception:
        bid = current()
    worker_env = {**env, "LMDQ_STAGING_LEASE_S": str(LEASE_S)}
    if end == "interrupted":
        assert ledger.notice_interrupted() == [bid]  # whoever notices first: here, this call
    if end in ("completed", "interrupted"):
        assert start_worker(*SIM, "--burst", env=worker_env).wait(120) == 0
    elif end == "cancelled":
        ledger.cancel(bid)
    elif end == "expired":
        sec, usec = client.time()
        client.hset(keys.batch(bid), F.expires_at.value, sec + usec / 1e6 - 1.0)
        assert start_worker(*SIM, "--burst", env=worker_env).wait(120) == 0
    rec = _wait(client, keys, bid, 120)
    want = {"completed": BatchStatus.completed, "cancelled": BatchStatus.cancelled,
            "cancelled_mid_staging": BatchStatus.cancelled, "failed_mid_staging": BatchStatus.cancelled,
            "expired": BatchStatus.expired, "interrupted": BatchStatus.completed}[end]
    assert rec[b"status"].decode() == want.value
    counts = audit(env, bid, ids, tmp_path)
    assert sum(counts.values()) == len(ids)
    if end == "interrupted":
        assert counts["failed"] == 2_000 - int(rec[F.visible_requests.value.encode()])


# ------------------------------------------------------------------ lmdq-api, SIGKILLed while staging

API_KEYS = {"alice": f"alice-key-{uuid.uuid4().hex}"}


def test_a_killed_api_resumes_its_submission_on_restart_and_writes_every_line(
        tmp_path: Path, redis_url: str, client: redis.Redis, env: dict[str, str],
        procs: list[subprocess.Popen[bytes]]) -> None:
    """lmdq-api SIGKILLed while it stages a 100,000-line batch (first jobs visible): restarted, its retry of
    the submission resumes the half-staged batch (never adopting it as whole), sim workers run it, and the
    output file holds all 100,000 custom_ids, each once, with no error file."""
    prefix = f"apik{uuid.uuid4().hex[:8]}"
    keys = Keys(prefix)
    short = {"LMDQ_STAGING_LEASE_S": str(LEASE_S), "LMDQ_API_SUBMIT_LEASE_S": "2", "LMDQ_KNOWN_MODELS": '["sim"]'}
    files = tmp_path / "files"
    api = ApiProcess(redis_url=redis_url, prefix=prefix, keys=API_KEYS, files_dir=files, log=tmp_path / "api.log",
                     env=short).start()
    try:
        c = OpenAI(base_url=api.url + "/v1", api_key=API_KEYS["alice"])
        f = tmp_path / "big.jsonl"
        ids = _write(f, 100_000, openai=True)
        with f.open("rb") as fh:
            up = c.files.create(file=("big.jsonl", fh), purpose="batch")
        b = c.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert api.proc is not None
        bid = _kill_mid_staging(api.proc, client, keys, f"api-{b.id}")
    finally:
        api.stop()
    assert int(client.hget(keys.batch(bid), F.visible_requests.value) or 0) < 100_000
    api2 = ApiProcess(redis_url=redis_url, prefix=prefix, keys=API_KEYS, files_dir=files, log=tmp_path / "api2.log",
                      env=short).start()
    try:
        c = OpenAI(base_url=api2.url + "/v1", api_key=API_KEYS["alice"])
        deadline = time.monotonic() + 180
        while client.hget(keys.batch(bid), F.staged_at.value) is None:  # the retry resumes it
            assert time.monotonic() < deadline, api2.log.read_text()[-3000:]
            assert client.hget(keys.batch(bid), F.staging_failed.value) is None, "ended instead of resumed"
            time.sleep(0.1)
        wenv = {**env, "LMDQ_KEY_PREFIX": prefix}
        procs.extend(start_worker(*SIM, "--burst", env=wenv) for _ in range(2))
        deadline = time.monotonic() + 300
        got = c.batches.retrieve(b.id)
        while got.status not in ("completed", "failed", "expired", "cancelled") or (
                got.status == "completed" and not got.output_file_id):
            assert time.monotonic() < deadline, got
            time.sleep(0.5)
            got = c.batches.retrieve(b.id)
        assert got.status == "completed" and got.error_file_id is None, got
        assert got.request_counts is not None and got.request_counts.completed == 100_000
        out = [json.loads(x) for x in c.files.content(got.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in out) == sorted(ids)
    finally:
        api2.stop()
    assert os.path.isdir(files)


def test_a_killed_api_nobody_restarts_in_time_ends_and_its_files_hold_every_line(
        tmp_path: Path, redis_url: str, client: redis.Redis, env: dict[str, str],
        procs: list[subprocess.Popen[bytes]]) -> None:
    """lmdq-api SIGKILLed while staging, and not back within the lease: a running worker ends the batch
    (unstaged requests failed / submit_interrupted) by itself within the bound. When the API comes back, its
    retry gets the ended batch (never adopting it as whole, never staging it again) and writes the output and
    error files: together they hold every custom_id once."""
    prefix = f"apii{uuid.uuid4().hex[:8]}"
    keys = Keys(prefix)
    short = {"LMDQ_STAGING_LEASE_S": str(LEASE_S), "LMDQ_API_SUBMIT_LEASE_S": "2", "LMDQ_KNOWN_MODELS": '["sim"]'}
    files = tmp_path / "files"
    n = 20_000
    procs.append(start_worker(*SIM, env={**env, "LMDQ_KEY_PREFIX": prefix, "LMDQ_STAGING_LEASE_S": str(LEASE_S)}))
    api = ApiProcess(redis_url=redis_url, prefix=prefix, keys=API_KEYS, files_dir=files, log=tmp_path / "api.log",
                     env=short).start()
    try:
        c = OpenAI(base_url=api.url + "/v1", api_key=API_KEYS["alice"])
        f = tmp_path / "mid.jsonl"
        ids = _write(f, n, openai=True)
        with f.open("rb") as fh:
            up = c.files.create(file=("mid.jsonl", fh), purpose="batch")
        b = c.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert api.proc is not None
        bid = _kill_mid_staging(api.proc, client, keys, f"api-{b.id}")
    finally:
        api.stop()
    killed = time.monotonic()
    rec = _wait(client, keys, bid, LEASE_S * 1.5 + 30)
    took = time.monotonic() - killed
    print(f"\nended {took:.1f} s after the kill (lease {LEASE_S} s), no API running")
    assert took < BOUND_S, took
    vis = int(rec[F.visible_requests.value.encode()])
    assert rec[b"status"] == b"completed" and (int(rec[b"completed"]), int(rec[b"failed"])) == (vis, n - vis)
    api2 = ApiProcess(redis_url=redis_url, prefix=prefix, keys=API_KEYS, files_dir=files, log=tmp_path / "api2.log",
                      env=short).start()
    try:
        c = OpenAI(base_url=api2.url + "/v1", api_key=API_KEYS["alice"])
        deadline = time.monotonic() + 120
        got = c.batches.retrieve(b.id)
        while got.status != "completed" or not got.output_file_id or not got.error_file_id:
            assert time.monotonic() < deadline, got
            time.sleep(0.3)
            got = c.batches.retrieve(b.id)
        out = [json.loads(x) for x in c.files.content(got.output_file_id).text.splitlines()]
        errs = [json.loads(x) for x in c.files.content(got.error_file_id).text.splitlines()]
        assert (len(out), len(errs)) == (vis, n - vis)
        assert sorted(x["custom_id"] for x in out + errs) == sorted(ids)
        assert {x["error"]["code"] for x in errs} == {"submit_interrupted"}
    finally:
        api2.stop()
    assert client.zcard(keys.batches()) == 1  # the retry enqueued nothing new
