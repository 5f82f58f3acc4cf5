"""The Redis half of results: per-request final and partial records (``Keys.results`` /
``Keys.partials``), the batch's shard index as a reader sees it (``Keys.shards``) and the counters the
results script keeps on the batch record.

Why a module of its own: exactly-once, the counters per status and the TTL rules are the results' rules
(:mod:`lmdq.results.store`); the commands and script calls are here, because lmdq speaks Redis only
under :mod:`lmdq.redis` (tests/test_redis_boundary.py). Result writes are on the GPU's critical path:
a write is one script call, many writes one pipeline, exactly as before the move. Replies are handed
back raw (untrusted: the callers decode and check them).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import redis

from lmdq.redis import scripts
from lmdq.redis.keys import BatchField, Keys

__all__ = ["ResultRecords", "ResultWrite"]

ResultWrite = tuple[str, int, str, str, float, int, int, str]
"""One final result as the results script takes it: (batch id, index, JSON, counter field, now, fallback
TTL, generated tokens, model or '')."""


class ResultRecords:
    """Result records of one key prefix, as Redis holds them (thread-safe: redis-py clients are)."""

    def __init__(self, client: redis.Redis, *, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._write_result = scripts.WRITE_RESULT.bind(client)
        self._write_partial = scripts.WRITE_PARTIAL.bind(client)

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
