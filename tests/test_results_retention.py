"""Issue 17, Redis memory: a cluster-wide results sink that leaves <= 100 bytes per completed request,
retention (``--result-ttl``, ``results --delete``, ``purge``) and submit's headroom check.

Everything runs against real redis-servers: the session's shared one, or a private one where the test
reads server-wide numbers (``used_memory``) or changes ``maxmemory``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from rq.job import Job

from lmdq.contract import BatchStatus, GenerationParams, Result, ResultStatus
from lmdq.redis.keys import Keys, queue_names, rq_queue_key
from lmdq.results.export import iter_lmdq_lines
from lmdq.results.openai import iter_openai
from lmdq.results.store import ResultStore
from lmdq.submission.submit import SubmitOptions, submit_file
from tests.conftest import RedisServer, run_cli
from tests.helpers import write_jsonl

MODEL = "sim"


def _worker(client: redis.Redis, url: str, prefix: str, **settings: Any) -> dict[str, int]:
    """A real worker (sim engine) in burst mode, in this process; returns its counters."""
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    s = WorkerSettings(redis_url=url, key_prefix=prefix, burst=True, health_port=0, heartbeat_ttl_s=10, **settings)
    w = Worker(engine=SimEngine(model_name=MODEL, step_ms=0), client=client, settings=s)
    assert w.run() == 0
    return w.stats


def _submit(client: redis.Redis, prefix: str, path: Path, *, ttl_s: int = 3600, **opts: Any) -> Any:
    o = SubmitOptions(model=MODEL, allow_unknown_model=True, **opts)
    batch, created = submit_file(path, o, client=client, keys=Keys(prefix), ttl_s=ttl_s)
    assert created
    return batch


def _rows(n: int, *, fail_every: int = 0) -> list[dict[str, Any]]:
    return [{"custom_id": f"r{i}",
             "prompt": f"question {i} [[sim:error]]" if fail_every and i % fail_every == 3 else f"question {i}"}
            for i in range(n)]


def _batch_keys(client: redis.Redis, prefix: str, batch_id: str) -> list[bytes]:
    """Every key of the batch: lmdq's under the prefix, and RQ's job hashes."""
    return sorted([*client.scan_iter(f"{prefix}:batch:{batch_id}*"), *client.scan_iter(f"rq:job:{batch_id}-*")])


@pytest.fixture()
def private_redis() -> Iterator[RedisServer]:
    srv = RedisServer().start()
    try:
        yield srv
    finally:
        srv.cleanup()


# ---- the sink: <= 100 bytes per completed request -------------------------------------------------


def test_sink_leaves_at_most_100_bytes_per_completed_request(tmp_path: Path, private_redis: RedisServer) -> None:
    """10,000 requests (jobs of 32) through the real submit, worker and export paths, on a private
    redis-server so ``used_memory`` is this batch's alone. ``lmdq-bench sink`` runs 100,000."""
    n = 10_000
    client = redis.Redis.from_url(private_redis.url)
    prefix = "lmdq"
    f = write_jsonl(tmp_path / "p.jsonl", _rows(n))
    sink = tmp_path / "sink"
    _worker(client, private_redis.url, prefix, allowed_output_urls=str(tmp_path))  # registers; scripts loaded
    before = int(client.info("memory")["used_memory"])
    batch = _submit(client, prefix, f, results_url=str(sink), params=GenerationParams(max_new_tokens=16))
    stats = _worker(client, private_redis.url, prefix, allowed_output_urls=str(tmp_path))
    store = ResultStore(client, keys=Keys(prefix))
    b = store.batches.get(batch.id)
    assert b.status is BatchStatus.completed and b.request_counts.completed == n
    assert stats["duplicates"] == 0

    # the worker's idle pooled connections (one per job thread: the engine's capacity decides how many) hold
    # client buffers, not the batch's data: closed before measuring, as at ``before`` (one connection)
    client.connection_pool.disconnect()
    after = int(client.info("memory")["used_memory"])
    keys = _batch_keys(client, prefix, batch.id)
    usage = sum(int(client.memory_usage(k, samples=0) or 0) for k in keys)
    per_request = (after - before) / n
    print(f"\n{n:,} requests with a results sink: used_memory delta {per_request:.1f} B/request, "
          f"MEMORY USAGE of the batch's keys {usage / n:.1f} B/request ({[k.decode() for k in keys]})")
    assert per_request <= 100 and usage / n <= 100
    assert client.hlen(Keys(prefix).shards(batch.id)) == b.num_jobs == (n + 31) // 32
    assert not client.exists(Keys(prefix).results(batch.id))  # no per-request record left
    assert not list(client.scan_iter(f"rq:job:{batch.id}-*"))  # completed jobs' prompts are gone too

    # every result, in input order, from the shards, in both formats
    lines = [Result.model_validate_json(x) for x in iter_lmdq_lines(store, b)]
    assert [r.index for r in lines] == list(range(n)) and [r.custom_id for r in lines] == [f"r{i}" for i in range(n)]
    assert all(r.status is ResultStatus.completed and r.text and r.generate_token_len == 16 for r in lines)
    openai = [json.loads(x) for _, x in iter_openai(store, b)]
    assert [x["custom_id"] for x in openai] == [f"r{i}" for i in range(n)]


def test_a_rerun_after_the_trim_runs_and_writes_nothing(tmp_path: Path, client: redis.Redis, redis_url: str,
                                                        prefix: str) -> None:
    """A worker that dies after sealing a job but before releasing it: the job comes back on the queue,
    job hash and all. The next worker must neither run it nor write any of its requests again."""
    f = write_jsonl(tmp_path / "p.jsonl", _rows(10))
    batch = _submit(client, prefix, f, results_url=str(tmp_path / "sink"), batch_size=5)
    keys = Keys(prefix)
    from lmdq.jobs.queue import job_id_for

    saved = {j: client.hgetall(Job.key_for(job_id_for(batch.id, j))) for j in range(2)}
    _worker(client, redis_url, prefix, allowed_output_urls=str(tmp_path))
    store = ResultStore(client, keys=keys)
    first = list(iter_lmdq_lines(store, store.batches.get(batch.id)))
    assert len(first) == 10 and client.hlen(keys.shards(batch.id)) == 2
    # the job as a dead worker left it: hash back, id back on its queue
    for j, fields in saved.items():
        client.hset(Job.key_for(job_id_for(batch.id, j)), mapping=fields)
    client.rpush(rq_queue_key(queue_names(MODEL, prefix)[1]), job_id_for(batch.id, 0))
    stats = _worker(client, redis_url, prefix, allowed_output_urls=str(tmp_path))
    assert stats["jobs"] == 1 and stats["results"] == 0 and stats["duplicates"] == 0  # begin saw it sealed
    # a late writer (a worker presumed dead) is refused too, final or partial
    late = Result(batch_id=batch.id, custom_id="r1", index=1, status=ResultStatus.completed, text="late", model=MODEL)
    assert not store.write_result(late) and not store.write_partial(late)
    b = store.batches.get(batch.id)
    assert b.request_counts.completed == 10 and b.status is BatchStatus.completed
    assert not client.exists(keys.results(batch.id), keys.partials(batch.id))
    assert list(iter_lmdq_lines(store, b)) == first


def test_retry_reads_failures_from_the_shards_and_keeps_their_jobs(tmp_path: Path, client: redis.Redis,
                                                                   redis_url: str, prefix: str) -> None:
    """Failed requests of a sealed job are read back from its shard (the index counts them), and the
    jobs that hold them keep their prompts, so ``retry`` still works; all-completed jobs drop theirs."""
    from lmdq.jobs.queue import job_id_for
    from lmdq.submission.retry import retry_batch

    f = write_jsonl(tmp_path / "p.jsonl", _rows(40, fail_every=16))  # failures at 3, 19, 35: jobs 0, 2, 4
    batch = _submit(client, prefix, f, results_url=str(tmp_path / "sink"), batch_size=8)
    _worker(client, redis_url, prefix, allowed_output_urls=str(tmp_path))
    b = ResultStore(client, keys=Keys(prefix)).batches.get(batch.id)
    assert b.request_counts.failed == 3 and b.request_counts.completed == 37
    have = [j for j in range(5) if client.exists(Job.key_for(job_id_for(batch.id, j)))]
    assert have == [0, 2, 4]
    again, created = retry_batch(client, Keys(prefix), batch.id, ttl_s=3600)
    assert created and again.request_counts.total == 3


# ---- the cluster-wide setting ---------------------------------------------------------------------------


def test_lmdq_results_url_is_every_batchs_sink_unless_overridden(tmp_path: Path, env: dict[str, str],
                                                                 client: redis.Redis, prefix: str) -> None:
    sink, other = tmp_path / "cluster-sink", tmp_path / "other"
    env = {**env, "LMDQ_RESULTS_URL": str(sink)}
    f = write_jsonl(tmp_path / "p.jsonl", _rows(4))

    def submit(*extra: str) -> dict[str, Any]:
        p = run_cli("lmdq.producer", "submit", str(f), "--model", MODEL, "--allow-unknown-model", "--json", *extra,
                    env=env)
        assert p.returncode == 0, p.stderr.decode()
        return json.loads(p.stdout)

    assert submit()["results_url"] == str(sink)
    assert submit("--results-url", str(other))["results_url"] == str(other)
    assert submit("--results-url", "none")["results_url"] is None
    # the worker allows its own LMDQ_RESULTS_URL without LMDQ_ALLOWED_OUTPUT_URLS; 'other' stays refused
    os.environ["LMDQ_RESULTS_URL"] = str(sink)
    try:
        from lmdq.worker.settings import WorkerSettings

        assert WorkerSettings().results_url == str(sink)
    finally:
        del os.environ["LMDQ_RESULTS_URL"]
    stats = _worker(client, env["LMDQ_REDIS_URL"], prefix, results_url=str(sink))
    assert stats["jobs"] == 3
    store = ResultStore(client, keys=Keys(prefix))
    done = [b for b in store.batches.newest() if b.status.terminal]
    by_url = {b.results_url: b for b in done}
    assert by_url[str(sink)].request_counts.completed == 4
    assert by_url[str(other)].request_counts.failed == 4  # outside the worker's allowed prefixes
    assert by_url[None].request_counts.completed == 4
    assert len(list(sink.rglob("results-*.jsonl"))) == 1
    assert not other.exists()


# ---- retention -------------------------------------------------------------------------------------------


def test_result_ttl_applies_to_every_key_of_the_batch(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                                      prefix: str) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", _rows(6, fail_every=4))
    for bad, why in (("soon", "expected e.g. 7d"), ("30", "at least 60 seconds"), ("-1h", "positive")):
        p = run_cli("lmdq.producer", "submit", str(f), "--model", MODEL, "--allow-unknown-model",
                    "--result-ttl", bad, env=env)
        assert p.returncode == 2 and why in p.stderr.decode(), p.stderr.decode()
    assert not list(client.scan_iter(f"{prefix}:batch:*"))
    p = run_cli("lmdq.producer", "submit", str(f), "--model", MODEL, "--allow-unknown-model", "--result-ttl", "2h",
                "--batch-size", "2", "--json", env=env)
    assert p.returncode == 0, p.stderr.decode()
    bid = json.loads(p.stdout)["id"]
    _worker(client, env["LMDQ_REDIS_URL"], prefix)  # the worker's own LMDQ_RESULT_TTL_S stays 7 days
    keys = _batch_keys(client, prefix, bid)
    assert Keys(prefix).results(bid).encode() in keys and len(keys) >= 5
    for k in keys:
        assert 7000 < client.ttl(k) <= 7200, k


def test_results_delete_removes_the_batch_after_a_full_export(tmp_path: Path, env: dict[str, str],
                                                              client: redis.Redis, prefix: str) -> None:
    env = {**env, "LMDQ_ALLOWED_OUTPUT_URLS": str(tmp_path)}
    f = write_jsonl(tmp_path / "p.jsonl", _rows(12, fail_every=8))
    outs = []
    for sink in (None, str(tmp_path / "sink")):
        batch = _submit(client, prefix, f, batch_size=4, results_url=sink, idempotency_key=f"k-{sink}")
        _worker(client, env["LMDQ_REDIS_URL"], prefix, allowed_output_urls=str(tmp_path))
        assert _batch_keys(client, prefix, batch.id)
        out = tmp_path / f"out-{len(outs)}.jsonl"
        p = run_cli("lmdq.producer", "results", batch.id, "-o", str(out), "--delete", env=env)
        assert p.returncode == 0, p.stderr.decode()
        assert f"purged {batch.id}" in p.stderr.decode()
        got = [Result.model_validate_json(x) for x in out.read_bytes().splitlines()]
        assert [r.index for r in got] == list(range(12)) and sum(r.status is ResultStatus.failed for r in got) == 2
        outs.append([(r.custom_id, r.text) for r in got])
        assert _batch_keys(client, prefix, batch.id) == []
        assert client.zscore(Keys(prefix).batches(), batch.id) is None
        assert not client.exists(Keys(prefix).idempotency(f"k-{sink}"))
        assert run_cli("lmdq.producer", "status", batch.id, env=env).returncode == 1
    assert outs[0] == outs[1]
    assert len(list((tmp_path / "sink").rglob("*.jsonl"))) == 3  # the sink's files are left as they are


def test_purge_refuses_a_running_batch_unless_forced(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                                     prefix: str) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", _rows(20))
    batch = _submit(client, prefix, f, batch_size=5)
    queue = rq_queue_key(queue_names(MODEL, prefix)[1])
    p = run_cli("lmdq.producer", "results", batch.id, "--delete", env=env)
    assert p.returncode == 2 and "nothing was deleted" in p.stderr.decode() and p.stdout == b""
    p = run_cli("lmdq.producer", "purge", batch.id, env=env)
    assert p.returncode == 2 and "--force" in p.stderr.decode()
    assert len(_batch_keys(client, prefix, batch.id)) == 6 and client.llen(queue) == 4  # untouched
    p = run_cli("lmdq.producer", "purge", batch.id, "--force", env=env)
    assert p.returncode == 0, p.stderr.decode()
    said = p.stdout.decode()
    assert f"purged {batch.id} (queued, 6 Redis keys deleted, 4 of them job hashes" in said
    assert "took 4 queued jobs off the queue" in said
    assert _batch_keys(client, prefix, batch.id) == [] and client.llen(queue) == 0
    assert run_cli("lmdq.producer", "purge", batch.id, env=env).returncode == 1  # no such batch
    # a worker still writing for the purged batch brings nothing back
    store = ResultStore(client, keys=Keys(prefix))
    r = Result(batch_id=batch.id, custom_id="r0", index=0, status=ResultStatus.completed, text="x", model=MODEL)
    assert not store.write_result(r) and not store.write_partial(r)
    assert _batch_keys(client, prefix, batch.id) == []


# ---- headroom ---------------------------------------------------------------------------------------------


def test_submit_that_would_overflow_maxmemory_is_refused_and_enqueues_nothing(
        tmp_path: Path, env: dict[str, str], private_redis: RedisServer) -> None:
    client = redis.Redis.from_url(private_redis.url)
    env = {**env, "LMDQ_REDIS_URL": private_redis.url}
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", str(used + 8_000_000))  # 8 MB of room; noeviction is the default policy
    f = write_jsonl(tmp_path / "p.jsonl", _rows(5_000))  # ~0.2 MB of prompts; results ~13 MB without a sink
    p = run_cli("lmdq.producer", "submit", str(f), "--model", MODEL, "--allow-unknown-model", env=env)
    err = p.stderr.decode()
    assert p.returncode == 2, err
    assert len(err.strip().splitlines()) == 1 and "would not fit in Redis" in err
    assert "LMDQ_RESULTS_URL" in err and "--results-url" in err and "--result-ttl" in err
    assert "nothing was enqueued" in err
    assert client.dbsize() == 0  # nothing staged, nothing to roll back
    # shorter answers fit, and so does the same batch with a sink (~0.5 MB in Redis)
    sink = str(tmp_path / "sink")
    for extra in (("--max-new-tokens", "64"), ("--results-url", sink)):
        p = run_cli("lmdq.producer", "submit", str(f), "--model", MODEL, "--allow-unknown-model", *extra, env=env)
        assert p.returncode == 0, p.stderr.decode()
    # LMDQ_MEMORY_HEADROOM_FRACTION lowers the bar
    p = run_cli("lmdq.producer", "submit", str(f), "--model", MODEL, "--allow-unknown-model", "--results-url", sink,
                env={**env, "LMDQ_MEMORY_HEADROOM_FRACTION": "0.05"})
    assert p.returncode == 2 and "stops at 5%" in p.stderr.decode()
