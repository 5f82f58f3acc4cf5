"""The ONE reader of a batch's results: every export, follower and retry goes through it.

A request's final record lives in one of two places: the batch's results hash in Redis, or (once
its job is sealed, :mod:`lmdq.results.sink`) a line of its job's shard under the batch's results
URL, found through the per-batch shard index. The seal moves a job's records from the first to the
second in ONE Lua call (index entry in, records out), so a reader that asks Redis first and the
index AFTER finds every record in one place or the other: a record missing from Redis whose job
was sealed before that read is in an index read after it. :class:`ResultReader` keeps that order on
every read, and re-reads the index only when it has grown (one HLEN), so a batch being sealed
while it is read (a running batch, ``results --follow``) is read complete, never with holes.

Every path that reads results uses this class: ``lmdq-producer results`` (lmdq JSONL and OpenAI
lines, :mod:`lmdq.results.export`, :mod:`lmdq.results.openai`), ``results --follow``
(:mod:`lmdq.submission.follow`), ``Batch.results`` / ``to_arrow`` / ``to_parquet`` /
``as_completed`` (:mod:`lmdq.client.client`), the HTTP API's output files, ``retry`` (the ledger) and
``ResultStore.iter_results``.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from lmdq.contract import Batch
from lmdq.errors import ResultsUnavailable
from lmdq.results.shards import ShardEntry, read_index, read_shard

if TYPE_CHECKING:
    from lmdq.results.store import ResultStore

__all__ = ["CHUNK", "ResultReader"]

CHUNK = 2000
"""Request indices read per Redis round trip."""


class ResultReader:
    """Reads one batch's records from Redis and from its sealed shards alike (see the module doc).

    One reader may serve many reads (a follower's polls): the shard index it has seen and the shards
    it has open are kept between them. Not thread-safe: one reader per reading thread.
    """

    def __init__(self, store: ResultStore, batch_id: str, total: int, results_url: str | None = None, *,
                 chunk: int = CHUNK) -> None:
        self.store = store
        self.batch_id = batch_id
        self.total = max(0, int(total))
        self.results_url = results_url or None
        self.chunk = max(1, chunk)
        self._base = f"{results_url.rstrip('/')}/{batch_id}" if results_url else ""
        self._entries: dict[int, ShardEntry] = {}
        self._owner = array("l", [-1]) * self.total if self.results_url else array("l")
        self._index_len = 0
        self._open: dict[int, dict[int, bytes]] = {}  # job -> its shard's lines, while some are still to serve
        self._left: dict[int, int] = {}  # job -> its requests not served since its shard was opened

    @classmethod
    def of(cls, store: ResultStore, batch: Batch, *, chunk: int = CHUNK) -> ResultReader:
        """The reader of ``batch`` (its total and results URL as its record holds them)."""
        return cls(store, batch.id, batch.request_counts.total, batch.results_url, chunk=chunk)

    # ---- reads ------------------------------------------------------------------------------
    def records(self, *, partial: bool = True, need: Callable[[ShardEntry], bool] | None = None,
                stop: int | None = None) -> Iterator[tuple[int, bytes | None]]:
        """(index, full record or None) for every request below ``stop`` (default: all), in input order.

        A request with no final record gives its in-progress record when ``partial`` is set, else
        None. ``need`` skips shards: a sealed job whose entry it rejects yields None for its requests
        without its shard being read (``retry`` reads only shards that hold failures)."""
        end = self.total if stop is None else max(0, min(self.total, stop))
        for start in range(0, end, self.chunk):
            idx = list(range(start, min(end, start + self.chunk)))
            finals, partials = self.store.read_records(self.batch_id, idx, partial=partial)
            from_shards = self._in_shards(idx, finals, need)
            for k, i in enumerate(idx):
                raw = finals[k]
                if raw is None:
                    raw = from_shards.get(i) if self._owner_of(i) >= 0 else partials[k]
                yield i, raw

    def finals(self, indices: list[int]) -> list[bytes | None]:
        """The final records of ``indices`` (None where a request has none yet), wherever they are."""
        if not indices:
            return []
        got, _ = self.store.read_records(self.batch_id, indices, partial=False)
        from_shards = self._in_shards(indices, got, None)
        return [raw if raw is not None else from_shards.get(i) for i, raw in zip(indices, got)]

    def new_finals(self, seen: bytearray, need: int, *, start: int = 0) -> Iterator[tuple[int, bytes]]:
        """(index, final record) of up to ``need`` requests at or after ``start`` whose ``seen`` byte is
        0, lowest index first: what a follower has not written yet. It reads only the requests not seen
        and stops once it found ``need``, so a poll costs what is outstanding, never the batch."""
        found = 0
        pos = seen.find(0, max(0, start))
        while found < need and 0 <= pos < self.total:
            idx: list[int] = []
            while 0 <= pos < self.total and len(idx) < self.chunk:
                idx.append(pos)
                pos = seen.find(0, pos + 1)
            for i, raw in zip(idx, self.finals(idx)):
                if raw is not None:
                    yield i, raw
                    found += 1

    # ---- the shard index ----------------------------------------------------------------------
    def _owner_of(self, i: int) -> int:
        return self._owner[i] if self.results_url and 0 <= i < self.total else -1

    def _in_shards(self, idx: list[int], finals: list[bytes | None],
                   need: Callable[[ShardEntry], bool] | None) -> dict[int, bytes | None]:
        """Records of the requests in ``idx`` that Redis did not have (``finals`` is None) and a sealed
        job holds: index -> shard line (None for a job ``need`` rejects). Called AFTER the Redis read
        (the module doc says why that order is what makes the read complete)."""
        if not self.results_url:
            return {}
        missing = [i for i, raw in zip(idx, finals) if raw is None]
        if any(self._owner_of(i) < 0 for i in missing):
            self._refresh()
        out: dict[int, bytes | None] = {}
        for i in missing:
            job = self._owner_of(i)
            if job < 0:
                continue
            if need is not None and not need(self._entries[job]):
                out[i] = None
                continue
            out[i] = self._line(job, i)
        return out

    def _refresh(self) -> None:
        """Read the index again if it grew since the last read (entries are only ever added)."""
        n = self.store.index_len(self.batch_id)
        if n == self._index_len:
            return
        self._index_len = n
        for job, e in read_index(self.store, self.batch_id, self.total).items():
            if job in self._entries:
                continue
            self._entries[job] = e
            for lo, hi in e.ranges:
                self._owner[lo : hi + 1] = array("l", [job]) * (hi - lo + 1)

    def _line(self, job: int, i: int) -> bytes:
        """Request ``i``'s line of job ``job``'s shard; the shard is read once and kept until each of
        its requests was served (jobs of consecutive requests keep one shard open at a time)."""
        entry = self._entries[job]
        uri = f"{self._base}/{entry.shard}"
        lines = self._open.get(job)
        if lines is None:
            indices = list(entry.indices())
            lines = self._open[job] = read_shard(uri, indices)
            self._left[job] = len(indices)
        self._left[job] -= 1
        if self._left[job] <= 0:
            del self._open[job], self._left[job]
        try:
            return lines[i]
        except KeyError:
            raise ResultsUnavailable(f"results shard {uri} has no record for request index {i}") from None
