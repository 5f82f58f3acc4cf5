"""Results sink: full results in JSONL shards, Redis keeps one small index entry per JOB.

A batch with a results URL (``submit --results-url URL`` or the cluster-wide ``LMDQ_RESULTS_URL``:
a folder or ``s3://bucket/prefix``) keeps its answers out of Redis. Every final result is still
written to Redis first, through the same HSETNX + counters Lua script as any other batch, so
exactly-once and counts work unchanged. When a job ends (every request of it has a final result),
its worker:

1. reads the job's final results back from Redis, in index order;
2. writes them as ONE shard ``<URL>/<batch_id>/results-<job_no:06d>.jsonl`` (the exact bytes that
   were in Redis, one line per request) and confirms it durable: an S3 PUT checked by a HEAD of the
   right size, a folder write fsynced, renamed and its folder fsynced
   (:meth:`lmdq.results.blobs.BlobStore.put_bytes`), each bounded by ``LMDQ_SINK_TIMEOUT_S``;
3. only then, and never once its worker is past the drain deadline, in ONE Lua call
   (``SEAL_SHARD``, :func:`seal`): adds the job's :class:`ShardEntry` (shard
   name, the job's request indices as ranges, counts per status) to the batch's index hash
   (``Keys.shards``), sets the requests' bits in the batch's ``sealed`` bitmap, and DELETES their
   records from the results hash. A completed request then costs Redis one bit plus its share of
   one entry per job (~100 bytes / 32 requests), instead of a ~1 KB record.

Why the shard is built from Redis and not from what the worker holds in memory: a re-run job (the
worker died, or a request had already been answered by a previous attempt) only regenerates the
requests that have no final result, so the worker's memory holds only part of the job; Redis holds
all of it, exactly once.

Exactly once, case by case:

- crash between 2 and 3: the records are still in Redis, the index has no entry; the re-run finds
  every request answered, rewrites the same shard from the same bytes and seals it.
- crash after 3 (before the lease is released): the re-run reads the ``sealed`` bits at the start
  (:meth:`lmdq.jobs.queue.JobQueue.begin`), so it runs nothing, and finds the index entry, so it writes
  no shard.
- a late writer (a worker presumed dead that still finishes a request) after the seal: the results
  script refuses any write whose ``sealed`` bit is set, so the emptied results hash cannot take a
  second answer for it (the HSETNX alone would accept it: the field is gone).
- two flushes of one job at once: both write the same bytes to the same shard (records never
  change once written), and the seal is fenced on the index entry: the second is a no-op.

Step 3 is atomic, so a job's records are either all in Redis (shard not trusted yet, maybe absent)
or all in its shard (entry present). If the shard cannot be written (sink unreachable, full, slower
than the timeout), the full records stay in Redis and are served from there, and the job goes on a
fleet-wide retry schedule (:func:`add_pending`) that every worker's sweeper works through until the
write lands and the job is sealed (``lmdq.results.worker_sink``). The one reader
(:class:`lmdq.results.reader.ResultReader`) takes each request from Redis or from its job's shard
accordingly, in input order, whatever the job layout. The shard format and the index entry are
:mod:`lmdq.results.shards`.

The sink's store is at the end of this module (tests/test_redis_boundary.py): the shard index read, a
job's finals, the seal (``SEAL_SHARD``), and the retry schedule (a zset ``<batch id>:<job no>`` -> next
try, Redis server time, and a hash member -> the job's request ranges and tries, one pair per key
prefix, fleet-wide), each change one script call (``PENDING_ADD`` / ``PENDING_CLAIM`` / ``PENDING_DROP``)
so two sweepers never interleave. Replies are handed back raw (untrusted: the functions above validate
them).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from typing import Any

import redis
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lmdq.contract import BATCH_ID_PATTERN, JobPayload, ResultStatus
from lmdq.redis.keys import Keys
from lmdq.redis.scripts import Fragment, LuaScript
from lmdq.results.shards import MAX_ENTRY_BYTES, ShardEntry, decode_entry, shard_key
from lmdq.results.store import BATCH_TTL, OOM_GUARD
from lmdq.settings import DEFAULT_RESULT_TTL_S

__all__ = ["PendingShard", "add_pending", "claim_pending", "drop_pending", "flush_job", "flush_shard", "index_entry",
           "job_finals", "pending_add", "pending_claim_due", "pending_count", "pending_drop", "seal"]




_HEAD = re.compile(rb'\{"format_version":1,"batch_id":"[^"\\]*","custom_id":"(?:[^"\\]|\\.)*","index":\d+,'
                   rb'"status":"([a-z_]+)"')
"""The head of a record as :meth:`Result.model_dump_json` writes it (fields in declaration order, every string
escaped): its status read without parsing the rest (a 256-token answer's text is most of the line; the
reused path seals a job of 1,000 in a few ms). Anything else falls back to a full parse."""


def _status(raw: bytes) -> ResultStatus:
    m = _HEAD.match(raw)
    if m is not None:
        try:
            return ResultStatus(m.group(1).decode())
        except ValueError:
            pass
    try:
        return ResultStatus(json.loads(raw)["status"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"not a result record: {type(e).__name__}") from e


def flush_job(client: redis.Redis, keys: Keys, payload: JobPayload, *, ttl_s: int = DEFAULT_RESULT_TTL_S,
              timeout_s: float | None = None, cancel: threading.Event | None = None) -> ShardEntry | None:
    """Write the job's shard, then seal it: index entry in, per-request records out (module doc).

    Returns the job's entry (also when an earlier flush sealed it), or None when the job has no
    results URL, is not complete yet, or its batch is gone. ``ttl_s`` is only the fallback TTL for a
    batch record without one. A sink error propagates and nothing is sealed: see :func:`flush_shard`.
    """
    if not payload.results_url:
        return None
    return flush_shard(client, keys, payload.batch_id, payload.job_no, payload.results_url,
                       sorted(r.index for r in payload.requests), ttl_s=ttl_s, timeout_s=timeout_s, cancel=cancel)


def flush_shard(client: redis.Redis, keys: Keys, batch_id: str, job_no: int, results_url: str,
                indices: list[int], *, ttl_s: int = DEFAULT_RESULT_TTL_S, timeout_s: float | None = None,
                cancel: threading.Event | None = None) -> ShardEntry | None:
    """:func:`flush_job` for one job given by its batch, number, sink and (sorted) request indices:
    what a sweeper knows of a job whose shard write failed (:func:`add_pending`).

    The seal runs only after :meth:`lmdq.results.blobs.BlobStore.put_bytes` confirmed the shard durable, and
    never once ``cancel`` is set (the worker is past its drain deadline: what it has not confirmed by
    then stays in Redis). Every storage call is bounded by ``timeout_s`` (``LMDQ_SINK_TIMEOUT_S``).
    """
    from lmdq.results.blobs import BlobStore, SinkAbandoned

    bid, job = batch_id, str(job_no)
    done = index_entry(client, keys, bid, job)
    if done is not None:
        return decode_entry(done)
    got = job_finals(client, keys, bid, indices)
    if any(v is None for v in got):
        return None
    vals: list[bytes] = [v for v in got if isinstance(v, bytes)]
    key = shard_key(bid, job_no)
    entry = ShardEntry.of(key.rsplit("/", 1)[1], indices, (_status(v) for v in vals))
    BlobStore.from_url(results_url, timeout_s=timeout_s, cancel=cancel).put_bytes(
        key, b"".join(v + b"\n" for v in vals))
    if cancel is not None and cancel.is_set():
        raise SinkAbandoned(f"seal of {key}: not done (the worker is past its drain deadline)")
    sealed = seal(client, keys, bid, job, entry.encode(), ttl_s, indices)
    if sealed < 0:
        return None
    if sealed == 0:  # another flush sealed it first: its entry is the one that counts
        again = index_entry(client, keys, bid, job)
        return decode_entry(again) if again is not None else None
    return entry


# ---- shard writes that failed: retried until they land ----------------------------------------
#
# A job whose shard could not be written keeps its full records in Redis (readable there) and gets
# one entry in a fleet-wide retry schedule: a zset (member ``<batch id>:<job no>``, score the next
# try, Redis server time) and a hash (member -> the job's request ranges and tries so far). Every
# worker's sweeper claims due entries (``PENDING_CLAIM`` pushes them one lease ahead, so two sweepers do
# not try the same one at once; a sweeper that dies lets its claim lapse) and retries them with the
# capped, jittered backoff of lmdq.redis.connection.RetryPolicy. A successful write seals the job (freeing
# Redis) and removes its entry; an entry whose batch is gone is dropped.





_MEMBER = re.compile(BATCH_ID_PATTERN.rstrip("$") + r":([0-9]{1,10})$")


class PendingShard(BaseModel):
    """One job whose shard is still to be written (read back from Redis: validated)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_id: str = Field(pattern=BATCH_ID_PATTERN)
    job_no: int = Field(ge=0, le=10**9)
    ranges: list[tuple[int, int]] = Field(min_length=1)
    tries: int = Field(default=0, ge=0)

    @property
    def member(self) -> str:
        return f"{self.batch_id}:{self.job_no}"

    def indices(self) -> list[int]:
        return [i for lo, hi in self.ranges for i in range(lo, hi + 1)]

    def data(self) -> str:
        return json.dumps({"r": self.ranges, "n": self.tries}, separators=(",", ":"))


def add_pending(client: redis.Redis, keys: Keys, p: PendingShard, delay_s: float) -> None:
    """Schedule ``p``'s shard write to be tried again in ``delay_s`` (replacing any earlier schedule),
    unless the job is sealed by now (two sweeps of one entry: the one that failed must not bring
    back what the other finished)."""
    pending_add(client, keys, member=p.member, data=p.data(), delay_s=delay_s, batch_id=p.batch_id, job_no=p.job_no)


def claim_pending(client: redis.Redis, keys: Keys, *, limit: int, lease_s: float, ahead_s: float = 0.0
                  ) -> list[PendingShard]:
    """Up to ``limit`` entries due now (or within ``ahead_s``), each pushed ``lease_s`` ahead (ours to
    try meanwhile). Entries that are not lmdq's are removed (they could never be retried)."""
    raw = pending_claim_due(client, keys, limit=limit, lease_s=lease_s, ahead_s=ahead_s)
    out: list[PendingShard] = []
    for m, d in zip(raw[0::2], raw[1::2]):
        member = m.decode("utf-8", "replace") if isinstance(m, bytes) else str(m)
        got = _MEMBER.fullmatch(member)
        try:
            if got is None or not isinstance(d, bytes) or len(d) > MAX_ENTRY_BYTES:
                raise ValueError("not an lmdq entry")
            data = json.loads(d)
            out.append(PendingShard(batch_id=member.split(":", 1)[0], job_no=int(got[1]), ranges=data["r"],
                                    tries=data.get("n", 0)))
        except (ValueError, KeyError, TypeError, ValidationError):
            drop_pending(client, keys, member)
    return out


def drop_pending(client: redis.Redis, keys: Keys, member: str) -> None:
    """Take ``member`` off the retry schedule (its shard landed, or it can never be written)."""
    pending_drop(client, keys, member)


def pending_count(client: redis.Redis, keys: Keys) -> int:
    """Shard writes waiting to be retried, fleet-wide."""
    return int(client.zcard(keys.sink_pending()[0]))


# ==== The store: the shard index, the seal and the retry schedule in Redis ==============================


def index_entry(client: redis.Redis, keys: Keys, batch_id: str, job: str) -> Any:
    """The raw shard-index entry of job number ``job`` (None: the job is not sealed)."""
    return client.hget(keys.shards(batch_id), job)


def job_finals(client: redis.Redis, keys: Keys, batch_id: str, indices: Sequence[int]) -> list[Any]:
    """The final records of ``indices`` in Redis, raw, in that order (None: no final result there)."""
    return list(client.hmget(keys.results(batch_id), list(indices)))


def seal(client: redis.Redis, keys: Keys, batch_id: str, job: str, entry: str, ttl_s: int,
         indices: Sequence[int]) -> int:
    """Seal one job in ONE script call (atomic: a reader finds its records all in Redis or all in its
    shard). Returns 1 when sealed now, 0 when an earlier seal holds the entry, negative when refused
    (the script's comment below says when)."""
    bid = batch_id
    return int(SEAL_SHARD(keys=[keys.results(bid), keys.shards(bid), keys.sealed(bid), keys.batch(bid)],
                          args=[job, entry, ttl_s, *indices], client=client))


def pending_add(client: redis.Redis, keys: Keys, *, member: str, data: str, delay_s: float, batch_id: str,
                job_no: int) -> None:
    """Schedule ``member`` ``delay_s`` from now (replacing an earlier schedule), unless its job is sealed
    by now (the script checks the batch's shard index)."""
    z, h = keys.sink_pending()
    PENDING_ADD(keys=[z, h, keys.shards(batch_id)], args=[member, data, f"{delay_s:.3f}", job_no],
                client=client)


def pending_claim_due(client: redis.Redis, keys: Keys, *, limit: int, lease_s: float, ahead_s: float) -> list[Any]:
    """Up to ``limit`` entries due within ``ahead_s``, each pushed ``lease_s`` ahead, in one script call:
    the raw flat reply ``[member, data, member, data, ...]`` (untrusted)."""
    z, h = keys.sink_pending()
    return list(PENDING_CLAIM(keys=[z, h], args=[limit, f"{lease_s:.3f}", f"{ahead_s:.3f}"],
                              client=client))


def pending_drop(client: redis.Redis, keys: Keys, member: str) -> None:
    """Take ``member`` off the schedule (one script call)."""
    z, h = keys.sink_pending()
    PENDING_DROP(keys=[z, h], args=[member], client=client)


# ==== Lua: the seal and the retry schedule ====

# KEYS: results, shards index, sealed bitmap, batch.  ARGV: job_no, entry JSON, ttl, index1, index2, ...
# 1: sealed now; 0: sealed already (another flush won); -1: a record is missing (purged/expired batch).
SEAL_SHARD = LuaScript("seal_shard", """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
if redis.call('EXISTS', KEYS[4]) == 0 then return -1 end
for i = 4, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then return -1 end
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
for i = 4, #ARGV do
  redis.call('SETBIT', KEYS[3], ARGV[i], 1)
  redis.call('HDEL', KEYS[1], ARGV[i])
end
local ttl = batch_ttl(KEYS[4], ARGV[3])
for k = 2, 3 do
  if redis.call('TTL', KEYS[k]) < 0 then redis.call('EXPIRE', KEYS[k], ttl) end
end
return 1
""", uses=(BATCH_TTL, OOM_GUARD,))

SERVER_NOW = Fragment("server_now",
                      "local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1000000\n")

# KEYS: schedule zset, data hash, the batch's shard index. ARGV: member, data JSON, delay_s, job_no.
# 0 (and the entry removed): the job is sealed already (another flush landed meanwhile).
PENDING_ADD = LuaScript("pending_add", """
if redis.call('HEXISTS', KEYS[3], ARGV[4]) == 1 then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
""", uses=(SERVER_NOW, OOM_GUARD,))

# KEYS: schedule zset, data hash. ARGV: max entries, lease_s, ahead_s (also take entries due that much
# later). Returns member, data, member, data, ...
PENDING_CLAIM = LuaScript("pending_claim", """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now + tonumber(ARGV[3]), 'LIMIT', 0, tonumber(ARGV[1]))
local out = {}
for _, m in ipairs(due) do
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), m)
  out[#out + 1] = m
  out[#out + 1] = redis.call('HGET', KEYS[2], m) or ''
end
return out
""", uses=(SERVER_NOW, OOM_GUARD,))

# KEYS: schedule zset, data hash. ARGV: member. (A script, not MULTI: Redis 6 refuses a MULTI under OOM.)
PENDING_DROP = LuaScript("pending_drop", """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
""", uses=(OOM_GUARD,))
