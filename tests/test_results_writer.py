"""Final results written behind the job's thread, in pipelined batches, on a real redis-server; a job
sealed by the writer that wrote its results."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import redis
import structlog

from lmdq.contract import Batch, BatchStatus, JobPayload, Request, RequestCounts, Result, ResultStatus
from lmdq.redis.keys import Keys
from lmdq.results.store import ResultStore
from lmdq.results.writer import ResultWriter


def _results(batch_id: str, n: int) -> list[Result]:
    return [Result(batch_id=batch_id, custom_id=f"r{i}", index=i, status=ResultStatus.completed, text="x",
                   model="m") for i in range(n)]


def test_results_queued_together_go_in_one_pipelined_call_each_written_once(client: redis.Redis,
                                                                            prefix: str) -> None:
    keys = Keys(prefix)
    store = ResultStore(client, keys=keys, ttl_s=3600)
    client.hset(keys.batch("b"), mapping={"total": 100, "status": "in_progress"})
    client.expire(keys.batch("b"), 3600)
    calls: list[int] = []
    real = store.write_results_each

    def counting(results: list[Result]) -> list[bool]:
        calls.append(len(results))
        return real(results)

    store.write_results_each = counting  # type: ignore[method-assign]  # a spy on lmdq's own call, Redis is real
    w = ResultWriter(store, log=structlog.get_logger(), give_up=threading.Event())
    rs = _results("b", 100)
    with w._qcond:  # the flusher cannot take anything until all 100 are queued
        futs = [w.final_async(r) for r in rs]
    w.wait(futs)
    assert futs == [] and sum(calls) == 100 and len(calls) <= 2, calls  # 1 (or the first alone, then 99)
    assert client.hlen(keys.results("b")) == 100
    assert int(client.hget(keys.batch("b"), "completed") or 0) == 100  # counters once per result
    again = [w.final_async(r) for r in rs[:10]]  # a re-run's writes: refused, counted as duplicates
    assert [f.result() for f in again] == [False] * 10
    w.wait(again)
    assert w.stats["results"] == 100 and w.stats["duplicates"] == 10
    assert int(client.hget(keys.batch("b"), "completed") or 0) == 100


def test_finals_write_a_whole_group_now_each_once(client: redis.Redis, prefix: str) -> None:
    """A job answered from reuse writes its results from its own thread, in one call: each exactly once
    (a second attempt's writes are refused and counted as duplicates), no flusher thread started."""
    keys = Keys(prefix)
    store = ResultStore(client, keys=keys, ttl_s=3600)
    client.hset(keys.batch("b"), mapping={"total": 100, "status": "in_progress"})
    client.expire(keys.batch("b"), 3600)
    w = ResultWriter(store, log=structlog.get_logger(), give_up=threading.Event())
    rs = _results("b", 100)
    assert w.finals(rs[:60]) == [True] * 60
    assert w.finals(rs[50:]) == [False] * 10 + [True] * 40
    assert w.finals([]) == [] and w._flusher is None
    assert client.hlen(keys.results("b")) == 100
    assert int(client.hget(keys.batch("b"), "completed") or 0) == 100
    assert w.stats["results"] == 100 and w.stats["duplicates"] == 10


def test_a_job_is_sealed_by_the_writer_that_wrote_its_results(client: redis.Redis, prefix: str,
                                                               tmp_path: Path) -> None:
    """Sealing happens where results are written: the writer's ``seal`` writes the job's shard and moves
    its records out of Redis; a job without a results URL, or a writer without a sink, seals nothing."""
    from lmdq.results.output_urls import OutputPolicy
    from lmdq.results.worker_sink import ResultsSink

    keys = Keys(prefix)
    store = ResultStore(client, keys=keys, ttl_s=3600)
    sink_url = str(tmp_path / "sink")
    b = Batch(id=f"batch_{time.time_ns():024x}"[:30], model="m", status=BatchStatus.in_progress, batch_size=4,
              request_counts=RequestCounts(total=4), created_at=0.0, results_url=sink_url)
    store.batches.create(b)
    log = structlog.get_logger()
    sink = ResultsSink(client, keys, store=store, outputs=OutputPolicy([sink_url]), log=log, timeout_s=10,
                       retry_max_s=1, ttl_s=3600, stopping=threading.Event())
    w = ResultWriter(store, log=log, give_up=threading.Event(), sink=sink)
    payload = JobPayload(batch_id=b.id, model="m", job_no=0, results_url=sink_url,
                         requests=[Request(index=i, custom_id=f"r{i}", prompt="p") for i in range(4)])
    futs = [w.final_async(r) for r in _results(b.id, 4)]
    w.wait(futs)
    assert ResultWriter(store, log=log, give_up=threading.Event()).seal(payload, log) is None  # no sink
    assert w.seal(payload.model_copy(update={"results_url": None}), log) is None  # no results URL
    assert client.hlen(keys.results(b.id)) == 4 and not (tmp_path / "sink").exists()
    entry = w.seal(payload, log)
    assert entry is not None and entry.ranges == [(0, 3)] and entry.all_completed()
    assert not client.exists(keys.results(b.id)) and client.hlen(keys.shards(b.id)) == 1
    shard = tmp_path / "sink" / b.id / "results-000000.jsonl"
    assert [Result.model_validate_json(x).index for x in shard.read_bytes().splitlines()] == [0, 1, 2, 3]
    assert w.seal(payload, log) == entry and sink.stats["shards"] == 2  # sealed already: the same entry
