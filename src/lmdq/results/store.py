"""The results store: per-request results and partials in Redis.

Exactly-once results come from one rule: a final result is written with HSETNX on its request
index, in the same Lua script that bumps the batch counters. A duplicate (a re-run after a
worker was presumed dead, a late write from that worker) is a no-op, so counts never drift and
output never duplicates, however often a request executes. With a results sink a job's records
leave the hash once they are in its shard (:mod:`lmdq.results.sink`); the request's bit in the batch's
``sealed`` bitmap then refuses the write HSETNX alone would accept.

Every key a worker creates here takes what is left of the batch record's TTL, so a batch's keys
expire together; a write for a batch with no record (purged, expired) is refused, so it cannot bring
back counters without a TTL. The last result of a batch ends it (``lmdq_batch_ended``): the batch's
record and its TTL rules are :mod:`lmdq.batches.records`', which :attr:`ResultStore.batches` reads.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import redis

from lmdq.batches.records import BatchRecords
from lmdq.contract import Result, ResultStatus
from lmdq.errors import BatchNotFound
from lmdq.redis.keys import BatchField, Keys
from lmdq.results.records import ResultRecords, ResultWrite
from lmdq.settings import DEFAULT_RESULT_TTL_S

__all__ = ["ResultStore"]

F = BatchField

_STATUS_COUNTER = {
    ResultStatus.completed: F.completed,
    ResultStatus.failed: F.failed,
    ResultStatus.cancelled: F.cancelled,
    ResultStatus.expired: F.expired,
}


class ResultStore:
    """Results of batches. All methods are safe to call from several threads.

    :attr:`batches` is the batches' records (:class:`lmdq.batches.records.BatchRecords`, with the same
    key prefix and TTL): a result is written against its batch's record and read with it."""

    def __init__(self, client: redis.Redis, *, keys: Keys | None = None,
                 ttl_s: int = DEFAULT_RESULT_TTL_S) -> None:
        self.client = client
        self.keys = keys or Keys()
        self.ttl_s = ttl_s
        self.batches = BatchRecords(client, keys=self.keys, ttl_s=ttl_s)
        #: the stored records (:mod:`lmdq.results.records`): this class keeps the rules, that one the calls
        self.records = ResultRecords(client, keys=self.keys)

    # ---- results -------------------------------------------------------------------------
    def _final(self, result: Result) -> ResultWrite:
        """What the results script takes for ``result`` (its status picks the counter it bumps)."""
        return (result.batch_id, result.index, result.model_dump_json(), _STATUS_COUNTER[result.status].value,
                time.time(), self.ttl_s, max(0, result.generate_token_len), result.model or "")

    def write_result(self, result: Result, pipe: Any | None = None) -> bool:
        """Store a final result once. Returns False when this request already had one."""
        return self.records.write_final(self._final(result), pipe=pipe)

    def write_results_each(self, results: list[Result]) -> list[bool]:
        """Write final results in one pipelined round trip; per result, whether it was new.

        The same script and rules as :meth:`write_result`, one call per result: what a pipeline saves is
        the round trip per result (about half of Redis' CPU per request when workers write one at a time)."""
        return self.records.write_finals([self._final(r) for r in results])

    def write_results(self, results: Iterable[Result], chunk: int = 1000) -> int:
        """Write many final results pipelined, ``chunk`` per round trip; returns how many were new."""
        new = 0
        batch: list[Result] = []
        for r in results:
            batch.append(r)
            if len(batch) >= chunk:
                new += sum(self.write_results_each(batch))
                batch.clear()
        return new + sum(self.write_results_each(batch))

    def write_partial(self, result: Result) -> bool:
        """Store in-progress text for a request that has no final result yet."""
        return self.records.write_partial(result.batch_id, result.index, result.model_dump_json(), self.ttl_s)

    def iter_results(
        self, batch_id: str, total: int | None = None, *, partial: bool = True
    ) -> Iterator[tuple[int, bytes | None]]:
        """(index, raw JSON or None) for the first ``total`` requests (default: all), in input order,
        wherever each record is: Redis, or its job's shard once sealed. Missing finals fall back to the
        partial record when ``partial`` is set. The one reader's (:class:`lmdq.results.reader.ResultReader`)
        shortcut for callers that know the batch by its id; a batch without a record reads Redis only
        (its shard index, if it ever had one, expired or was purged with it)."""
        from lmdq.results.reader import ResultReader

        try:
            b = self.batches.get(batch_id)
        except BatchNotFound:
            reader = ResultReader(self, batch_id, total or 0)
        else:
            reader = ResultReader.of(self, b)
        return reader.records(partial=partial, stop=total)

    def read_records(self, batch_id: str, indices: list[int], *, partial: bool
                     ) -> tuple[list[bytes | None], list[bytes | None]]:
        """The final (and, with ``partial``, in-progress) records in Redis of ``indices``, one round trip.
        Only :class:`lmdq.results.reader.ResultReader` calls this: a record may be in a shard instead."""
        return self.records.read(batch_id, indices, partial=partial)

    def index_len(self, batch_id: str) -> int:
        """Jobs in the batch's shard index (it only grows: a reader re-reads it when this changed)."""
        return self.records.index_len(batch_id)

    def index_items(self, batch_id: str) -> Iterator[tuple[Any, Any]]:
        """The batch's shard index as raw (job number, entry) pairs from Redis (untrusted:
        :func:`lmdq.results.shards.read_index` validates them)."""
        return self.records.index_items(batch_id)

    def output_tokens(self, batch_id: str) -> int:
        """Generated tokens of the batch's final results so far (the results script counts them)."""
        raw = self.records.output_tokens_field(batch_id)
        try:
            return max(0, int(raw)) if raw is not None else 0
        except ValueError:  # read from Redis: untrusted
            return 0

    def partial_count(self, batch_id: str) -> int:
        return self.records.partial_count(batch_id)
