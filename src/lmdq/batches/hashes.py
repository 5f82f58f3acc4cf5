"""The store of batch records: the batch hash (``Keys.batch``), the listing of batches by creation
time (``Keys.batches``) and the set of cancelled batches (``Keys.cancelled``).

Why a module of its own: what a record holds, how it is decoded and which status may follow which are
the batches' rules (:mod:`lmdq.batches.records`, :mod:`lmdq.submission.ledger`); the commands that write
and read it, and their Lua, are here, in the batches' store
(tests/test_redis_boundary.py). Replies are handed back raw (untrusted: the callers decode and check
them); a status move is the ``transition`` script, so two writers never interleave a read and a write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from rq.registry import FailedJobRegistry, FinishedJobRegistry

from lmdq.contract import BatchStatus
from lmdq.redis.keys import BatchField, Keys
from lmdq.redis.replies import reply_text
from lmdq.redis.scripts import BATCH_ENDED, LuaScript

__all__ = ["BatchHashes", "Deleted"]

_DELETE_CHUNK = 1000
"""Keys per DEL (and members per ZREM): a batch of a million jobs never builds one huge command."""


def _raw(value: Any) -> bytes | None:
    """A reply read as bytes (None stays None): a client made with ``decode_responses`` returns str."""
    if value is None or isinstance(value, bytes):
        return value
    return str(value).encode()


def _hash(value: Any) -> dict[bytes, bytes]:
    """An HGETALL reply with bytes keys and values, whatever the client's decoding."""
    if not value:
        return {}
    return {k if isinstance(k, bytes) else str(k).encode(): v if isinstance(v, bytes) else str(v).encode()
            for k, v in dict(value).items()}


@dataclass(frozen=True)
class Deleted:
    """What :meth:`BatchHashes.delete_batch` removed: the batch's own keys and its job hashes (counted apart:
    ``purge`` reports both)."""

    keys: int
    jobs: int


class BatchHashes:
    """Batch records of one key prefix, as Redis holds them (thread-safe: redis-py clients are)."""

    def __init__(self, client: redis.Redis, *, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._transition = TRANSITION.bind(client)
        self._abandon = ABANDON.bind(client)

    # ---- write --------------------------------------------------------------------------------
    def write(self, batch_id: str, fields: Mapping[str, str | int | float], *, created_at: float,
              ttl_s: int) -> None:
        """A new record: its fields, its key's TTL and its listing entry, in one MULTI/EXEC, so a reader
        never finds a listed batch without a record or a record without its TTL."""
        key = self.keys.batch(batch_id)
        mapping: dict[Any, str | int | float] = dict(fields)  # redis-py's key type is invariant
        with self.client.pipeline(transaction=True) as p:
            p.hset(key, mapping=mapping)
            p.expire(key, ttl_s)
            p.zadd(self.keys.batches(), {batch_id: created_at})
            p.execute()

    def transition(self, batch_id: str, from_: Iterable[str], to: str, *, stamp: str, now: float, ttl_s: int,
                   terminal: bool) -> str | None:
        """Move the record's status from one of ``from_`` to ``to`` in one script (``stamp``: a time field
        set to ``now`` with the move, '' for none; ``terminal``: the move ends the batch, so every key of
        it takes ``ttl_s``). Returns the status held now, None when there is no record."""
        res = self._transition(keys=[self.keys.batch(batch_id)],
                               args=[",".join(from_), to, stamp, now, ttl_s, "1" if terminal else "0"])
        return None if res is None else reply_text(res)

    def abandon(self, batch_id: str, reason: str, *, now: float, ttl_s: int) -> int:
        """Count a part-staged batch's never-visible requests as cancelled and move it to cancelling (the
        ``abandon`` script, fenced on ``staging_failed``: once). Returns the requests counted, -1 when counted
        already, -2 when the batch has no progressive record or was fully staged."""
        return int(self._abandon(keys=[self.keys.batch(batch_id), self.keys.cancelled()],
                                 args=[batch_id, reason, now, ttl_s]))

    def mark_cancelled(self, batch_id: str) -> None:
        """Add the batch to the cancelled set (workers poll it and abort what they hold)."""
        self.client.sadd(self.keys.cancelled(), batch_id)

    # ---- read ---------------------------------------------------------------------------------
    def read(self, batch_id: str) -> dict[bytes, bytes]:
        """The whole record, raw; empty when there is none."""
        return _hash(self.client.hgetall(self.keys.batch(batch_id)))

    def read_many(self, batch_ids: Sequence[str]) -> list[dict[bytes, bytes]]:
        """The records of ``batch_ids``, raw, in one round trip; an empty dict for each id without one."""
        with self.client.pipeline(transaction=False) as p:
            for b in batch_ids:
                p.hgetall(self.keys.batch(b))
            return [_hash(r) for r in p.execute()]

    def fields(self, batch_id: str, names: Sequence[str]) -> list[bytes | None]:
        """Some fields of the record, raw, in the order of ``names`` (None: missing)."""
        return [_raw(v) for v in self.client.hmget(self.keys.batch(batch_id), list(names))]

    def has_field(self, batch_id: str, name: str) -> bool:
        """Whether the record holds ``name`` (False too when there is no record)."""
        return bool(self.client.hexists(self.keys.batch(batch_id), name))

    def newest_ids(self, limit: int) -> list[str]:
        """Up to ``limit`` batch ids from the listing, newest first (decoded with replacement: untrusted)."""
        return [reply_text(b) for b in self.client.zrevrange(self.keys.batches(), 0, limit - 1)
                if isinstance(b, (bytes, str))]

    # ---- delete -------------------------------------------------------------------------------
    def delete_batch(self, batch_id: str, *, own: Sequence[str], job_keys: Sequence[str], queues: Sequence[str],
               job_ids: Sequence[str], uncancel: bool) -> Deleted:
        """Delete a batch's keys in one pipeline: ``own`` (record, results, index, job list, ...), its job
        hashes ``job_keys``, its listing entry, RQ's finished/failed records of ``job_ids`` on each of
        ``queues`` (so ``rq info`` forgets them) and, with ``uncancel``, its cancelled-set member (a batch
        that ended: nothing polls for it any more)."""
        with self.client.pipeline(transaction=False) as p:
            p.delete(*own)
            for start in range(0, len(job_keys), _DELETE_CHUNK):
                p.delete(*job_keys[start : start + _DELETE_CHUNK])
            p.zrem(self.keys.batches(), batch_id)
            if uncancel:
                p.srem(self.keys.cancelled(), batch_id)
            for q in queues:
                for reg in (FinishedJobRegistry, FailedJobRegistry):
                    key = reg(q, connection=self.client).key
                    for start in range(0, len(job_ids), _DELETE_CHUNK):
                        p.zrem(key, *job_ids[start : start + _DELETE_CHUNK])
            got = p.execute()
        chunks = (len(job_keys) + _DELETE_CHUNK - 1) // _DELETE_CHUNK
        return Deleted(keys=int(got[0]), jobs=sum(int(x) for x in got[1 : 1 + chunks]))


F = BatchField

# ==== Lua: this module's scripts (composed and run by lmdq.redis.scripts.LuaScript) ====

# A batch whose progressive staging stopped part-way: the requests never made visible count as cancelled
# (once: fenced on staging_failed) and the batch moves to cancelling (cancelled when nothing else is left).
# KEYS: batch hash, cancelled set. ARGV: batch id, reason, now, ttl. Returns the requests counted, -1 when
# counted already, -2 when the batch is fully staged (nothing to count) or has no progressive record.
ABANDON = LuaScript("abandon", f"""
if redis.call('HEXISTS', KEYS[1], '{F.staged_at}') == 1 then return -2 end
if redis.call('HEXISTS', KEYS[1], '{F.visible_jobs}') == 0 then return -2 end
if redis.call('HSETNX', KEYS[1], '{F.staging_failed}', ARGV[2]) == 0 then return -1 end
local b = redis.call('HMGET', KEYS[1], '{F.total}', '{F.visible_requests}', '{F.status}')
local unqueued = tonumber(b[1] or '0') - tonumber(b[2] or '0')
if unqueued > 0 then redis.call('HINCRBY', KEYS[1], '{F.cancelled}', unqueued) end
local st = b[3]
if st == '{BatchStatus.validating.value}' or st == '{BatchStatus.queued.value}'
   or st == '{BatchStatus.in_progress.value}' then
  redis.call('HSET', KEYS[1], '{F.status}', '{BatchStatus.cancelling.value}', '{F.cancelling_at}', ARGV[3])
  st = '{BatchStatus.cancelling.value}'
end
redis.call('SADD', KEYS[2], ARGV[1])
local c = redis.call('HMGET', KEYS[1], '{F.completed}', '{F.failed}', '{F.cancelled}', '{F.expired}')
local done = 0
for i = 1, 4 do done = done + tonumber(c[i] or '0') end
if st == '{BatchStatus.cancelling.value}' and done >= tonumber(b[1] or '0') then
  redis.call('HSET', KEYS[1], '{F.status}', '{BatchStatus.cancelled.value}', '{F.cancelled_at}', ARGV[3])
  lmdq_batch_ended(KEYS[1], ARGV[4])
end
return unqueued
""", uses=(BATCH_ENDED,))

# KEYS: batch. ARGV: from-status list (comma separated), to-status, timestamp field, now, ttl, to is terminal
TRANSITION = LuaScript("transition", f"""
local st = redis.call('HGET', KEYS[1], '{F.status}')
if not st then return nil end
for s in string.gmatch(ARGV[1], '[^,]+') do
  if s == st then
    redis.call('HSET', KEYS[1], '{F.status}', ARGV[2])
    if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], ARGV[3], ARGV[4]) end
    if ARGV[6] == '1' then lmdq_batch_ended(KEYS[1], ARGV[5]) end
    return ARGV[2]
  end
end
return st
""", uses=(BATCH_ENDED,))
