"""The reuse index's store: every Redis command and Lua script of lmdq.reuse (tests/test_redis_boundary.py).

Memory is the design constraint: a million-request nightly run must not cost a gigabyte of Redis. So
an entry is never a key of its own (a key costs ~70 bytes before its value). The model's index is
:data:`BUCKETS` hashes; an identity's first two bytes pick its bucket and its next :data:`FIELD_BYTES`
bytes are its field, in binary. At up to 128 fields per bucket (Redis' ``hash-max-listpack-entries``
default, i.e. up to 8 M entries per model) a bucket is one listpack: about 12 bytes of field and 10 of
value per entry, plus the bucket key's share. A value (:func:`encode_pointer`) is a kind byte and
varints: the batch's number in the model's source table (``Keys.reuse_sources``: batch id, results URL
and the source's expiry, written once per batch), the job number (its shard) and the request index.

Results of a batch without a results sink live only in Redis, under the batch's result TTL; the index
keeps a compact copy of those (zlib'd result JSON) in a second set of buckets (kind ``c``), so that their
larger values never turn the pointer buckets into hash tables.

Retention: each entry's source carries an expiry (the server's clock + ``--reuse-ttl``); an entry whose
source has expired is a miss. Keys get a TTL that only ever grows (never shortened by a batch with a
shorter ``--reuse-ttl``), so an index no batch writes to any more leaves Redis on its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import redis

from lmdq.redis.keys import Keys
from lmdq.redis.scripts import LuaScript

__all__ = ["BUCKETS", "FIELD_BYTES", "SMALL_BUCKETS", "SMALL_CAP", "ReuseStore", "Source", "decode_varints",
           "encode_varints"]

BUCKET_BITS = 16
BUCKETS = 1 << BUCKET_BITS
"""Hash buckets per model and kind: sized so a million entries average ~15 per listpack bucket."""

SMALL_BITS = 12
SMALL_BUCKETS = 1 << SMALL_BITS
"""The small level's buckets per model and kind (issue 47, bytes per entry): a bucket key costs ~90 bytes of
its own (key, object, listpack header, expiry), so 65,536 buckets holding 50,000 entries (~1.4 a bucket)
cost 83 bytes an entry. A model's first :data:`SMALL_CAP` entries go to 4,096 buckets instead (up to 64 a
bucket, within ``hash-max-listpack-entries`` 128), the rest to the 65,536 (~15 a bucket at a million)."""

SMALL_CAP = SMALL_BUCKETS * 64
"""Entries a model's small level takes before new entries go to the big one."""

FIELD_BYTES = 10
"""Identity bytes kept as the field (after the two that pick the bucket): 96 bits in all."""

KINDS = ("p", "c")
"""``p``: pointers into a sink's shards; ``c``: compact copies of results only Redis held."""

_PURGE_CHUNK = 1024

SOURCE = LuaScript("reuse_source", """
local no = redis.call('HGET', KEYS[1], ARGV[1])
if not no then
  no = redis.call('HINCRBY', KEYS[1], '#next', 1)
  redis.call('HSET', KEYS[1], ARGV[1], no, '#' .. no, ARGV[2])
end
local t = redis.call('TIME')
local ttl = tonumber(ARGV[3])
local exp = tonumber(t[1]) + ttl
local old = tonumber(redis.call('HGET', KEYS[1], 'e' .. no) or '0')
if exp > old then redis.call('HSET', KEYS[1], 'e' .. no, exp) end
if redis.call('TTL', KEYS[1]) < ttl then redis.call('EXPIRE', KEYS[1], ttl) end
redis.call('SADD', KEYS[2], ARGV[4])
return tonumber(no)
""")
"""Number a batch in the model's source table (once) and push its expiry out to now + ttl."""

LOOKUP = LuaScript("reuse_lookup", """
local t = redis.call('TIME')
local out = {t[1], t[2]}
for i = 1, #ARGV / 2 do
  local fb, fs = ARGV[2 * i - 1], ARGV[2 * i]
  local v = redis.call('HGET', KEYS[4 * i - 3], fb)
  if not v then v = redis.call('HGET', KEYS[4 * i - 2], fs) end
  if not v then v = redis.call('HGET', KEYS[4 * i - 1], fb) end
  if not v then v = redis.call('HGET', KEYS[4 * i], fs) end
  out[i + 2] = v or ''
end
return out
""")
"""Each identity's entry (a pointer, else a copy; either level, see :data:`SMALL_CAP`) and the server's clock,
in one call. KEYS: per identity its pointer bucket (big level, small level), then its copy bucket (same);
ARGV: per identity its big-level field, then its small-level field."""

RECORD = LuaScript("reuse_record", """
local ttl = tonumber(ARGV[1])
local cap = tonumber(ARGV[2])
local had = tonumber(redis.call('HGET', KEYS[1], 'entries') or '0')
local new = 0
for i = 1, (#KEYS - 2) / 2 do
  local kb, ks = KEYS[2 * i + 1], KEYS[2 * i + 2]
  local fb, fs, v = ARGV[3 * i], ARGV[3 * i + 1], ARGV[3 * i + 2]
  local k, f = ks, fs
  if redis.call('HEXISTS', kb, fb) == 1 or (had + new >= cap and redis.call('HEXISTS', ks, fs) == 0) then
    k, f = kb, fb
  end
  new = new + redis.call('HSET', k, f, v)
  if redis.call('TTL', k) < ttl then redis.call('EXPIRE', k, ttl) end
end
redis.call('HINCRBY', KEYS[1], 'entries', new)
if redis.call('TTL', KEYS[1]) < ttl then redis.call('EXPIRE', KEYS[1], ttl) end
return new
""")
"""Write entries in one call: into the small level while the model holds fewer than ARGV[2] entries, else the
big one (an identity already in a level is rewritten there). KEYS[3..]: each entry's big-level then
small-level bucket; ARGV: ttl, cap, then per entry its big-level field, small-level field and value."""


def encode_varints(*values: int) -> bytes:
    out = bytearray()
    for v in values:
        if v < 0:
            raise ValueError("varints are unsigned")
        while True:
            b = v & 0x7F
            v >>= 7
            if v:
                out.append(b | 0x80)
            else:
                out.append(b)
                break
    return bytes(out)


def decode_varints(data: bytes, count: int) -> tuple[list[int], int] | None:
    """``count`` varints from the start of ``data`` and the offset after them; None when malformed."""
    out: list[int] = []
    pos = 0
    for _ in range(count):
        v = shift = 0
        while True:
            if pos >= len(data) or shift > 63:
                return None
            b = data[pos]
            pos += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        out.append(v)
    return out, pos


class Source:
    """One batch an index entry points into, as its source table holds it (read back: validated)."""

    def __init__(self, batch_id: str, results_url: str | None, expires_at: float) -> None:
        self.batch_id = batch_id
        self.results_url = results_url
        self.expires_at = expires_at


def split(identity: bytes) -> tuple[int, bytes]:
    """An identity's bucket number and field in the big level."""
    return int.from_bytes(identity[:2], "big") >> (16 - BUCKET_BITS), identity[2:2 + FIELD_BYTES]


def split_small(identity: bytes) -> tuple[int, bytes]:
    """An identity's bucket number and field in the small level: its first 12 bits pick the bucket, the field
    is bytes 1..11 (the same 96 bits of identity as :func:`split`, four of them twice)."""
    return int.from_bytes(identity[:2], "big") >> (16 - SMALL_BITS), identity[1:2 + FIELD_BYTES]


class ReuseStore:
    """The reuse index's Redis side (see the module doc); callers encode and resolve (lmdq.reuse.index)."""

    def __init__(self, client: redis.Redis, *, keys: Keys) -> None:
        self.r = client
        self.keys = keys

    # -- the worker key -------------------------------------------------------------------------------
    def publish_worker(self, model: str, worker_key: bytes) -> None:
        self.r.hset(self.keys.reuse_workers(), model, worker_key.hex())

    def published(self, model: str) -> bytes | None:
        raw = self.r.hget(self.keys.reuse_workers(), model)
        try:
            return bytes.fromhex(raw.decode()) if isinstance(raw, bytes) else None
        except ValueError:
            return None

    # -- writing ----------------------------------------------------------------------------------------
    def source(self, model: str, batch_id: str, results_url: str | None, ttl_s: int) -> int:
        """The batch's number in the model's source table (created once), its expiry pushed to now + ttl."""
        where = json.dumps({"b": batch_id, "u": results_url or ""})
        no = SOURCE(keys=[self.keys.reuse_sources(model), self.keys.reuse_models()],
                    args=[batch_id, where, int(ttl_s), model], client=self.r)
        return int(no)

    def record(self, model: str, entries: Sequence[tuple[bytes, str, bytes]], ttl_s: int) -> int:
        """Write ``(identity, kind, value)`` entries in one script call; returns how many were new."""
        if not entries:
            return 0
        keys: list[str] = [self.keys.reuse_stats(model), self.keys.reuse_models()]
        args: list[Any] = [int(ttl_s), SMALL_CAP]
        for ident, kind, value in entries:
            bucket, field = split(ident)
            small, sfield = split_small(ident)
            keys += [self.keys.reuse_bucket(model, kind, bucket), self.keys.reuse_bucket(model, kind + "s", small)]
            args += [field, sfield, value]
        return int(RECORD(keys=keys, args=args, client=self.r))

    # -- reading ----------------------------------------------------------------------------------------
    def lookup(self, model: str, identities: Sequence[bytes]) -> tuple[list[bytes | None], float]:
        """Each identity's raw entry (its pointer, else its copy; None where absent) and the server's clock,
        in one script call."""
        if not identities:
            return [], 0.0
        keys: list[str] = []
        fields: list[bytes] = []
        for ident in identities:
            bucket, field = split(ident)
            small, sfield = split_small(ident)
            for kind in KINDS:
                keys += [self.keys.reuse_bucket(model, kind, bucket), self.keys.reuse_bucket(model, kind + "s", small)]
            fields += [field, sfield]
        got = LOOKUP(keys=keys, args=fields, client=self.r)
        now = float(got[0]) + float(got[1]) / 1e6
        return [v if isinstance(v, bytes) and v else None for v in got[2:]], now

    def sources(self, model: str, numbers: Iterable[int]) -> dict[int, Source]:
        """The source table's entries for ``numbers`` (left out: missing or not lmdq's)."""
        nos = sorted(set(numbers))
        if not nos:
            return {}
        fields: list[str] = []
        for n in nos:
            fields += [f"#{n}", f"e{n}"]
        raw = self.r.hmget(self.keys.reuse_sources(model), fields)
        out: dict[int, Source] = {}
        for i, n in enumerate(nos):
            where, exp = raw[2 * i], raw[2 * i + 1]
            try:
                d = json.loads(where) if isinstance(where, bytes) else None
                if isinstance(d, dict) and isinstance(d.get("b"), str) and isinstance(d.get("u"), str):
                    out[n] = Source(d["b"], d["u"] or None, float(exp or 0))
            except ValueError:
                continue
        return out

    def count(self, model: str, lookups: int, hits: int) -> None:
        """Add to the model's hit-rate counters (``reuse stats``)."""
        if lookups:
            pipe = self.r.pipeline(transaction=False)
            pipe.hincrby(self.keys.reuse_stats(model), "lookups", lookups)
            pipe.hincrby(self.keys.reuse_stats(model), "hits", hits)
            pipe.execute()

    # -- operating --------------------------------------------------------------------------------------
    def models(self) -> list[str]:
        return sorted(m.decode() if isinstance(m, bytes) else str(m) for m in self.r.smembers(self.keys.reuse_models()))

    def counters(self, model: str) -> dict[str, int]:
        raw = self.r.hgetall(self.keys.reuse_stats(model))
        out = {"entries": 0, "lookups": 0, "hits": 0}
        for k, v in raw.items():
            name = k.decode() if isinstance(k, bytes) else str(k)
            if name in out:
                try:
                    out[name] = int(v)
                except ValueError:
                    continue
        return out

    def _all_keys(self, model: str) -> list[str]:
        return ([self.keys.reuse_bucket(model, k, b) for k in KINDS for b in range(BUCKETS)]
                + [self.keys.reuse_bucket(model, k + "s", b) for k in KINDS for b in range(SMALL_BUCKETS)]
                + [self.keys.reuse_sources(model), self.keys.reuse_stats(model)])

    def memory(self, model: str) -> int:
        """Exact bytes of the model's index keys (``MEMORY USAGE ... SAMPLES 0``, pipelined)."""
        total = 0
        keys = self._all_keys(model)
        for start in range(0, len(keys), 8192):
            pipe = self.r.pipeline(transaction=False)
            for k in keys[start:start + 8192]:
                pipe.memory_usage(k, samples=0)
            total += sum(int(v or 0) for v in pipe.execute())
        return total

    def purge(self, model: str) -> int:
        """Delete the model's whole index (every bucket, its sources and counters); returns the entries it had."""
        entries = self.counters(model)["entries"]
        keys = self._all_keys(model)
        pipe = self.r.pipeline(transaction=False)
        for start in range(0, len(keys), _PURGE_CHUNK):
            pipe.unlink(*keys[start:start + _PURGE_CHUNK])
        pipe.srem(self.keys.reuse_models(), model)
        pipe.execute()
        return entries
