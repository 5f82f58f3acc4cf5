"""``results --follow``: each result written as it is stored, until the batch ends.

Which results are new is found without a change log: the batch's counters say how many final
results exist (``done``), so a poll knows how many it has not written yet and scans the requests
it has not written, lowest index first, only until it has found that many. Jobs are claimed in
queue order, so new results sit near the front of what is left and a poll reads little; its cost
is bounded by the requests still outstanding, never by the batch. Records are read through the one
reader (:class:`lmdq.results.reader.ResultReader`), so with a results sink the records a finished
job moved to its shard are found there, as ``results`` finds them.

Finish order (the default) writes results as polls find them. ``in_order`` writes input order and
holds back only what must wait: request ``i`` is written as soon as every request before it is,
never later; what arrived early waits where it is stored (Redis or its shard), not in a buffer of
the whole batch. When the batch ends, whatever was not written yet is (a request with no record at
all, which a purge could cause, is skipped as ``results`` skips it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from lmdq.contract import Batch
from lmdq.results.reader import ResultReader
from lmdq.results.store import ResultStore
from lmdq.submission.progress import BatchProgress

__all__ = ["FOLLOW_POLL_S", "Follower", "follow"]

CHUNK = 1000
"""Request indices read per round trip."""

FOLLOW_POLL_S = 0.25
"""Seconds between polls of a followed batch (a poll that finds nothing new costs one HGETALL)."""


class Follower:
    """Finds the final results of one batch that were not written yet, poll after poll.

    :meth:`poll` takes the batch as just read (its counters and status) and returns the new records
    (raw JSON, as the store holds them) in the order to write them; once it is given an ended batch
    it returns the rest and :attr:`finished` turns True.
    """

    def __init__(self, store: ResultStore, batch: Batch, *, in_order: bool = False) -> None:
        self.reader = ResultReader.of(store, batch, chunk=CHUNK)
        self.total = batch.request_counts.total
        self.in_order = in_order
        self.written = bytearray(self.total)  # 1: that request's record has been returned
        self.n_written = 0
        self.next = 0  # in order: the first index not written; finish order: the first maybe not written
        self.finished = False

    def poll(self, b: Batch) -> list[bytes]:
        """New final records since the last poll (see the class doc)."""
        if self.finished:
            return []
        out = self._in_order() if self.in_order else self._finish_order(b.request_counts.done)
        if b.status.terminal:
            out.extend(self._rest(b))
            self.finished = True
        return out

    def _finish_order(self, done: int) -> list[bytes]:
        need = done - self.n_written
        if need <= 0:
            return []
        first = self.written.find(0, self.next)
        self.next = first if first >= 0 else self.total
        return [self._take(i, raw) for i, raw in self.reader.new_finals(self.written, need, start=self.next)]

    def _in_order(self) -> list[bytes]:
        out: list[bytes] = []
        while self.next < self.total:
            idx = list(range(self.next, min(self.total, self.next + CHUNK)))
            for i, raw in zip(idx, self.reader.finals(idx)):
                if raw is None:
                    return out
                out.append(self._take(i, raw))
                self.next = i + 1
        return out

    def _rest(self, b: Batch) -> list[bytes]:
        """The batch has ended: every record not written yet, in input order (read once more only
        when some are missing, so an ordinary end costs nothing)."""
        if self.n_written >= b.request_counts.done:
            return []
        return [self._take(i, raw) for i, raw in self.reader.records(partial=False)
                if raw is not None and not self.written[i]]

    def _take(self, i: int, raw: bytes) -> bytes:
        self.written[i] = 1
        self.n_written += 1
        return raw


def follow(
    follower: Follower,
    first: Batch,
    get: Callable[[], Batch],
    write: Callable[[bytes], None],
    *,
    progress: BatchProgress | None = None,
    on_poll: Callable[[], None] | None = None,
    deadline: float | None = None,
    poll_s: float = FOLLOW_POLL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Batch:
    """Write the batch's results as they are stored (``write`` is called per record, then flushed by
    the caller's writer) until it ends or ``deadline`` passes; returns the last batch seen."""
    b = first
    while True:
        for raw in follower.poll(b):
            write(raw)
        if on_poll is not None:
            on_poll()  # e.g. flush: a reader of the output file sees each poll's results at once
        if progress is not None:
            progress.update(b)
        if follower.finished:
            return b
        if deadline is not None and clock() >= deadline:
            return b
        sleep(poll_s)
        b = get()
