"""lmdq.client.stream: Batch.stream over a real redis-server, the test writing what a worker writes
(partials, then finals, through the ResultStore) between steps of the stream. Each ``next`` returns once
the write it waits for is there: no timing involved."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

import lmdq
from lmdq.client.stream import StreamChunk
from lmdq.contract import FinishReason, Result, ResultStatus
from lmdq.redis.keys import Keys
from lmdq.results.store import ResultStore
from lmdq.submission.settings import ProducerSettings
from lmdq.testing import enqueue_requests


def _setup(redis_url: str, client: redis.Redis, prefix: str, n: int) -> tuple[lmdq.Batch, ResultStore]:
    bid = enqueue_requests(client, Keys(prefix), "sim", [{"prompt": f"p{i}"} for i in range(n)], batch_size=n)
    c = lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix))
    return c.batch(bid), ResultStore(client, keys=Keys(prefix))


def _r(bid: str, i: int, text: str, *, final: bool = False, **kw: Any) -> Result:
    fields: dict[str, Any] = {"generate_token_len": len(text.split()), **kw}
    return Result(batch_id=bid, custom_id=f"r{i}", index=i, model="sim", text=text, input_token_len=3,
                  status=ResultStatus.completed if final else ResultStatus.in_progress,
                  finish_reason=FinishReason.stop if final else None, **fields)


def test_deltas_per_request_then_one_final_chunk_each(redis_url: str, client: redis.Redis, prefix: str) -> None:
    b, store = _setup(redis_url, client, prefix, 3)
    it = b.stream(timeout=30, poll_interval=0.01, max_interval=0.05)
    store.write_partial(_r(b.id, 0, "Hello"))
    assert next(it) == StreamChunk(index=0, custom_id="r0", text="Hello", generate_token_len=1, input_token_len=3)
    store.write_partial(_r(b.id, 0, "Hello big"))
    store.write_partial(_r(b.id, 1, "One"))
    assert [(c.index, c.text, c.finished) for c in (next(it), next(it))] == [(0, " big", False), (1, "One", False)]
    store.write_result(_r(b.id, 0, "Hello big world", final=True))
    last = next(it)
    assert (last.index, last.text, last.finish_reason, last.finished, last.restart) == (0, " world", "stop", True,
                                                                                          False)
    assert last.result is not None and last.result.text == "Hello big world"
    # a partial written for its token counts only adds nothing: no chunk; a final with no partial before it
    store.write_partial(_r(b.id, 1, "One", generate_token_len=9))
    store.write_result(_r(b.id, 2, "Two words", final=True))
    c = next(it)
    assert (c.index, c.text, c.finished, c.restart) == (2, "Two words", True, False)
    # the job ran again (a new attempt starts over): the text replaces what was streamed
    store.write_partial(_r(b.id, 1, "Uno"))
    c = next(it)
    assert (c.index, c.text, c.restart, c.finished) == (1, "Uno", True, False)
    # the final trims what the partial held (a stop string): the whole text, as a restart
    store.write_result(_r(b.id, 1, "Un", final=True))
    c = next(it)
    assert (c.index, c.text, c.restart, c.finished) == (1, "Un", True, True)
    assert list(it) == []  # every request ended: the stream ends


def test_a_batch_with_nothing_written_times_out(redis_url: str, client: redis.Redis, prefix: str) -> None:
    b, _ = _setup(redis_url, client, prefix, 1)
    t0 = time.monotonic()
    with pytest.raises(lmdq.WaitTimeout, match="0/1 requests ended"):
        list(b.stream(timeout=0.2, poll_interval=0.01, max_interval=0.05))
    assert time.monotonic() - t0 < 10


def test_a_cancelled_queued_batch_streams_its_finals(redis_url: str, client: redis.Redis, prefix: str) -> None:
    b, _ = _setup(redis_url, client, prefix, 2)
    b.cancel()  # no worker: every request ends cancelled, never having streamed
    got = list(b.stream(timeout=30))
    assert [(c.index, c.text, c.finished) for c in got] == [(0, "", True), (1, "", True)]
    assert {c.result.status for c in got if c.result} == {ResultStatus.cancelled}
