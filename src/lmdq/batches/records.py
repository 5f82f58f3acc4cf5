"""Batch records in Redis: the one place a batch's record is written, read and moved between states.

A batch record is a hash (``Keys.batch``): ``meta`` holds the immutable :class:`~lmdq.contract.Batch`
JSON, and everything that changes after submit (status, counters, timestamps) is a field of its own,
so the results script bumps a counter atomically without rewriting the JSON
(:class:`~lmdq.redis.keys.BatchField`). The batch rules (create, stage, commit, cancel, retry) are the
ledger's (:mod:`lmdq.submission.ledger`); this module is the record they and the results share. Its Redis
commands are :class:`lmdq.batches.hashes.BatchHashes`'; what a record holds and means is decided here.

TTLs count from the END of a batch (``submit --result-ttl``, kept in the record's ``ttl`` field): while
it runs, every key of the batch has :data:`RUNNING_TTL_S` (set at commit), so a batch that runs longer
than its retention is never expired under its workers; the step that ends it (the last result, or a
cancel) sets every key of the batch to ``ttl`` from that moment (``lmdq_batch_ended`` in
:mod:`lmdq.redis.scripts`). A submit cut short keeps :data:`STAGING_TTL_S` at least, so what a killed
producer staged still goes by itself.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from typing import Any

import redis

from lmdq.batches.hashes import BatchHashes
from lmdq.contract import Batch, BatchStatus, RequestCounts
from lmdq.errors import BatchNotFound
from lmdq.redis.keys import BATCH_COUNT_FIELDS, BATCH_TIME_FIELDS, BatchField, Keys, model_count_field

__all__ = ["RUNNING_TTL_S", "STAGING_TTL_S", "BatchRecords", "staging_ttl"]

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


def _int(raw: Any) -> int:
    """A counter read from Redis (untrusted): 0 when missing or not a number."""
    try:
        return max(0, int(raw)) if raw is not None else 0
    except ValueError:
        return 0


class BatchRecords:
    """Batch records of one key prefix. All methods are safe to call from several threads.

    ``ttl_s``: how long a batch created here is kept once it ENDS (``--result-ttl``)."""

    def __init__(self, client: redis.Redis, *, keys: Keys, ttl_s: int) -> None:
        self.keys = keys
        self.ttl_s = ttl_s
        #: the records' Redis commands (this class keeps what a record holds and which moves are allowed)
        self.hashes = BatchHashes(client, keys=keys)

    def create(self, batch: Batch, *, extra: Mapping[str, str] | None = None) -> None:
        """Write a new batch record (status and counters as live hash fields), in one transaction.

        ``ttl`` (this store's TTL: how long the batch is kept once it ENDS) is recorded beside it; the key
        itself has the staging TTL until the commit. ``extra``: more fields (the idempotency fingerprint)."""
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
        self.hashes.write(batch.id, fields, created_at=batch.created_at, ttl_s=staging_ttl(self.ttl_s))

    def get(self, batch_id: str) -> Batch:
        raw = self.hashes.read(batch_id)
        if not raw:
            raise BatchNotFound(batch_id)
        return self._decode(raw)

    def get_many(self, batch_ids: Iterable[str]) -> list[Batch]:
        return [self._decode(r) for r in self.hashes.read_many(list(batch_ids)) if r]

    @staticmethod
    def _decode(raw: Mapping[Any, Any]) -> Batch:
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

    def newest(self, limit: int = 20) -> list[Batch]:
        return self.get_many(self.hashes.newest_ids(limit))

    def transition(
        self, batch_id: str, from_: Iterable[BatchStatus], to: BatchStatus, stamp: BatchField | str = ""
    ) -> str | None:
        """Move a batch from one of ``from_`` to ``to`` atomically; returns the status now held.

        ``stamp`` (a time field such as ``BatchField.cancelling_at``) is set to now with the move."""
        return self.hashes.transition(batch_id, [s.value for s in from_], to.value, stamp=str(stamp), now=time.time(),
                                      ttl_s=self.ttl_s, terminal=to.terminal)
