"""``results --follow``: each result written as it is stored, until the batch ends.

Which results are new is found without a change log: the batch's counters say how many final
results exist (``done``), so a poll knows how many it has not written yet and scans the requests
it has not written, lowest index first, only until it has found that many. Jobs are claimed in
queue order, so new results sit near the front of what is left and a poll reads little; its cost
is bounded by the requests still outstanding, never by the batch. With a results sink a finished
job's records leave Redis for its shard (:mod:`lmdq.results.sink`): a poll first reads the shard index and
takes new shards' records from there.

Finish order (the default) writes results as polls find them. ``in_order`` writes input order and
holds back only what must wait: request ``i`` is written as soon as every request before it is,
never later; what arrived early waits in Redis (or in the shard lines just read), not in a buffer
of the whole batch. When the batch ends, whatever was not written yet is (a request with no
record at all, which a purge could cause, is skipped as ``results`` skips it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from lmdq.contract import Batch
from lmdq.producer.progress import BatchProgress
from lmdq.results.sink import _read_shard, read_index
from lmdq.results.sink import iter_records as iter_all_records
from lmdq.results.store import ResultStore

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
        self.store = store
        self.batch_id = batch.id
        self.total = batch.request_counts.total
        self.results_url = batch.results_url
        self.in_order = in_order
        self.written = bytearray(self.total)  # 1: that request's record has been returned
        self.n_written = 0
        self.next = 0  # in order: the first index not written; finish order: the first maybe not written
        self.finished = False
        self._held: dict[int, bytes] = {}  # in order: shard lines of requests that must wait
        self._sealed_jobs: set[int] = set()  # shards already read
        self._index_len = 0

    def poll(self, b: Batch) -> list[bytes]:
        """New final records since the last poll (see the class doc)."""
        if self.finished:
            return []
        out = self._in_order() if self.in_order else self._finish_order(b.request_counts.done)
        if b.status.terminal:
            out.extend(self._rest(b))
            self.finished = True
        return out

    # ---- finish order ---------------------------------------------------------------------
    def _finish_order(self, done: int) -> list[bytes]:
        need = done - self.n_written
        if need <= 0:
            return []
        out = self._from_new_shards()
        need -= len(out)
        pos = self.next
        while need > 0:
            idx = self._unwritten(pos, CHUNK)
            if not idx:
                break
            pos = idx[-1] + 1
            for i, raw in zip(idx, self.store.finals(self.batch_id, idx)):
                if raw is not None:
                    out.append(self._take(i, raw))
                    need -= 1
        return out

    def _unwritten(self, start: int, n: int) -> list[int]:
        """Up to ``n`` indices from ``start`` whose record was not written; moves :attr:`next` past a
        written prefix."""
        w = self.written
        first = w.find(0, start)
        if start == self.next:
            self.next = first if first >= 0 else self.total
        out: list[int] = []
        i = first
        while 0 <= i < self.total and len(out) < n:
            out.append(i)
            i = w.find(0, i + 1)
        return out

    def _from_new_shards(self) -> list[bytes]:
        """Records of jobs sealed into their shard since the last look, not written yet."""
        if not self.results_url:
            return []
        client, keys = self.store.client, self.store.keys
        n = int(client.hlen(keys.shards(self.batch_id)))
        if n == self._index_len:
            return []
        self._index_len = n
        out: list[bytes] = []
        base = f"{self.results_url.rstrip('/')}/{self.batch_id}"
        for job_no, entry in sorted(read_index(client, keys, self.batch_id, self.total).items()):
            if job_no in self._sealed_jobs:
                continue
            self._sealed_jobs.add(job_no)
            indices = list(entry.indices())
            if all(self.written[i] for i in indices):
                continue
            lines = _read_shard(f"{base}/{entry.shard}", indices)
            for i in indices:
                raw = lines.get(i)
                if raw is None or self.written[i]:
                    continue
                if self.in_order:
                    self._held[i] = raw  # written by _in_order once every request before it is
                else:
                    out.append(self._take(i, raw))
        return out

    # ---- input order ----------------------------------------------------------------------
    def _in_order(self) -> list[bytes]:
        out: list[bytes] = []
        looked_at_shards = False
        while self.next < self.total:
            if self.next in self._held:
                out.append(self._take(self.next, self._held.pop(self.next)))
                self.next += 1
                continue
            idx = list(range(self.next, min(self.total, self.next + CHUNK)))
            stopped = False
            for i, raw in zip(idx, self.store.finals(self.batch_id, idx)):
                raw = raw if raw is not None else self._held.pop(i, None)
                if raw is None:
                    stopped = True
                    break
                out.append(self._take(i, raw))
                self.next = i + 1
            if not stopped:
                continue
            if looked_at_shards or not self.results_url:
                break
            looked_at_shards = True  # the missing one may be in a shard sealed since the last poll
            self._from_new_shards()
            if self.next not in self._held:
                break
        return out

    # ---- the end --------------------------------------------------------------------------
    def _rest(self, b: Batch) -> list[bytes]:
        """The batch has ended: every record not written yet, in input order (read once more only
        when some are missing, so an ordinary end costs nothing)."""
        if self.n_written >= b.request_counts.done and not self._held:
            return []
        return list(self._remaining(b))

    def _remaining(self, b: Batch) -> Iterator[bytes]:
        for i, raw in iter_all_records(self.store, b, partial=False):
            if raw is not None and not self.written[i]:
                yield self._take(i, raw)
        self._held.clear()

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
