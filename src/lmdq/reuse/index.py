"""The reuse index as its users see it: find the stored answers of identities, record completed results.

The encoding of an entry is the store's (:mod:`lmdq.reuse.store`); this module turns entries into
:class:`~lmdq.contract.Result` objects and back. Everything read back is untrusted and checked: a shard
line must be a completed result of the source batch at the entry's index, a copy must be a completed
result of its source batch; anything else (a shard deleted, a source expired, a line rewritten) is a
miss, and the request simply runs.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from lmdq.contract import GenerationParams, Request, Result, ResultStatus, ReusedFrom
from lmdq.results.blobs import read_uri
from lmdq.results.shards import shard_key
from lmdq.reuse.identity import effective_params, identity, inline_inputs, params_key, qualifies, request_key
from lmdq.reuse.store import ReuseStore, Source, decode_varints, encode_varints

__all__ = ["Completed", "ReuseIndex", "ReuseStats"]

_POINTER = b"S"
_COPY = b"C"

_COPY_EXCLUDE = {"timings", "worker", "attempt"}
"""What a compact copy leaves out: what the reusing request sets itself, and what says when and where."""


def _results_of(data: bytes) -> dict[int, Result]:
    """A shard's lines as results by index, each parsed once (a line that is not a result is left out)."""
    out: dict[int, Result] = {}
    for line in data.splitlines():
        if line.strip():
            try:
                r = Result.model_validate_json(line)
            except ValidationError:
                continue
            out[r.index] = r
    return out


@dataclass(frozen=True)
class ReuseStats:
    """One model's reuse index: entries, Redis bytes (exact), and how often a lookup found an answer."""

    model: str
    entries: int
    bytes: int
    lookups: int
    hits: int

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None

    @property
    def bytes_per_entry(self) -> float | None:
        return self.bytes / self.entries if self.entries else None

    def as_dict(self) -> dict[str, object]:
        return {"model": self.model, "entries": self.entries, "bytes": self.bytes, "lookups": self.lookups,
                "hits": self.hits, "hit_rate": self.hit_rate, "bytes_per_entry": self.bytes_per_entry}


@dataclass(frozen=True)
class Completed:
    """One completed result to record: its identity, the result, and its job (the shard it goes to)."""

    identity: bytes
    result: Result
    job_no: int


class ReuseIndex:
    """Find and record reusable results of one store (one Redis, one key prefix)."""

    def __init__(self, store: ReuseStore) -> None:
        self.store = store

    def find(self, model: str, identities: Sequence[bytes]) -> dict[int, Result]:
        """Position in ``identities`` -> the stored result it can be answered with (each with
        ``reused_from`` set, still carrying the source's batch id, index and custom_id)."""
        if not identities:
            return {}
        values, now = self.store.lookup(model, identities)
        decoded: dict[int, tuple[bytes, int, bytes]] = {}
        for pos, raw in enumerate(values):
            if raw is not None and raw[:1] in (_POINTER, _COPY):
                got = decode_varints(raw[1:], 1)
                if got is not None:
                    decoded[pos] = (raw[:1], got[0][0], raw[1 + got[1]:])
        sources = self.store.sources(model, (src for _, src, _ in decoded.values()))
        shards: dict[tuple[int, int], dict[int, Result] | None] = {}
        out: dict[int, Result] = {}
        for pos, (kind, src_no, rest) in decoded.items():
            src = sources.get(src_no)
            if src is None or src.expires_at < now:
                continue
            res = (self._from_shard(src, src_no, rest, shards) if kind == _POINTER else self._from_copy(src, rest))
            if res is not None:
                out[pos] = res
        self.store.count(model, len(identities), len(out))
        return out

    @staticmethod
    def _from_shard(src: Source, src_no: int, rest: bytes, shards: dict[tuple[int, int], dict[int, Result] | None]
                    ) -> Result | None:
        got = decode_varints(rest, 2)
        if got is None or src.results_url is None:
            return None
        job_no, index = got[0]
        if (src_no, job_no) not in shards:
            uri = f"{src.results_url.rstrip('/')}/{shard_key(src.batch_id, job_no)}"
            try:
                shards[(src_no, job_no)] = _results_of(read_uri(uri))
            except Exception:  # noqa: BLE001 - a shard that cannot be read (gone, sink down) is a miss
                shards[(src_no, job_no)] = None
        lines = shards[(src_no, job_no)]
        res = lines.get(index) if lines else None
        if res is None:
            return None
        if res.batch_id != src.batch_id or res.index != index or res.status is not ResultStatus.completed:
            return None
        if res.reused_from is None:  # built, not validated: both strings come from the result validated above
            res.reused_from = ReusedFrom.model_construct(batch=res.batch_id, custom_id=res.custom_id)
        return res

    @staticmethod
    def _from_copy(src: Source, rest: bytes) -> Result | None:
        try:
            data = zlib.decompress(rest)
            res = Result.model_validate_json(data)
        except (zlib.error, ValidationError):
            return None
        if res.batch_id != src.batch_id or res.status is not ResultStatus.completed or res.reused_from is None:
            return None
        return res

    def known(self, model: str, requests: Iterable[Request], params: GenerationParams, *,
              chunk: int = 1000) -> int | None:
        """How many of ``requests`` (under the batch's ``params``) the index answers now, as the model's
        newest worker computes identities (its published worker key); None when no worker has published one.
        What ``plan`` and ``status`` show before anything runs: an entry whose stored answer has gone since
        is recomputed, so this is an upper bound that holds unless a shard was deleted."""
        wkey = self.store.published(model)
        if wkey is None:
            return None
        shared = params.resolved()
        shared_key = params_key(shared)
        found = 0
        batch: list[bytes] = []

        def look() -> int:
            values, _ = self.store.lookup(model, batch)
            batch.clear()
            return sum(v is not None for v in values)

        for r in requests:
            p = shared if r.params is None else effective_params(params, r)
            if qualifies(p, repeats_seeds=True) and inline_inputs(r):  # unseeded never has an entry anyway
                batch.append(identity(wkey, request_key(shared_key if r.params is None else p, r)))
                if len(batch) >= chunk:
                    found += look()
        if batch:
            found += look()
        return found

    def stats(self, model: str | None = None) -> list[ReuseStats]:
        """The index of ``model`` (every model that has one when None)."""
        models = [model] if model is not None else self.store.models()
        out = []
        for m in models:
            c = self.store.counters(m)
            out.append(ReuseStats(model=m, entries=c["entries"], bytes=self.store.memory(m), lookups=c["lookups"],
                                  hits=c["hits"]))
        return out

    def purge(self, model: str) -> int:
        """Forget every answer of ``model``: later batches recompute them. Returns the entries there were."""
        return self.store.purge(model)

    def record(self, model: str, *, batch_id: str, results_url: str | None, ttl_s: int,
               done: Sequence[Completed], sealed: bool) -> int:
        """Index ``done`` (completed results of ``batch_id``): pointers into their shards when the job was
        ``sealed`` into ``results_url``, else compact copies. Returns how many entries were new."""
        done = [c for c in done if c.result.status is ResultStatus.completed]
        if not done:
            return 0
        src_no = self.store.source(model, batch_id, results_url, ttl_s)
        entries: list[tuple[bytes, str, bytes]] = []
        for c in done:
            if sealed:
                value = _POINTER + encode_varints(src_no, c.job_no, c.result.index)
                entries.append((c.identity, "p", value))
            else:
                # the answer's origin travels inside the copy (its custom_id is nowhere else once the batch expires)
                origin = c.result.reused_from or ReusedFrom(batch=batch_id, custom_id=c.result.custom_id)
                body = c.result.model_copy(update={"reused_from": origin}).model_dump_json(
                    exclude=_COPY_EXCLUDE)
                entries.append((c.identity, "c", _COPY + encode_varints(src_no) + zlib.compress(body.encode(), 6)))
        return self.store.record(model, entries, ttl_s)
