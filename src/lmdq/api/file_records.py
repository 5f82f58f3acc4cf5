"""The HTTP API's file records in Redis: one hash per file, one list of ids per tenant.

The store of :class:`lmdq.api.files.FileStore`, which keeps the content (on disk) and the
rules: what a file id looks like, what a record that does not parse means, and who may see it.
Redis commands live only in a concept's store modules (tests/test_redis_boundary.py).

Records come back raw (``{field: value}`` bytes): a record is untrusted input, and the store decodes
it and checks its ``tenant`` field against the caller's (another tenant's file reads as missing). The
owner is written here, into the record and its tenant's list in one transaction, so the two cannot
disagree about whose file it is.
"""

from __future__ import annotations

from collections.abc import Mapping

import redis
from redis.typing import EncodableT, FieldT

from lmdq.redis.keys import Keys

__all__ = ["ApiFileRecords", "RawRecord"]

RawRecord = dict[bytes, bytes]
"""A record's hash as Redis holds it (empty: no record); decoded, and trusted or not, by the caller."""


class ApiFileRecords:
    """The file records of one key prefix (thread-safe: redis-py clients are)."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    def index(self, tenant: str) -> str:
        """The key of the tenant's file list (paged by :func:`lmdq.api.paging.page`)."""
        return self.keys.api_files(tenant)

    def create(self, file_id: str, tenant: str, fields: Mapping[str, EncodableT], *, ttl_s: int,
               index_ttl_s: int, created: float) -> None:
        """Write the record (``tenant`` plus ``fields``), expiring after ``ttl_s``, and list it for its
        tenant at score ``created`` (sub-second, so the list keeps creation order), in one transaction.
        The list's TTL is pushed to ``index_ttl_s``: it outlives the longest-lived record it names."""
        key, index = self.keys.api_file(file_id), self.keys.api_files(tenant)
        record: dict[FieldT, EncodableT] = {"tenant": tenant}
        record.update(fields)
        with self.client.pipeline(transaction=True) as p:
            p.hset(key, mapping=record)
            p.expire(key, ttl_s)
            p.zadd(index, {file_id: created})
            p.expire(index, index_ttl_s)
            p.execute()

    def read(self, file_id: str) -> RawRecord:
        """The record's hash (empty when there is none: missing or expired)."""
        return dict(self.client.hgetall(self.keys.api_file(file_id)))  # type: ignore[arg-type]

    def read_many(self, file_ids: list[str]) -> list[RawRecord]:
        """Each id's record, in order, in one round trip (a page of a list)."""
        with self.client.pipeline(transaction=False) as p:
            for i in file_ids:
                p.hgetall(self.keys.api_file(i))
            return [dict(raw) for raw in p.execute()]

    def remove(self, tenant: str, file_id: str) -> None:
        """Remove the record and its entry in the tenant's list, in one transaction (the caller has
        checked that the tenant owns it)."""
        with self.client.pipeline(transaction=True) as p:
            p.delete(self.keys.api_file(file_id))
            p.zrem(self.keys.api_files(tenant), file_id)
            p.execute()

    def has_record(self, file_id: str) -> bool:
        """Whether the record is still there (the sweep keeps content only while it is)."""
        return bool(self.client.exists(self.keys.api_file(file_id)))
