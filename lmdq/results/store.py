"""The results store: batches, per-request results and partials in Redis.

Exactly-once results come from one rule: a final result is written with HSETNX on its request
index, in the same Lua script that bumps the batch counters. A duplicate (a re-run after a
worker was presumed dead, a late write from that worker) is a no-op, so counts never drift and
output never duplicates, however often a request executes. With a results sink a job's records
leave the hash once they are in its shard (:mod:`lmdq.results.sink`); the request's bit in the batch's
``sealed`` bitmap then refuses the write HSETNX alone would accept.

Every key a worker creates here takes what is left of the batch record's TTL, so a batch's keys
expire together; a write for a batch with no record (purged, expired) is refused, so it cannot bring
back counters without a TTL.

TTLs count from the END of a batch (``submit --result-ttl``, kept in the record's ``ttl`` field): while
it runs, every key of the batch has :data:`RUNNING_TTL_S` (set at commit), so a batch that runs longer
than its retention is never expired under its workers; the step that ends it (the last result, or a
cancel) sets every key of the batch to ``ttl`` from that moment (``lmdq_batch_ended``). A submit cut
short keeps :data:`STAGING_TTL_S` at least, so what a killed producer staged still goes by itself.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import redis
from rq.job import Job

from lmdq.contract import Batch, BatchStatus, RequestCounts, Result, ResultStatus
from lmdq.errors import BatchNotFound
from lmdq.redis import scripts
from lmdq.redis.keys import (
    BATCH_COUNT_FIELDS,
    BATCH_TIME_FIELDS,
    BatchField,
    Keys,
    model_count_field,
)
from lmdq.redis.replies import reply_text
from lmdq.settings import DEFAULT_RESULT_TTL_S

_JOB_PREFIX = Job.redis_job_namespace_prefix

__all__ = ["RUNNING_TTL_S", "STAGING_TTL_S", "ResultStore", "staging_ttl"]

F = BatchField

RUNNING_TTL_S = 400 * 24 * 3600
"""TTL of a running batch's keys (a bound, not a retention: a batch abandoned with no worker, or stuck,
still leaves Redis by itself after this). The batch's own ``--result-ttl`` starts when it ends."""

STAGING_TTL_S = 24 * 3600
"""Least TTL of what a submit writes before its commit: a large file may take minutes to stage, longer
than a short ``--result-ttl``; a producer killed mid-submit leaves nothing for longer than this."""


def staging_ttl(ttl_s: int) -> int:
    """The TTL of keys a submit writes before its commit (see :data:`STAGING_TTL_S`)."""
    return max(int(ttl_s), STAGING_TTL_S)









_STATUS_COUNTER = {
    ResultStatus.completed: F.completed,
    ResultStatus.failed: F.failed,
    ResultStatus.cancelled: F.cancelled,
    ResultStatus.expired: F.expired,
}


def _int(raw: Any) -> int:
    """A counter read from Redis (untrusted): 0 when missing or not a number."""
    try:
        return max(0, int(raw)) if raw is not None else 0
    except ValueError:
        return 0


class ResultStore:
    """Batches and their results. All methods are safe to call from several threads."""

    def __init__(self, client: redis.Redis, *, keys: Keys | None = None,
                 ttl_s: int = DEFAULT_RESULT_TTL_S) -> None:
        self.client = client
        self.keys = keys or Keys()
        self.ttl_s = ttl_s
        self._write_result = scripts.WRITE_RESULT.bind(client)
        self._write_partial = scripts.WRITE_PARTIAL.bind(client)
        self._transition = scripts.TRANSITION.bind(client)

    # ---- batches -------------------------------------------------------------------------
    def create_batch(self, batch: Batch, *, extra: Mapping[str, str] | None = None) -> None:
        """Write a new batch record (status and counters as live hash fields), in one transaction.

        ``ttl`` (this store's TTL: how long the batch is kept once it ENDS) is recorded beside it; the key
        itself has the staging TTL until the commit. ``extra``: more fields (the idempotency fingerprint)."""
        key = self.keys.batch(batch.id)
        # prefix_groups only when set: a batch in input order stays readable by workers older than the field
        quiet = set() if batch.prefix_groups else {"prefix_groups"}
        if batch.model_counts is None:  # one model: the record a single-model lmdq wrote
            quiet.add("model_counts")
        live = {"status", "request_counts", *(f.value for f in BATCH_TIME_FIELDS)}
        meta = batch.model_dump_json(exclude=live | quiet)
        fields: dict[Any, str | int | float] = {
            F.meta.value: meta, F.status.value: batch.status.value, F.total.value: batch.request_counts.total
        }
        for f in BATCH_COUNT_FIELDS:
            fields[f.value] = 0
        if batch.expires_at is not None:
            fields[F.expires_at.value] = batch.expires_at
        fields[F.ttl.value] = int(self.ttl_s)
        if batch.idempotency_key:
            fields[F.idempotency.value] = self.keys.idempotency(batch.idempotency_key)
        fields.update(extra or {})
        with self.client.pipeline(transaction=True) as p:
            p.hset(key, mapping=fields)
            p.expire(key, staging_ttl(self.ttl_s))
            p.zadd(self.keys.batches(), {batch.id: batch.created_at})
            p.execute()

    def get_batch(self, batch_id: str) -> Batch:
        raw = self.client.hgetall(self.keys.batch(batch_id))
        if not raw:
            raise BatchNotFound(batch_id)
        return self._decode_batch(raw)

    def get_batches(self, batch_ids: Iterable[str]) -> list[Batch]:
        ids = list(batch_ids)
        with self.client.pipeline(transaction=False) as p:
            for b in ids:
                p.hgetall(self.keys.batch(b))
            raws = p.execute()
        return [self._decode_batch(r) for r in raws if r]

    @staticmethod
    def _decode_batch(raw: Mapping[Any, Any]) -> Batch:
        data = json.loads(raw[F.meta.value.encode()])
        data["status"] = raw[F.status.value.encode()].decode()
        counts = {F.total.value: int(raw.get(F.total.value.encode(), b"0"))}
        for f in BATCH_COUNT_FIELDS:
            counts[f.value] = int(raw.get(f.value.encode(), b"0"))
        data["request_counts"] = RequestCounts(**counts)
        if data.get("model_counts"):  # totals from the record, the rest from the per-model counters
            data["model_counts"] = {
                m: RequestCounts(total=int(c.get("total", 0)) if isinstance(c, dict) else 0,
                                 **{f.value: _int(raw.get(model_count_field(m, f.value).encode()))
                                    for f in BATCH_COUNT_FIELDS})
                for m, c in data["model_counts"].items()
            }
        for f in BATCH_TIME_FIELDS:
            v = raw.get(f.value.encode())
            if v is not None:
                data[f.value] = float(v)
        return Batch.model_validate(data)

    def list_batches(self, limit: int = 20) -> list[Batch]:
        newest = self.client.zrevrange(self.keys.batches(), 0, limit - 1)
        ids = [reply_text(b) for b in newest if isinstance(b, (bytes, str))]
        return self.get_batches(ids)

    def transition(
        self, batch_id: str, from_: Iterable[BatchStatus], to: BatchStatus, stamp: BatchField | str = ""
    ) -> str | None:
        """Move a batch from one of ``from_`` to ``to`` atomically; returns the status now held.

        ``stamp`` (a time field such as ``BatchField.cancelling_at``) is set to now with the move."""
        res = self._transition(
            keys=[self.keys.batch(batch_id)],
            args=[",".join(s.value for s in from_), to.value, str(stamp), time.time(), self.ttl_s,
                  "1" if to.terminal else "0"],
        )
        return res.decode() if isinstance(res, bytes) else res

    # ---- results -------------------------------------------------------------------------
    def write_result(self, result: Result, pipe: Any | None = None) -> bool:
        """Store a final result once. Returns False when this request already had one."""
        counter = _STATUS_COUNTER[result.status]
        out = self._write_result(
            keys=[
                self.keys.results(result.batch_id),
                self.keys.batch(result.batch_id),
                self.keys.partials(result.batch_id),
                self.keys.sealed(result.batch_id),
            ],
            args=[result.index, result.model_dump_json(), counter.value, time.time(), self.ttl_s,
                  max(0, result.generate_token_len), result.model or ""],
            client=pipe,
        )
        return bool(out) if pipe is None else True

    def write_results_each(self, results: list[Result]) -> list[bool]:
        """Write final results in one pipelined round trip; per result, whether it was new.

        The same script and rules as :meth:`write_result`, one call per result: what a pipeline saves is
        the round trip per result (about half of Redis' CPU per request when workers write one at a time)."""
        if not results:
            return []
        with self.client.pipeline(transaction=False) as p:
            for r in results:
                self.write_result(r, pipe=p)
            return [bool(x) for x in p.execute()]

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
        return bool(
            self._write_partial(
                keys=[self.keys.results(result.batch_id), self.keys.partials(result.batch_id),
                      self.keys.sealed(result.batch_id), self.keys.batch(result.batch_id)],
                args=[result.index, result.model_dump_json(), self.ttl_s],
            )
        )

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
            b = self.get_batch(batch_id)
        except BatchNotFound:
            reader = ResultReader(self, batch_id, total or 0)
        else:
            reader = ResultReader.of(self, b)
        return reader.records(partial=partial, stop=total)

    def read_records(self, batch_id: str, indices: list[int], *, partial: bool
                     ) -> tuple[list[bytes | None], list[bytes | None]]:
        """The final (and, with ``partial``, in-progress) records in Redis of ``indices``, one round trip.
        Only :class:`lmdq.results.reader.ResultReader` calls this: a record may be in a shard instead."""
        with self.client.pipeline(transaction=False) as p:
            p.hmget(self.keys.results(batch_id), indices)
            if partial:
                p.hmget(self.keys.partials(batch_id), indices)
            got = p.execute()
        finals: list[bytes | None] = [v if isinstance(v, bytes) else None for v in got[0]]
        partials: list[bytes | None] = [None] * len(indices)
        if partial:
            partials = [v if isinstance(v, bytes) else None for v in got[1]]
        return finals, partials

    def index_len(self, batch_id: str) -> int:
        """Jobs in the batch's shard index (it only grows: a reader re-reads it when this changed)."""
        return int(self.client.hlen(self.keys.shards(batch_id)))

    def index_items(self, batch_id: str) -> Iterator[tuple[Any, Any]]:
        """The batch's shard index as raw (job number, entry) pairs from Redis (untrusted:
        :func:`lmdq.results.shards.read_index` validates them)."""
        yield from self.client.hscan_iter(self.keys.shards(batch_id), count=1000)

    def output_tokens(self, batch_id: str) -> int:
        """Generated tokens of the batch's final results so far (the results script counts them)."""
        raw = self.client.hget(self.keys.batch(batch_id), F.output_tokens.value)
        try:
            return max(0, int(raw)) if raw is not None else 0
        except ValueError:  # read from Redis: untrusted
            return 0

    def partial_count(self, batch_id: str) -> int:
        return int(self.client.hlen(self.keys.partials(batch_id)))
