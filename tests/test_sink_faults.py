"""Results sink faults (issue 29): a sink that hangs during a drain, a folder that fills, then recovers.

Real parts only: moto's S3 server on 127.0.0.1 behind :class:`tests.hangproxy.HangProxy` (which can be
told to hang every connection), a real redis-server, the real ``lmdq-worker`` and ``lmdq-producer``.
Every step waits on an event or on state in Redis, never on a sleep racing a threshold: the proxy
says when a PUT is stuck, Redis says when shards are sealed or writes are scheduled for retry.
"""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

pytest.importorskip("fsspec")
pytest.importorskip("s3fs")

from lmdq.contract import Batch, BatchStatus, JobPayload, RequestCounts, Result, ResultStatus  # noqa: E402
from lmdq.redis.keys import Keys  # noqa: E402
from lmdq.results.blobs import BlobStore, SinkAbandoned, SinkTimeout, bounded  # noqa: E402
from lmdq.results.sink import flush_job, pending_count  # noqa: E402
from lmdq.results.store import ResultStore  # noqa: E402
from tests.conftest import ROOT, run_cli, start_worker  # noqa: E402
from tests.hangproxy import HangProxy  # noqa: E402
from tests.helpers import moto_s3, wait_batch, write_jsonl  # noqa: E402

BUCKET = "lmdq-sink-faults"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
SIM = ("--engine", "sim", "--served-model-name", "sim", "--sim-max-batch", "64")
DRAIN_S = 3.0
EXIT_SLACK_S = 8.0
"""How long after the drain deadline a worker may take to exit: its teardown (deregister, engine close,
a few Redis calls), on a loaded 2-core CI box. Unfixed, a hung sink kept it 40 s and more."""


@pytest.fixture(scope="module")
def moto_port() -> Iterator[int]:
    with moto_s3(BUCKET) as port:
        yield port


def _boto_kw() -> dict[str, str]:
    return {"region_name": "us-east-1", "aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


@pytest.fixture()
def proxy(moto_port: int) -> Iterator[HangProxy]:
    with HangProxy(moto_port) as p:
        yield p


def _until(cond: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    """Wait for state (in Redis, on disk) to be reached; the timeout only ends a test that is failing."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _submit(path: Path, env: dict[str, str], *extra: str) -> str:
    p = run_cli("producer", "submit", str(path), "--model", "sim", "--allow-unknown-model", "--batch-size", "32",
                "--max-new-tokens", "16", *extra, env=env)
    assert p.returncode == 0, p.stderr.decode()
    return p.stdout.decode().strip()


def _read_all(env: dict[str, str], bid: str, n: int) -> list[Result]:
    """Every result through the real ``lmdq-producer results``: each custom_id exactly once."""
    p = run_cli("producer", "results", bid, env=env)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    got = [Result.model_validate_json(x) for x in p.stdout.splitlines()]
    assert sorted(r.custom_id for r in got) == sorted(f"r{i}" for i in range(n))
    return got


def _log_lines(path: Path) -> list[dict[str, object]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


# ---- unit level: one bounded call, one flush ---------------------------------------------------


def _warm(url: str, timeout_s: float) -> None:
    """One write through the endpoint first: the S3 client's session and connection exist before the
    hang, so a 1 s timeout is spent waiting on the hung endpoint, not on a cold start (loaded CI)."""
    store = BlobStore.from_url(url, timeout_s=timeout_s)  # fsspec caches the filesystem per options
    store.fs.pipe_file(f"{store.root}/warm/x", b"x")  # unbounded: a cold start may take its time


def test_bounded_call_times_out_and_is_abandoned_on_cancel() -> None:
    gate = threading.Event()
    with pytest.raises(SinkTimeout, match="LMDQ_SINK_TIMEOUT_S"):
        bounded(lambda: gate.wait(30), timeout_s=0.2, what="write")
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(SinkAbandoned):
        bounded(lambda: gate.wait(30), timeout_s=30, what="write", cancel=cancel)
    gate.set()
    assert bounded(lambda: 7, timeout_s=1, what="x") == 7


def test_flush_to_a_hung_s3_seals_nothing_and_keeps_the_records(
        proxy: HangProxy, client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PUT that never answers: flush_job raises after the timeout, nothing is sealed, Redis keeps every
    record; when the endpoint answers again the same flush writes and seals the shard (HEAD-checked)."""
    for k, v in {**AWS_ENV, "LMDQ_S3_ENDPOINT_URL": proxy.url}.items():
        monkeypatch.setenv(k, v)
    keys = Keys(prefix)
    store = ResultStore(client, keys=keys)
    url = f"s3://{BUCKET}/unit"
    b = "batch_" + "1" * 24
    store.batches.create(Batch(id=b, model="m", status=BatchStatus.queued, batch_size=2,
                             request_counts=RequestCounts(total=2), created_at=time.time(), results_url=url))
    payload = JobPayload(batch_id=b, model="m", job_no=0, results_url=url,
                         requests=[{"index": i, "custom_id": f"c{i}", "prompt": "p"} for i in (0, 1)])
    for i in (0, 1):
        store.write_result(Result(batch_id=b, custom_id=f"c{i}", index=i, status=ResultStatus.completed,
                                  text=f"answer {i}", model="m"))
    _warm(url, 1.0)
    proxy.hang()
    with pytest.raises(SinkTimeout):
        flush_job(client, keys, payload, timeout_s=1.0)
    assert proxy.holding.wait(30)  # the PUT really was on the wire, stuck
    assert client.hlen(keys.results(b)) == 2 and not client.exists(keys.shards(b))
    proxy.release()
    entry = flush_job(client, keys, payload, timeout_s=20.0)
    assert entry is not None and not client.exists(keys.results(b))
    data = BlobStore.from_url(url, timeout_s=20.0).fs.cat_file(f"{BUCKET}/unit/{b}/results-000000.jsonl")
    assert [json.loads(x)["text"] for x in data.splitlines()] == ["answer 0", "answer 1"]


# ---- the worker: S3 hangs during a drain ----------------------------------------------------------


@pytest.mark.parametrize("signals", [1, 2], ids=["one-sigterm", "two-sigterms"])
def test_s3_hang_during_drain_loses_nothing_and_keeps_the_deadline(
        tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str, proxy: HangProxy,
        procs: list[subprocess.Popen[bytes]], signals: int) -> None:
    sink = f"s3://{BUCKET}/drain{signals}"
    env = {**env, **AWS_ENV, "LMDQ_S3_ENDPOINT_URL": proxy.url, "LMDQ_ALLOWED_OUTPUT_URLS": sink,
           # the drain deadline, not the sink timeout, must be what ends the wait
           "LMDQ_SINK_TIMEOUT_S": "60", "LMDQ_SINK_RETRY_MAX_S": "1", "LMDQ_DRAIN_TIMEOUT": str(DRAIN_S)}
    n = 1280
    f = write_jsonl(tmp_path / "p.jsonl", [{"custom_id": f"r{i}", "prompt": f"q {i}"} for i in range(n)])
    bid = _submit(f, env, "--results-url", sink)
    keys = Keys(prefix)
    log = tmp_path / "worker.log"
    w = start_worker(*SIM, "--sim-step-ms", "10", "--heartbeat-ttl", "2", env=env, log=log)
    procs.append(w)
    _until(lambda: client.hlen(keys.shards(bid)) >= 2, "two shards sealed")
    proxy.hang()
    assert proxy.holding.wait(60), "no shard PUT reached the hung endpoint"
    # a job's shard PUT is stuck on the wire now, and the worker holds more jobs
    t0 = time.monotonic()
    w.send_signal(signal.SIGTERM)
    if signals == 2:
        _until(lambda: "signal: draining" in log.read_text(errors="replace"), "the first signal handled", 30)
        w.send_signal(signal.SIGTERM)
    rc = w.wait(DRAIN_S + 60)
    took = time.monotonic() - t0
    lines = _log_lines(log)
    tail = log.read_text(errors="replace")[-3000:]
    assert rc == 0, tail
    assert took <= DRAIN_S + EXIT_SLACK_S, (took, tail)
    left = [x for x in lines if str(x.get("event", "")).startswith("results sink not written while stopping")]
    assert len(left) == 1, tail  # ONE line, naming the sink
    assert left[0]["sink"] == sink and int(str(left[0]["jobs"])) >= 1
    assert not [x for x in lines if x.get("level") == "error"], tail
    scheduled = pending_count(client, keys)
    assert scheduled >= 1  # the stuck job's shard is on the retry schedule; its records are in Redis
    assert client.hlen(keys.results(bid)) >= 32

    # The sink answers again; a burst worker ends the batch and, as the last worker, retries the writes.
    proxy.release()
    w2 = start_worker(*SIM, "--sim-step-ms", "0", "--burst", env=env, log=tmp_path / "worker2.log")
    procs.append(w2)
    assert w2.wait(120) == 0, (tmp_path / "worker2.log").read_text()[-3000:]
    b = wait_batch(client, prefix, bid)
    assert b.status is BatchStatus.completed and b.request_counts.completed == n
    got = _read_all(env, bid, n)
    assert all(r.text for r in got)
    # Redis freed: every job sealed into a confirmed shard, nothing left to retry
    assert pending_count(client, keys) == 0
    assert not client.exists(keys.results(bid))
    assert client.hlen(keys.shards(bid)) == n // 32
    print(f"\n[sink-drain] signals={signals} exit_after={took:.1f}s drain={DRAIN_S:g}s "
          f"jobs_left_in_redis={left[0]['jobs']} scheduled={scheduled} results={len(got)}")


# ---- the worker: a folder sink that fills, then recovers ------------------------------------------


def _pipe_to_file(p: subprocess.Popen[bytes], path: Path) -> threading.Thread:
    """The worker logs through a pipe: its file-size limit (below) must not cut its own log."""
    def copy() -> None:
        assert p.stdout is not None
        with open(path, "ab") as out:
            for line in p.stdout:
                out.write(line)
                out.flush()

    t = threading.Thread(target=copy, daemon=True)
    t.start()
    return t


def test_folder_sink_that_fills_then_recovers_frees_redis_and_leaves_no_tmp(
        tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str,
        procs: list[subprocess.Popen[bytes]]) -> None:
    """The sink's disk 'fills' (the worker's RLIMIT_FSIZE set to 0 with prlimit: every write fails with
    EFBIG as it would with ENOSPC; chmod cannot make a folder read-only for root, which CI may be) and
    comes back: the failed shard writes are retried until they land, Redis is freed, no .tmp-* is left."""
    folder = tmp_path / "sink"
    env = {**env, "LMDQ_ALLOWED_OUTPUT_URLS": str(folder), "LMDQ_SINK_TIMEOUT_S": "20",
           "LMDQ_SINK_RETRY_MAX_S": "0.5"}
    n = 1280
    f = write_jsonl(tmp_path / "p.jsonl", [{"custom_id": f"r{i}", "prompt": f"q {i}"} for i in range(n)])
    bid = _submit(f, env, "--results-url", str(folder))
    keys = Keys(prefix)
    log = tmp_path / "worker.log"
    w = subprocess.Popen([sys.executable, "-m", "lmdq.worker", *SIM, "--sim-step-ms", "20"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    procs.append(w)
    copier = _pipe_to_file(w, log)
    _until(lambda: client.hlen(keys.shards(bid)) >= 2, "two shards sealed")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.prlimit(w.pid, resource.RLIMIT_FSIZE, (0, hard))
    try:
        _until(lambda: pending_count(client, keys) >= 3, "three shard writes scheduled for retry")
        before = client.hlen(keys.shards(bid))
    finally:
        resource.prlimit(w.pid, resource.RLIMIT_FSIZE, (soft, hard))
    b = wait_batch(client, prefix, bid, timeout=120)
    assert b.status is BatchStatus.completed and b.request_counts.completed == n
    # Redis freed: every job sealed (the last ones by their own threads, the failed ones by the sweeper)
    _until(lambda: pending_count(client, keys) == 0 and not client.exists(keys.results(bid)),
           "every failed shard write retried and landed")
    assert client.hlen(keys.shards(bid)) == n // 32 > before
    shards = sorted(p.name for p in (folder / bid).iterdir())
    assert shards == [f"results-{j:06d}.jsonl" for j in range(n // 32)]  # and no .tmp-* left
    assert not [p for p in folder.rglob("*") if ".tmp-" in p.name]
    got = _read_all(env, bid, n)
    assert all(r.text for r in got)
    w.send_signal(signal.SIGTERM)
    assert w.wait(60) == 0
    copier.join(10)
    lines = _log_lines(log)
    failing = [x for x in lines if str(x.get("event", "")).startswith("results sink failing")]
    back = [x for x in lines if x.get("event") == "results sink answers again"]
    assert len(failing) >= 1 and failing[0]["sink"] == str(folder) and "File too large" in str(failing[0]["error"])
    assert len(back) >= 1 and len(failing) == len(back)  # one warning per episode, one recovery line
    print(f"\n[sink-folder] scheduled_at_fill>=3 sealed_before_recovery={before} shards={len(shards)} "
          f"episodes={len(failing)} results={len(got)} tmp_left=0")


# ---- the retry schedule: read back from Redis, so untrusted ------------------------------------


def test_sweeper_retries_only_real_jobs_of_allowed_sinks(tmp_path: Path, client: redis.Redis, prefix: str) -> None:
    """A due entry is written and sealed; one of a purged batch, a forged member, forged data or a
    batch whose sink this worker may not write are never written (the last stays scheduled for a
    worker that may); a claimed entry is not handed to a second sweeper while its lease runs."""
    import structlog

    from lmdq.results.output_urls import OutputPolicy
    from lmdq.results.sink import PendingShard, add_pending, claim_pending
    from lmdq.results.worker_sink import EVERY_ENTRY_S, ResultsSink

    keys = Keys(prefix)
    store = ResultStore(client, keys=keys)
    ok_url, other_url = str(tmp_path / "ok"), str(tmp_path / "other")

    def batch(bid: str, url: str) -> None:
        store.batches.create(Batch(id=bid, model="m", status=BatchStatus.queued, batch_size=2,
                                 request_counts=RequestCounts(total=2), created_at=time.time(), results_url=url))
        for i in (0, 1):
            store.write_result(Result(batch_id=bid, custom_id=f"c{i}", index=i, status=ResultStatus.completed,
                                      text=f"a{i}", model="m"))

    good, outside, gone = ("batch_" + c * 24 for c in "abc")
    batch(good, ok_url)
    batch(outside, other_url)
    for bid in (good, outside, gone):
        add_pending(client, keys, PendingShard(batch_id=bid, job_no=0, ranges=[(0, 1)]), 0)
    z, h = keys.sink_pending()
    client.zadd(z, {"../../etc:0": 0, f"{good}:7": 0})
    client.hset(h, f"{good}:7", '{"r": [[0, 99]]}')  # indices outside the batch
    sink = ResultsSink(client, keys, store=store, outputs=OutputPolicy([ok_url]), log=structlog.get_logger(),
                       timeout_s=10, retry_max_s=1, ttl_s=3600, stopping=threading.Event())
    assert sink.sweep_once(ahead_s=EVERY_ENTRY_S) == 4  # the forged member was dropped when claimed
    assert (tmp_path / "ok" / good / "results-000000.jsonl").is_file()
    assert not client.exists(keys.results(good)) and client.hlen(keys.shards(good)) == 1
    assert not (tmp_path / "other").exists() and client.hlen(keys.results(outside)) == 2
    assert [m.decode() for m in client.zrange(z, 0, -1)] == [f"{outside}:0"]  # kept for a worker that may
    assert client.hkeys(h) == [f"{outside}:0".encode()]
    # a claimed entry is leased: a second sweep right away does not get it
    assert [p.member for p in claim_pending(client, keys, limit=10, lease_s=60, ahead_s=EVERY_ENTRY_S)] == \
        [f"{outside}:0"]
    assert claim_pending(client, keys, limit=10, lease_s=60) == []


def test_put_cancelled_at_shutdown_is_not_taken_for_a_success(
        proxy: HangProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's probe: an S3 PUT stuck on the wire whose coroutine is cancelled (what the S3
    library's clean-up does at interpreter exit) makes fsspec's ``pipe_file`` return None, as a
    success does. ``put_bytes`` must not return: its HEAD finds no object."""
    import asyncio

    import fsspec.asyn

    for k, v in {**AWS_ENV, "LMDQ_S3_ENDPOINT_URL": proxy.url}.items():
        monkeypatch.setenv(k, v)
    store = BlobStore.from_url(f"s3://{BUCKET}/cancel", timeout_s=30.0)
    proxy.hang()
    out: dict[str, object] = {}

    def put() -> None:
        try:
            out["returned"] = store.put_bytes("batch_x/results-000000.jsonl", b'{"index": 0}\n')
        except Exception as e:  # noqa: BLE001 - what the test looks at
            out["raised"] = e

    t = threading.Thread(target=put, daemon=True)
    t.start()
    assert proxy.holding.wait(30), "the PUT never reached the endpoint"

    async def cancel_all() -> None:
        me = asyncio.current_task()
        for task in asyncio.all_tasks():
            if task is not me:
                task.cancel()

    asyncio.run_coroutine_threadsafe(cancel_all(), fsspec.asyn.get_loop()).result(10)
    proxy.release()  # the confirmation (HEAD) gets its answer at once
    t.join(40)
    assert "returned" not in out, out
    assert isinstance(out.get("raised"), OSError), out  # not found, or found with the wrong size
    with pytest.raises(FileNotFoundError):
        store.fs.info(f"{BUCKET}/cancel/batch_x/results-000000.jsonl")


def test_a_sweep_tries_a_hung_sink_once_not_once_per_entry(
        proxy: HangProxy, client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three jobs of one batch wait for a sink that hangs: one sweep tries the first (bounded by the
    timeout), reschedules the other two untried, and keeps every record in Redis."""
    import structlog

    from lmdq.results.output_urls import OutputPolicy
    from lmdq.results.sink import PendingShard, add_pending
    from lmdq.results.worker_sink import EVERY_ENTRY_S, ResultsSink

    for k, v in {**AWS_ENV, "LMDQ_S3_ENDPOINT_URL": proxy.url}.items():
        monkeypatch.setenv(k, v)
    keys = Keys(prefix)
    store = ResultStore(client, keys=keys)
    url = f"s3://{BUCKET}/sweep"
    bid = "batch_" + "d" * 24
    store.batches.create(Batch(id=bid, model="m", status=BatchStatus.queued, batch_size=1,
                             request_counts=RequestCounts(total=3), created_at=time.time(), results_url=url))
    for i in range(3):
        store.write_result(Result(batch_id=bid, custom_id=f"c{i}", index=i, status=ResultStatus.completed,
                                  text="a", model="m"))
        add_pending(client, keys, PendingShard(batch_id=bid, job_no=i, ranges=[(i, i)]), 0)
    sink = ResultsSink(client, keys, store=store, outputs=OutputPolicy([url]), log=structlog.get_logger(),
                       timeout_s=1.0, retry_max_s=1, ttl_s=3600, stopping=threading.Event())
    _warm(url, 1.0)
    proxy.hang()
    assert sink.sweep_once(ahead_s=EVERY_ENTRY_S) == 3
    assert sink.stats["shard_failures"] == 1 and proxy.holding.wait(30)
    assert pending_count(client, keys) == 3 and client.hlen(keys.results(bid)) == 3
    proxy.release()
    while sink.sweep_once(ahead_s=EVERY_ENTRY_S):
        pass
    assert pending_count(client, keys) == 0 and not client.exists(keys.results(bid))
    assert sink.stats["shards_retried"] == 3


def test_a_full_redis_is_freed_when_the_sink_answers(tmp_path: Path, client: redis.Redis, prefix: str) -> None:
    """Redis full (``maxmemory`` + ``noeviction``: every write that may grow memory refused) with a job
    whose shard could not be written: its retry is scheduled and, once the sink answers, the sweep
    claims it, writes the shard and seals the job, which is what frees Redis (issue 29: a batch stalled
    until the sink returned, and then only because nothing was full)."""
    import structlog

    from lmdq.results.output_urls import OutputPolicy
    from lmdq.results.sink import PendingShard, add_pending
    from lmdq.results.worker_sink import ResultsSink

    keys = Keys(prefix)
    store = ResultStore(client, keys=keys)
    url = str(tmp_path / "sink")
    bid = "batch_" + "e" * 24
    store.batches.create(Batch(id=bid, model="m", status=BatchStatus.queued, batch_size=2,
                             request_counts=RequestCounts(total=2), created_at=time.time(), results_url=url))
    for i in (0, 1):
        store.write_result(Result(batch_id=bid, custom_id=f"c{i}", index=i, status=ResultStatus.completed,
                                  text="x" * 2000, model="m"))
    sink = ResultsSink(client, keys, store=store, outputs=OutputPolicy([url]), log=structlog.get_logger(),
                       timeout_s=10, retry_max_s=1, ttl_s=3600, stopping=threading.Event())
    old = client.config_get("maxmemory")["maxmemory"], client.config_get("maxmemory-policy")["maxmemory-policy"]
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            client.set(f"{prefix}:probe", "x")  # full indeed
        add_pending(client, keys, PendingShard(batch_id=bid, job_no=0, ranges=[(0, 1)]), 0)
        assert sink.sweep_once() == 1
        assert sink.stats["shards_retried"] == 1 and pending_count(client, keys) == 0
        assert not client.exists(keys.results(bid)) and client.hlen(keys.shards(bid)) == 1
    finally:
        client.config_set("maxmemory", old[0])
        client.config_set("maxmemory-policy", old[1])
    assert [json.loads(x)["index"] for x in (tmp_path / "sink" / bid / "results-000000.jsonl").read_text().split()] \
        == [0, 1]
