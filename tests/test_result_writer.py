"""Final results written behind the job's thread, in pipelined batches, on a real redis-server."""

from __future__ import annotations

import threading

import redis
import structlog

from lmdq.contract import Result, ResultStatus
from lmdq.redis.keys import Keys
from lmdq.results.store import ResultStore
from lmdq.worker.result_writer import ResultWriter


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
