"""The HTTP API's batch records in Redis: one hash per API batch, one list of ids per tenant, the set of
batches still open, and the lease that lets one replica at a time submit or finalize a batch.

The store of :class:`lmdq.api.batches.ApiBatches`, which keeps the rules: the states, what a
record that does not parse means, who may see a batch, when to submit, fail or finalize it. Redis
commands live only in a concept's store modules (tests/test_redis_boundary.py).

Records come back raw (``{field: value}`` bytes): a record is untrusted input, and ``ApiBatches``
decodes it and checks its ``tenant`` field against the caller's (another tenant's batch reads as
missing). The owner is written here, into the record and its tenant's list in one transaction, so
the two cannot disagree about whose batch it is. A batch leaves the open set in the same transaction
as the fields that end it (failed, or finalized), so a sweep never runs work for a batch already done.
"""

from __future__ import annotations

from collections.abc import Mapping

import redis
from redis.typing import EncodableT, FieldT

from lmdq.api.files import RawRecord
from lmdq.redis.keys import Keys
from lmdq.webhooks.store import queue_event

__all__ = ["ApiBatchRecords", "RawRecord"]


def _mapping(fields: Mapping[str, EncodableT]) -> dict[FieldT, EncodableT]:
    """``fields`` as the mapping type redis-py's HSET takes."""
    out: dict[FieldT, EncodableT] = {}
    out.update(fields)
    return out


class ApiBatchRecords:
    """The API batch records of one key prefix (thread-safe: redis-py clients are)."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    def index(self, tenant: str) -> str:
        """The key of the tenant's batch list (paged by :func:`lmdq.api.paging.page`)."""
        return self.keys.api_batches(tenant)

    # ---- the record -------------------------------------------------------------------------------
    def create(self, batch_id: str, tenant: str, fields: Mapping[str, EncodableT], *, ttl_s: int,
               created: float) -> None:
        """Write the record (``tenant`` plus ``fields``), list it for its tenant at score ``created``
        (sub-second, so the list keeps creation order) and mark it open, in one transaction; the
        record and the list expire after ``ttl_s``."""
        key, index = self.keys.api_batch(batch_id), self.keys.api_batches(tenant)
        with self.client.pipeline(transaction=True) as p:
            p.hset(key, mapping=_mapping({"tenant": tenant, **fields}))
            p.expire(key, ttl_s)
            p.zadd(index, {batch_id: created})
            p.expire(index, ttl_s)
            p.sadd(self.keys.api_open(), batch_id)
            p.execute()

    def read(self, batch_id: str) -> RawRecord:
        """The record's hash (empty when there is none: missing or expired)."""
        return dict(self.client.hgetall(self.keys.api_batch(batch_id)))  # type: ignore[arg-type]

    def read_many(self, batch_ids: list[str]) -> list[RawRecord]:
        """Each id's record, in order, in one round trip (a page of a list)."""
        with self.client.pipeline(transaction=False) as p:
            for i in batch_ids:
                p.hgetall(self.keys.api_batch(i))
            return [dict(raw) for raw in p.execute()]

    def update(self, batch_id: str, fields: Mapping[str, EncodableT]) -> None:
        """Set ``fields`` of the record (the batch stays open)."""
        self.client.hset(self.keys.api_batch(batch_id), mapping=_mapping(fields))

    def set_once(self, batch_id: str, field: str, value: EncodableT) -> bool:
        """Set ``field`` unless it is set already (HSETNX: the first cancel request's time stays);
        True when this call set it."""
        return bool(self.client.hsetnx(self.keys.api_batch(batch_id), field, value))

    def has_field(self, batch_id: str, field: str) -> bool:
        """Whether the record has ``field``."""
        return bool(self.client.hexists(self.keys.api_batch(batch_id), field))

    def field(self, batch_id: str, field: str) -> bytes | None:
        """One field's raw value (None: not set)."""
        raw = self.client.hget(self.keys.api_batch(batch_id), field)
        return raw if isinstance(raw, bytes) or raw is None else str(raw).encode()

    def count_run(self, batch_id: str) -> int:
        """Add one to the record's ``runs`` (submissions started) and return the new count."""
        return int(self.client.hincrby(self.keys.api_batch(batch_id), "runs", 1))

    def finish(self, batch_id: str, fields: Mapping[str, EncodableT], *,
               event: tuple[str, str, str, float] | None = None) -> None:
        """Set the ``fields`` that end the batch (failed, or finalized) and take it off the open set, in
        one transaction; with ``event`` (kind, url, tenant, now), its webhook event too (issue 48: announced
        with the state it tells of, never without it, never twice: lmdq.webhooks.store.queue_event)."""
        with self.client.pipeline(transaction=True) as p:
            p.hset(self.keys.api_batch(batch_id), mapping=_mapping(fields))
            p.srem(self.keys.api_open(), batch_id)
            if event is not None:
                kind, url, tenant, now = event
                queue_event(p, self.keys, batch_id=batch_id, kind=kind, url=url, tenant=tenant, now=now)
            p.execute()

    # ---- the open set -------------------------------------------------------------------------------
    def open_ids(self) -> list[str]:
        """The ids of the batches not yet final."""
        return [x.decode() for x in self.client.smembers(self.keys.api_open())]  # type: ignore[union-attr]

    def open_records(self, batch_ids: list[str]) -> list[tuple[RawRecord, bool]]:
        """Each id's ``(record, leased)``, in order, in one round trip: what a sweep decides from."""
        with self.client.pipeline(transaction=False) as p:
            for i in batch_ids:
                p.hgetall(self.keys.api_batch(i))
                p.exists(self.keys.api_lease(i))
            got = p.execute()
        return [(dict(raw), bool(leased)) for raw, leased in zip(got[0::2], got[1::2])]

    def drop_open(self, batch_ids: list[str]) -> None:
        """Take ``batch_ids`` (ended, failed or gone) off the open set."""
        if batch_ids:
            self.client.srem(self.keys.api_open(), *batch_ids)

    # ---- the lease ----------------------------------------------------------------------------------
    def take_lease(self, batch_id: str, token: str, ttl_s: int) -> bool:
        """Hold the batch's lease as ``token`` for ``ttl_s`` (SET NX EX); False: another replica holds it."""
        return bool(self.client.set(self.keys.api_lease(batch_id), token, nx=True, ex=ttl_s))

    def renew_lease(self, batch_id: str, token: str, ttl_s: int) -> None:
        """Give the lease ``ttl_s`` more, while ``token`` still holds it (a long validation or write)."""
        if self.client.get(self.keys.api_lease(batch_id)) == token.encode():
            self.client.expire(self.keys.api_lease(batch_id), ttl_s)

    def drop_lease(self, batch_id: str, token: str, *, hold_s: int = 0) -> None:
        """Release the lease if ``token`` still holds it; with ``hold_s``, keep it that long instead (the
        caller's back-off before another replica may re-run the work)."""
        if self.client.get(self.keys.api_lease(batch_id)) == token.encode():
            if hold_s:
                self.client.expire(self.keys.api_lease(batch_id), hold_s)
            else:
                self.client.delete(self.keys.api_lease(batch_id))
