"""Batch records in Redis: the one place a batch's record is written, read and moved between states.

A batch record is a hash (``Keys.batch``): ``meta`` holds the immutable :class:`~lmdq.contract.Batch`
JSON, and everything that changes after submit (status, counters, timestamps) is a field of its own,
so the results script bumps a counter atomically without rewriting the JSON
(:class:`~lmdq.redis.keys.BatchField`). The batch rules (create, stage, commit, cancel, retry) are the
ledger's (:mod:`lmdq.submission.ledger`); this module is the record they and the results share: what a
record holds and means (:class:`BatchRecords`), and the batches' store beside it (:class:`BatchHashes`:
the Redis commands and Lua of the batch hash, the listing of batches by creation time, ``Keys.batches``,
and the set of cancelled batches, ``Keys.cancelled``; tests/test_redis_boundary.py). The store hands
replies back raw (untrusted: :class:`BatchRecords` and the ledger decode and check them); a status move
is the ``transition`` script, so two writers never interleave a read and a write.

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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from rq.registry import FailedJobRegistry, FinishedJobRegistry

from lmdq.contract import Batch, BatchStatus, RequestCounts
from lmdq.errors import BatchNotFound
from lmdq.redis.keys import BATCH_COUNT_FIELDS, BATCH_TIME_FIELDS, BatchField, Keys, model_count_field
from lmdq.redis.replies import reply_text
from lmdq.redis.scripts import BATCH_ENDED, LuaScript
from lmdq.webhooks.store import WEBHOOK_EVENT

__all__ = ["RUNNING_TTL_S", "STAGING_TTL_S", "BatchHashes", "BatchRecords", "Deleted", "staging_ttl"]

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
        if batch.reuse_ttl_s is None:  # a batch without reuse: the record an lmdq before issue 47 wrote
            quiet.add("reuse_ttl_s")
        if batch.webhook is None:  # a batch without a webhook: the record an lmdq before issue 48 wrote
            quiet |= {"webhook", "webhook_tenant", "webhook_as"}
        elif batch.webhook_as is None:
            quiet.add("webhook_as")
        live = {"status", "request_counts", "deadline", "reusable", *(f.value for f in BATCH_TIME_FIELDS)}
        meta = batch.model_dump_json(exclude=live | quiet)
        fields: dict[Any, str | int | float] = {
            F.meta.value: meta, F.status.value: batch.status.value, F.total.value: batch.request_counts.total
        }
        for f in BATCH_COUNT_FIELDS:
            fields[f.value] = 0
        if batch.expires_at is not None:
            fields[F.expires_at.value] = batch.expires_at
        if batch.deadline is not None:
            fields[F.deadline.value] = batch.deadline
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
        deadline = raw.get(F.deadline.value.encode())
        if deadline is not None:
            data["deadline"] = float(deadline)
        reusable = raw.get(F.reusable.value.encode())
        if reusable is not None:
            data["reusable"] = _int(reusable)
        return Batch.model_validate(data)

    def note_reusable(self, batch_id: str, n: int) -> None:
        """Record how many of the batch's requests the reuse index could answer at submit (issue 47)."""
        self.hashes.note(batch_id, F.reusable.value, n)

    def newest(self, limit: int = 20) -> list[Batch]:
        return self.get_many(self.hashes.newest_ids(limit))

    def transition(
        self, batch_id: str, from_: Iterable[BatchStatus], to: BatchStatus, stamp: BatchField | str = ""
    ) -> str | None:
        """Move a batch from one of ``from_`` to ``to`` atomically; returns the status now held.

        ``stamp`` (a time field such as ``BatchField.cancelling_at``) is set to now with the move."""
        return self.hashes.transition(batch_id, [s.value for s in from_], to.value, stamp=str(stamp), now=time.time(),
                                      ttl_s=self.ttl_s, terminal=to.terminal)


# ==== The store: the batch hash, the listing and the cancelled set in Redis =============================

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

    def note(self, batch_id: str, field: str, value: int) -> None:
        """Set one plain field of an existing record (never creates one: a purged batch stays gone)."""
        key = self.keys.batch(batch_id)
        with self.client.pipeline(transaction=True) as p:
            p.exists(key)
            p.hset(key, field, value)
            exists, _ = p.execute()
        if not exists:
            self.client.delete(key)

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


# ==== Lua: this module's scripts (composed and run by lmdq.redis.scripts.LuaScript) ====

# KEYS: batch. ARGV: from-status list (comma separated), to-status, timestamp field, now, ttl, to is terminal
TRANSITION = LuaScript("transition", f"""
local st = redis.call('HGET', KEYS[1], '{F.status}')
if not st then return nil end
for s in string.gmatch(ARGV[1], '[^,]+') do
  if s == st then
    redis.call('HSET', KEYS[1], '{F.status}', ARGV[2])
    if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], ARGV[3], ARGV[4]) end
    if ARGV[6] == '1' then
      lmdq_batch_ended(KEYS[1], ARGV[5])
      lmdq_webhook_event(KEYS[1], ARGV[2])
    end
    return ARGV[2]
  end
end
return st
""", uses=(BATCH_ENDED, WEBHOOK_EVENT))
