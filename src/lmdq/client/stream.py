"""Per-request text as workers write it: :meth:`lmdq.Batch.stream`, lmdq's counterpart of LMDeploy's
``pipeline.stream_infer``.

A worker writes a running request's text so far as its *partial* record every
``LMDQ_PARTIAL_INTERVAL_S`` (2 s by default; worker/attempt.py), and its final result once it ends
(which removes the partial). A stream polls both: each poll reads the partials of the requests running
now (one HSCAN over the batch's partials hash, which holds only those) and the final results not yet
yielded (as :meth:`lmdq.Batch.as_completed` does), and yields, per request whose text grew, the text
it added since that request's previous chunk: ``text`` is a delta, as LMDeploy's ``Response.text`` is.
The chunk that carries the final :class:`~lmdq.contract.Result` ends that request; every request gets
exactly one. So a reader sees a long answer grow at the worker's partial interval, not token by token
(lmdq is a batch queue: text crosses Redis, and a write per token would cost the GPU's time).

``restart``: the request's text no longer extends what was streamed, because its job ran again (a
worker died; a new attempt starts over) or the final text trimmed a stop string the partial still
held. ``text`` is then the whole text so far, to replace what the reader had.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from lmdq.contract import Batch as BatchInfo
from lmdq.contract import FinishReason, Result
from lmdq.errors import WaitTimeout
from lmdq.results.reader import ResultReader
from lmdq.results.store import ResultStore

__all__ = ["StreamChunk", "poll_batch", "stream_batch"]

T = TypeVar("T")


@dataclass(frozen=True)
class StreamChunk:
    """One step of one request's answer (LMDeploy's ``Response`` of ``stream_infer``, lmdq's names)."""

    #: the request's 0-based input position (``Result.index``)
    index: int
    custom_id: str
    #: the text this request added since its previous chunk (the whole text so far when ``restart``)
    text: str
    #: tokens generated so far (the final count on the last chunk)
    generate_token_len: int
    input_token_len: int
    #: set on the request's last chunk only (``stop``, ``length``, ``abort``, ``error``); None while it runs
    finish_reason: FinishReason | None = None
    #: the request's final Result, on its last chunk only (``status``, ``error``, samples, logprobs, ...)
    result: Result | None = None
    #: ``text`` replaces what this request streamed so far instead of extending it (see the module doc)
    restart: bool = False

    @property
    def finished(self) -> bool:
        """Whether this is the request's last chunk."""
        return self.result is not None


class _Sent:
    """The text streamed so far per running request (dropped when it ends)."""

    def __init__(self) -> None:
        self.text: dict[int, str] = {}

    def step(self, i: int, r: Result, *, final: bool) -> StreamChunk | None:
        before = self.text.get(i, "")
        now = r.text
        restart = not now.startswith(before)
        delta = now if restart else now[len(before):]
        if final:
            self.text.pop(i, None)
        elif not delta and not restart:
            return None  # a partial with nothing new (written for its token counts)
        else:
            self.text[i] = now
        return StreamChunk(index=i, custom_id=r.custom_id, text=delta, generate_token_len=r.generate_token_len,
                           input_token_len=r.input_token_len, finish_reason=r.finish_reason if final else None,
                           result=r if final else None, restart=restart and bool(before))


def poll_batch(store: ResultStore, info: BatchInfo, refresh: Callable[[], BatchInfo],
               final: Callable[[int, bytes], T], *, running: Callable[[bytearray], Iterator[T]] | None = None,
               timeout: float | None = None, poll_interval: float = 0.25, max_interval: float = 1.0,
               counted: str = "results") -> Iterator[T]:
    """The one poll loop behind :meth:`lmdq.Batch.as_completed` and :meth:`lmdq.Batch.stream`, so both
    back off, time out and stop on a terminal batch alike. Each poll yields what ``running`` makes of the
    requests still running (given the finals seen so far; streams read partials there), then ``final`` of
    each final result not yielded yet, until every request has one or the batch ended without a result for
    some (purged, expired keys). ``refresh`` reads the batch record again (its counters say when finals are
    new). Polls every ``poll_interval`` s while something arrives, backing off to ``max_interval`` while
    nothing does; :class:`~lmdq.errors.WaitTimeout` after ``timeout`` s (its message counts ``counted``)."""
    total = info.request_counts.total
    reader = ResultReader.of(store, info)
    seen = bytearray(total)
    yielded = 0
    deadline = None if timeout is None else time.monotonic() + timeout
    interval = poll_interval
    while yielded < total:
        new = 0
        if running is not None:
            # partials first: a request that ends between the two reads is then seen ended, never running again
            for item in running(seen):
                new += 1
                yield item
        need = info.request_counts.done - yielded
        if need > 0:
            for i, raw in reader.new_finals(seen, need):
                seen[i] = 1
                yielded += 1
                new += 1
                yield final(i, raw)
        if yielded >= total:
            return
        if new == 0:
            if info.status.terminal:
                return  # ended without a result for every request (its keys purged or expired)
            if deadline is not None and time.monotonic() > deadline:
                raise WaitTimeout(f"batch {info.id} still {info.status.value} after {timeout}s "
                                  f"({yielded}/{total} {counted})")
            time.sleep(interval)
            interval = min(max_interval, interval * 2)
        else:
            interval = poll_interval
        info = refresh()


def stream_batch(store: ResultStore, info: BatchInfo, refresh: Callable[[], BatchInfo], *,
                 timeout: float | None = None, poll_interval: float = 0.25,
                 max_interval: float = 1.0) -> Iterator[StreamChunk]:
    """The chunks of ``info``'s batch until every request has its last one (:func:`poll_batch` polls)."""
    total = info.request_counts.total
    sent = _Sent()

    def running(seen: bytearray) -> Iterator[StreamChunk]:
        for i, raw in sorted(store.read_partials(info.id)):
            if 0 <= i < total and not seen[i]:
                chunk = sent.step(i, Result.model_validate_json(raw), final=False)
                if chunk is not None:
                    yield chunk

    def final(i: int, raw: bytes) -> StreamChunk:
        chunk = sent.step(i, Result.model_validate_json(raw), final=True)
        assert chunk is not None  # a final always makes a chunk
        return chunk

    return poll_batch(store, info, refresh, final, running=running, timeout=timeout,
                      poll_interval=poll_interval, max_interval=max_interval, counted="requests ended")
