"""Results sink for huge batches: full results in JSONL shards, compact records in Redis.

A batch submitted with ``--results-url URL`` (a folder or ``s3://bucket/prefix``) keeps its
answers out of Redis. Every final result is still written to Redis first, through the same
HSETNX + counters Lua script as any other batch, so exactly-once and counts work unchanged. When a
job ends (every request of it has a final result), its worker:

1. reads the job's final results back from Redis, in index order;
2. writes them as ONE shard ``<URL>/<batch_id>/results-<job_no:06d>.jsonl`` (the exact bytes that
   were in Redis, one line per request);
3. only then replaces each of them in Redis, in ONE Lua call, by a compact record (status,
   finish_reason, token counts, error, ids; no text, no logprobs, no tensors) whose ``stored_at``
   is the shard's name (``results-<job_no>.jsonl``, under ``<URL>/<batch_id>/``).

Why the shard is built from Redis and not from what the worker holds in memory: a re-run job (the
worker died, or a request had already been answered by a previous attempt) only regenerates the
requests that have no final result, so the worker's memory holds only part of the job; Redis holds
all of it, exactly once. A crash between 2 and 3 leaves full records in Redis; the re-run rewrites
the same shard from the same bytes and trims. Step 3 is atomic, so a job's records are either all
full (shard not trusted yet, maybe absent) or all compact (shard complete): a late writer that
finds compact records never rewrites the shard. If the shard cannot be written (sink unreachable),
the full records simply stay in Redis and are served from there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import redis

from lmdq.contract import JobPayload, Result, Timings
from lmdq.errors import ResultsUnavailable
from lmdq.keys import Keys

__all__ = ["flush_job", "resolve_results", "shard_key"]

# KEYS: results.  ARGV: index1, compact1, index2, compact2, ...
_TRIM = """
local n = 0
for i = 1, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    n = n + 1
  end
end
return n
"""


def shard_key(batch_id: str, job_no: int) -> str:
    """The shard's key under the results URL."""
    return f"{batch_id}/results-{job_no:06d}.jsonl"


def compact(raw: bytes, shard_name: str) -> str:
    """The record Redis keeps once the full one is in the shard ``shard_name`` (a valid Result:
    every reader of Redis records, counts and ``retry`` included, works on it unchanged)."""
    r = Result.model_validate_json(raw)
    drop = {"text": "", "logprobs": None, "tensors": None, "timings": Timings(), "backend": None, "worker": None}
    small = r.model_copy(update={**drop, "stored_at": shard_name})
    return small.model_dump_json(exclude_defaults=True)


def _stored_at(raw: bytes) -> str | None:
    if b'"stored_at"' not in raw:
        return None
    v = json.loads(raw).get("stored_at")
    return v if isinstance(v, str) else None


def flush_job(client: redis.Redis, keys: Keys, payload: JobPayload) -> str | None:
    """Write the job's shard and trim its Redis records (see the module doc).

    Returns the shard URI, or None when the job is not complete yet or has no results URL.
    """
    if not payload.results_url:
        return None
    from lmdq.blobs import BlobStore

    indices = sorted(r.index for r in payload.requests)
    rkey = keys.results(payload.batch_id)
    got = client.hmget(rkey, indices)
    if any(v is None for v in got):
        return None
    vals: list[bytes] = [v for v in got if isinstance(v, bytes)]
    sink = BlobStore.from_url(payload.results_url)
    key = shard_key(payload.batch_id, payload.job_no)
    uri = sink.uri(key)
    name = key.rsplit("/", 1)[1]
    stored = [_stored_at(v) for v in vals]
    if all(s is not None for s in stored):
        return uri  # shard written and records trimmed already (a previous attempt)
    if all(s is None for s in stored):
        sink.put_bytes(key, b"".join(v + b"\n" for v in vals))
    args: list[Any] = []
    for i, v, s in zip(indices, vals, stored):
        if s is None:
            args += [i, compact(v, name)]
    client.eval(_TRIM, 1, rkey, *args)
    return uri


class _ShardCache:
    """The last shard read, as index -> line (a batch is read in order, shard after shard)."""

    def __init__(self) -> None:
        self.uri: str | None = None
        self.lines: dict[int, bytes] = {}

    def line(self, uri: str, index: int) -> bytes:
        if uri != self.uri:
            from lmdq.blobs import read_uri

            try:
                data = read_uri(uri)
            except Exception as e:  # noqa: BLE001 - any storage error is the same answer to the user
                raise ResultsUnavailable(f"cannot read results shard {uri}: {type(e).__name__}: {e}") from e
            self.lines = {}
            for ln in data.splitlines():
                if ln.strip():
                    self.lines[int(json.loads(ln)["index"])] = ln
            self.uri = uri
        try:
            return self.lines[index]
        except KeyError:
            raise ResultsUnavailable(f"results shard {uri} has no record for request index {index}") from None


def resolve_results(
    pairs: Iterator[tuple[int, bytes | None]], results_url: str, batch_id: str
) -> Iterator[tuple[int, bytes | None]]:
    """Replace compact records by the full ones from their shards; anything else passes through."""
    base = f"{results_url.rstrip('/')}/{batch_id}"
    cache = _ShardCache()
    for i, raw in pairs:
        if raw is not None:
            name = _stored_at(raw)
            if name is not None:
                raw = cache.line(f"{base}/{name}", i)
        yield i, raw
