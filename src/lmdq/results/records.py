"""The results' stored records: per-request final and partial records (``Keys.results`` /
``Keys.partials``), the batch's shard index as a reader sees it (``Keys.shards``) and the counters the
results script keeps on the batch record.

Why a module of its own: exactly-once, the counters per status and the TTL rules are the results' rules
(:mod:`lmdq.results.store`); the commands, script calls and the results scripts' Lua are here, in the
results' store (tests/test_redis_boundary.py). Result writes are on the GPU's critical path:
a write is one script call, many writes one pipeline, exactly as before the move. Replies are handed
back raw (untrusted: the callers decode and check them).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import redis

from lmdq.contract import BatchStatus
from lmdq.redis.keys import MODEL_COUNT_PREFIX, BatchField, Keys
from lmdq.redis.scripts import BATCH_ENDED, Fragment, LuaScript

__all__ = ["ResultRecords", "ResultWrite"]

ResultWrite = tuple[str, int, str, str, float, int, int, str]
"""One final result as the results script takes it: (batch id, index, JSON, counter field, now, fallback
TTL, generated tokens, model or '')."""


class ResultRecords:
    """Result records of one key prefix, as Redis holds them (thread-safe: redis-py clients are)."""

    def __init__(self, client: redis.Redis, *, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._write_result = WRITE_RESULT.bind(client)
        self._write_partial = WRITE_PARTIAL.bind(client)

    # ---- write --------------------------------------------------------------------------------
    def write_final(self, w: ResultWrite, pipe: Any | None = None) -> bool:
        """Run the results script for one final result (HSETNX + counters, refused for a sealed index or a
        batch without a record). Returns whether it was new; with ``pipe`` the call joins that pipeline
        (its answer comes from the pipeline's ``execute``) and this returns True."""
        batch_id, index, data, counter, now, ttl_s, tokens, model = w
        k = self.keys
        out = self._write_result(
            keys=[k.results(batch_id), k.batch(batch_id), k.partials(batch_id), k.sealed(batch_id)],
            args=[index, data, counter, now, ttl_s, tokens, model],
            client=pipe,
        )
        return bool(out) if pipe is None else True

    def write_finals(self, writes: Sequence[ResultWrite]) -> list[bool]:
        """Many final results in ONE pipelined round trip (one script call each); per result, whether it
        was new. Why one: the round trip per result was about half of Redis' CPU per request."""
        if not writes:
            return []
        with self.client.pipeline(transaction=False) as p:
            for w in writes:
                self.write_final(w, pipe=p)
            return [bool(x) for x in p.execute()]

    def write_partial(self, batch_id: str, index: int, data: str, ttl_s: int) -> bool:
        """In-progress text for a request without a final result (one script call); whether it was kept."""
        k = self.keys
        return bool(self._write_partial(
            keys=[k.results(batch_id), k.partials(batch_id), k.sealed(batch_id), k.batch(batch_id)],
            args=[index, data, ttl_s],
        ))

    # ---- read ---------------------------------------------------------------------------------
    def read(self, batch_id: str, indices: Sequence[int], *, partial: bool
             ) -> tuple[list[bytes | None], list[bytes | None]]:
        """The final (and, with ``partial``, in-progress) records of ``indices``, one round trip; None for
        a missing one (or one that is not bytes: untrusted)."""
        with self.client.pipeline(transaction=False) as p:
            p.hmget(self.keys.results(batch_id), list(indices))
            if partial:
                p.hmget(self.keys.partials(batch_id), list(indices))
            got = p.execute()
        finals: list[bytes | None] = [v if isinstance(v, bytes) else None for v in got[0]]
        partials: list[bytes | None] = [None] * len(indices)
        if partial:
            partials = [v if isinstance(v, bytes) else None for v in got[1]]
        return finals, partials

    def index_len(self, batch_id: str) -> int:
        """Entries (jobs) in the batch's shard index."""
        return int(self.client.hlen(self.keys.shards(batch_id)))

    def index_items(self, batch_id: str) -> Iterator[tuple[Any, Any]]:
        """The batch's shard index as raw (field, value) pairs, in HSCAN steps of 1000."""
        yield from self.client.hscan_iter(self.keys.shards(batch_id), count=1000)

    def output_tokens_field(self, batch_id: str) -> Any:
        """The raw ``output_tokens`` counter of the batch record (None: not counted yet or no record)."""
        return self.client.hget(self.keys.batch(batch_id), BatchField.output_tokens.value)

    def partial_count(self, batch_id: str) -> int:
        """In-progress records held for the batch."""
        return int(self.client.hlen(self.keys.partials(batch_id)))


F = BatchField

# ==== Lua: this module's scripts (composed and run by lmdq.redis.scripts.LuaScript) ====

# The TTL a key the workers create takes: what is left of the batch record's own (so every key of a
# batch goes at the same moment: submit's --result-ttl), or ARGV ttl when the record has none.
BATCH_TTL = Fragment("batch_ttl", """
local function batch_ttl(batch, fallback)
  local t = redis.call('TTL', batch)
  if t > 0 then return t end
  return tonumber(fallback)
end
""")

OOM_GUARD = Fragment("oom_guard", "redis.call('HDEL', KEYS[2], '\\0lmdq-oom-guard')\n")
"""A script's first write decides whether Redis, full under ``maxmemory`` + ``noeviction``, runs it: a
command that may grow memory (HSET, ZADD, SETBIT) is refused, one that cannot (HDEL of a field that
never exists) is not, and lets the rest through (the same guard as LEASE_CLOCK's, before the heartbeat). A
seal frees far more than it adds, and the retry schedule is what frees the rest once the sink answers:
both must work in a Redis filled by the very records they are there to move out."""

# KEYS: results, batch, partials, sealed. ARGV: index, json, counter field, now, ttl, generated tokens, the
# result's model ('' for none: its per-model counter, ``by_model:<model>:<counter>``, is left alone).
# Refused (0): a duplicate (HSETNX), a request whose result is already in a shard (sealed bit: the
# record was trimmed after the shard was written, see lmdq.results.sink), or a batch with no record (purged
# or expired: writing would bring back counters without a TTL).
WRITE_RESULT = LuaScript("write_result", f"""
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
if redis.call('GETBIT', KEYS[4], ARGV[1]) == 1 then return 0 end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
if redis.call('TTL', KEYS[1]) < 0 then redis.call('EXPIRE', KEYS[1], batch_ttl(KEYS[2], ARGV[5])) end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
if ARGV[7] and ARGV[7] ~= '' then
  redis.call('HINCRBY', KEYS[2], '{MODEL_COUNT_PREFIX}' .. ARGV[7] .. ':' .. ARGV[3], 1)
end
if tonumber(ARGV[6] or '0') > 0 then redis.call('HINCRBY', KEYS[2], '{F.output_tokens}', ARGV[6]) end
local b = redis.call('HMGET', KEYS[2], '{F.total}', '{F.completed}', '{F.failed}', '{F.cancelled}', '{F.expired}',
                     '{F.status}')
local done = 0
for i = 2, 5 do done = done + tonumber(b[i] or '0') end
if b[1] and done >= tonumber(b[1]) then
  local st = b[6]
  local final = '{BatchStatus.completed.value}'
  if st == '{BatchStatus.cancelling.value}' or st == '{BatchStatus.cancelled.value}' then
    final = '{BatchStatus.cancelled.value}'
  elseif tonumber(b[5] or '0') > 0 then final = '{BatchStatus.expired.value}' end
  redis.call('HSET', KEYS[2], '{F.status}', final, final .. '_at', ARGV[4])
  lmdq_batch_ended(KEYS[2], ARGV[5])
end
return 1
""", uses=(BATCH_TTL, BATCH_ENDED,))

# KEYS: results, partials, sealed, batch. ARGV: index, json, ttl
WRITE_PARTIAL = LuaScript("write_partial", """
if redis.call('EXISTS', KEYS[4]) == 0 then return 0 end
if redis.call('GETBIT', KEYS[3], ARGV[1]) == 1 then return 0 end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
if redis.call('TTL', KEYS[2]) < 0 then redis.call('EXPIRE', KEYS[2], batch_ttl(KEYS[4], ARGV[3])) end
return 1
""", uses=(BATCH_TTL,))
