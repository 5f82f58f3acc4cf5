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

The results' store is here too (:class:`ResultRecords`, tests/test_redis_boundary.py): per-request final
and partial records (``Keys.results`` / ``Keys.partials``), the batch's shard index as a reader sees it
(``Keys.shards``), the counters the results script keeps on the batch record, and the results scripts'
Lua (``WRITE_RESULTS``, ``WRITE_PARTIALS``, the ``BATCH_TTL`` and ``OOM_GUARD`` fragments the sink's scripts
use too). Result writes are on the GPU's critical path: a job's results are one script call, many jobs' one
pipeline. Replies are handed back raw (untrusted: the callers decode and check them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import redis

from lmdq.batches.records import BatchRecords
from lmdq.contract import BatchStatus, Result, ResultStatus
from lmdq.errors import BatchNotFound
from lmdq.redis.keys import MODEL_COUNT_PREFIX, BatchField, Keys
from lmdq.redis.scripts import BATCH_ENDED, Fragment, LuaScript
from lmdq.settings import DEFAULT_RESULT_TTL_S
from lmdq.webhooks.store import WEBHOOK_EVENT

_QUIET = {"reused_from"}
"""Left out of a fresh result's record: only a reused one (issue 47) says where its answer came from."""


def _record_json(result: Result) -> str:
    return result.model_dump_json(exclude=_QUIET if result.reused_from is None else None)

__all__ = ["ResultRecords", "ResultStore", "ResultWrite"]

ResultWrite = tuple[str, int, str, str, float, int, int, str]
"""One final result as the results script takes it: (batch id, index, JSON, counter field, now, fallback
TTL, generated tokens, model or '')."""

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
        #: the stored records (:class:`ResultRecords`, below): this class keeps the rules, that one the calls
        self.records = ResultRecords(client, keys=self.keys)

    # ---- results -------------------------------------------------------------------------
    def _final(self, result: Result) -> ResultWrite:
        """What the results script takes for ``result`` (its status picks the counter it bumps)."""
        return (result.batch_id, result.index, _record_json(result), _STATUS_COUNTER[result.status].value,
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
        return self.write_partials([result])[0]

    def write_partials(self, results: Sequence[Result]) -> list[bool]:
        """In-progress texts in one pipelined round trip, one script call per batch; per result, whether
        it was kept (False: the request has its final result, or its batch is gone)."""
        return self.records.write_partials(
            [(r.batch_id, r.index, _record_json(r), self.ttl_s) for r in results])

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

    def read_partials(self, batch_id: str) -> Iterator[tuple[int, bytes]]:
        """(index, in-progress record) of every request running now (a streaming reader's poll:
        :meth:`lmdq.client.client.Batch.stream`); a final result removes its request's partial."""
        return self.records.partials(batch_id)


# ==== The store: result records in Redis =================================================================


class ResultRecords:
    """Result records of one key prefix, as Redis holds them (thread-safe: redis-py clients are)."""

    def __init__(self, client: redis.Redis, *, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._write_results = WRITE_RESULTS.bind(client)
        self._write_partials = WRITE_PARTIALS.bind(client)

    # ---- write --------------------------------------------------------------------------------
    def write_final(self, w: ResultWrite, pipe: Any | None = None) -> bool:
        """Run the results script for one final result (HSETNX + counters, refused for a sealed index or a
        batch without a record). Returns whether it was new; with ``pipe`` the call joins that pipeline
        (its answer comes from the pipeline's ``execute``: a list with one 0/1) and this returns True."""
        batch_id = w[0]
        k = self.keys
        out = self._write_results(
            keys=[k.results(batch_id), k.batch(batch_id), k.partials(batch_id), k.sealed(batch_id)],
            args=_results_args([w]),
            client=pipe,
        )
        return _answers(out, 1)[0] if pipe is None else True

    def write_finals(self, writes: Sequence[ResultWrite]) -> list[bool]:
        """Many final results in ONE pipelined round trip and ONE script call per batch among them; per
        result, whether it was new.

        Why per batch: a worker's results come in groups of one job, and every result of a group bumps the
        same counters of the same batch record. One call per result cost a script dispatch, three or four
        HINCRBYs and the end-of-batch HMGET each (12.5 Redis commands and 26 us of Redis CPU per request
        in the fleet bench); one call per group adds the counters up in Lua and writes each once."""
        if not writes:
            return []
        k = self.keys

        def call(batch_id: str, members: list[int], p: Any) -> Any:
            return self._write_results(
                keys=[k.results(batch_id), k.batch(batch_id), k.partials(batch_id), k.sealed(batch_id)],
                args=_results_args([writes[i] for i in members]), client=p)

        return self._per_batch(writes, call)

    def write_partials(self, writes: Sequence[tuple[str, int, str, int]]) -> list[bool]:
        """In-progress texts, (batch id, index, JSON, fallback TTL) each, in ONE pipelined round trip and
        one script call per batch among them; per write, whether it was kept. Why grouped: a worker's
        partials fall due together (every request of an engine step passes its interval at once), and
        one call each cost a script dispatch and a round trip per request (the fleet bench's largest
        per-request cost after the finals' own)."""
        if not writes:
            return []
        k = self.keys

        def call(batch_id: str, members: list[int], p: Any) -> Any:
            args: list[Any] = [writes[members[0]][3]]
            for i in members:
                args += [writes[i][1], writes[i][2]]
            return self._write_partials(
                keys=[k.results(batch_id), k.partials(batch_id), k.sealed(batch_id), k.batch(batch_id)],
                args=args, client=p)

        return self._per_batch(writes, call)

    def _per_batch(self, writes: Sequence[tuple[Any, ...]],
                   call: Callable[[str, list[int], Any], Any]) -> list[bool]:
        """``call(batch id, positions in writes, client or pipeline)`` once per batch among ``writes``
        (grouped by their first field), all in one round trip; each script's 0/1 answers put back in the
        writes' order.

        One batch (a job's results, the usual case) is one plain EVALSHA: a pipeline holding a script sends
        SCRIPT EXISTS first (redis-py's ``load_scripts``), a second round trip per write that was a third of
        the result writer's time on the reused path (issue 47)."""
        groups: dict[str, list[int]] = {}
        for i, w in enumerate(writes):
            groups.setdefault(w[0], []).append(i)
        if len(groups) == 1:
            ((batch_id, members),) = groups.items()
            replies = [call(batch_id, members, self.client)]
        else:
            with self.client.pipeline(transaction=False) as p:
                for batch_id, members in groups.items():
                    call(batch_id, members, p)
                replies = p.execute()
        out = [False] * len(writes)
        for members, reply in zip(groups.values(), replies, strict=True):
            for i, ok in zip(members, _answers(reply, len(members)), strict=True):
                out[i] = ok
        return out

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

    def partials(self, batch_id: str) -> Iterator[tuple[int, bytes]]:
        """The batch's in-progress records as (index, record), in HSCAN steps of 100 (a field that is not
        an index, or a value that is not bytes, is skipped: untrusted)."""
        for k, v in self.client.hscan_iter(self.keys.partials(batch_id), count=100):
            try:
                i = int(k)
            except (TypeError, ValueError):
                continue
            if isinstance(v, bytes):
                yield i, v


def _results_args(writes: Sequence[ResultWrite]) -> list[Any]:
    """WRITE_RESULTS' ARGV for writes of ONE batch: now and the fallback TTL (the first write's: every write
    of a group is made at the same moment with the same settings), then five per result."""
    args: list[Any] = [writes[0][4], writes[0][5]]
    for _batch_id, index, data, counter, _now, _ttl, tokens, model in writes:
        args += [index, data, counter, tokens, model]
    return args


def _answers(reply: Any, n: int) -> list[bool]:
    """WRITE_RESULTS' reply, one 0/1 per result, checked (read from Redis: untrusted)."""
    if not isinstance(reply, list) or len(reply) != n:
        raise redis.ResponseError(f"write_results: expected {n} answers, got {reply!r:.80}")
    return [x == 1 for x in reply]


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

# KEYS: results, batch, partials, sealed (one batch). ARGV: now, fallback ttl, then five per result: index,
# json, counter field, generated tokens, the result's model ('' for none: its per-model counter,
# ``by_model:<model>:<counter>``, is left alone). Returns one 0/1 per result. Refused (0): a duplicate (HSETNX),
# a request whose result is already in a shard (sealed bit: the record was trimmed after the shard was
# written, see lmdq.results.sink), every result of a batch with no record (purged or expired: writing would
# bring back counters without a TTL). The counters of the new results are added up here and written once
# each, in a fixed (sorted) order; the end-of-batch check runs once, after them.
WRITE_RESULTS = LuaScript("write_results", f"""
local answers = {{}}
if redis.call('EXISTS', KEYS[2]) == 0 then
  for i = 3, #ARGV, 5 do answers[#answers + 1] = 0 end
  return answers
end
local add, fresh = {{}}, {{}}
local sealed = redis.call('EXISTS', KEYS[4]) == 1  -- no bitmap (no sink, or no job sealed yet): no GETBITs
for i = 3, #ARGV, 5 do
  local idx = ARGV[i]
  if not (sealed and redis.call('GETBIT', KEYS[4], idx) == 1)
      and redis.call('HSETNX', KEYS[1], idx, ARGV[i + 1]) == 1 then
    answers[#answers + 1] = 1
    fresh[#fresh + 1] = idx
    local c = ARGV[i + 2]
    add[c] = (add[c] or 0) + 1
    if ARGV[i + 4] ~= '' then
      local mc = '{MODEL_COUNT_PREFIX}' .. ARGV[i + 4] .. ':' .. c
      add[mc] = (add[mc] or 0) + 1
    end
    local t = tonumber(ARGV[i + 3]) or 0
    if t > 0 then add['{F.output_tokens}'] = (add['{F.output_tokens}'] or 0) + t end
  else
    answers[#answers + 1] = 0
  end
end
if #fresh == 0 then return answers end
if redis.call('TTL', KEYS[1]) < 0 then redis.call('EXPIRE', KEYS[1], batch_ttl(KEYS[2], ARGV[2])) end
for s = 1, #fresh, 1000 do redis.call('HDEL', KEYS[3], unpack(fresh, s, math.min(s + 999, #fresh))) end
local fields = {{}}
for f in pairs(add) do fields[#fields + 1] = f end
table.sort(fields)
for _, f in ipairs(fields) do redis.call('HINCRBY', KEYS[2], f, add[f]) end
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
  redis.call('HSET', KEYS[2], '{F.status}', final, final .. '_at', ARGV[1])
  lmdq_batch_ended(KEYS[2], ARGV[2])
  lmdq_webhook_event(KEYS[2], final)
end
return answers
""", uses=(BATCH_TTL, BATCH_ENDED, WEBHOOK_EVENT))

# KEYS: results, partials, sealed, batch (one batch). ARGV: fallback ttl, then two per record: index, json.
# Returns one 0/1 per record: 0 for a request that has its final result (in the hash, or sealed into a
# shard) or every record of a batch without a record.
WRITE_PARTIALS = LuaScript("write_partials", """
local answers = {}
if redis.call('EXISTS', KEYS[4]) == 0 then
  for i = 2, #ARGV, 2 do answers[#answers + 1] = 0 end
  return answers
end
local sealed = redis.call('EXISTS', KEYS[3]) == 1
local kept = 0
for i = 2, #ARGV, 2 do
  if (sealed and redis.call('GETBIT', KEYS[3], ARGV[i]) == 1) or redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    answers[#answers + 1] = 0
  else
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
    answers[#answers + 1] = 1
    kept = kept + 1
  end
end
if kept > 0 and redis.call('TTL', KEYS[2]) < 0 then redis.call('EXPIRE', KEYS[2], batch_ttl(KEYS[4], ARGV[1])) end
return answers
""", uses=(BATCH_TTL,))
