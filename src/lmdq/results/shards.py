"""Results shards and the per-batch shard index: where a sealed job's records are, and reading them.

A batch with a results URL keeps each finished job's records as ONE shard
``<URL>/<batch_id>/results-<job_no:06d>.jsonl`` (the exact bytes Redis held, one line per request,
in index order), and one :class:`ShardEntry` per job in the batch's index hash (``Keys.shards``):
the shard's name, the job's request indices as ranges, and its counts per status. How a job gets
there is :mod:`lmdq.results.sink`; reading goes through :class:`lmdq.results.reader.ResultReader`.

Everything here is read back from Redis or from storage, so it is validated (untrusted input): an
index entry that is not lmdq's, names a file that is not a shard, or indices outside the batch, is
left out, and its requests then read as missing, never from a wrong place.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lmdq.contract import ResultStatus
from lmdq.errors import ResultsUnavailable

if TYPE_CHECKING:
    from lmdq.results.store import ResultStore

__all__ = ["MAX_ENTRY_BYTES", "SHARD_NAME", "ShardEntry", "decode_entry", "ranges_of", "read_index", "read_shard",
           "shard_key"]

MAX_ENTRY_BYTES = 1 << 20
"""An index entry larger than this is not lmdq's (a job holds at most ``MAX_JOB_REQUESTS``)."""

SHARD_NAME = re.compile(r"^results-[0-9]{6,10}\.jsonl$")
"""A results shard's name under ``<results URL>/<batch id>/``: checked wherever one is read from Redis."""


class ShardEntry(BaseModel):
    """One job's line in the batch's shard index: where its results are and what they were.

    ``ranges`` are inclusive ``[first, last]`` runs of request indices (one run for a job of
    consecutive requests; several when jobs group requests out of input order). ``counts`` lets
    ``retry`` skip shards that hold nothing to retry. Read back from Redis, so validated (untrusted).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    shard: str = Field(pattern=SHARD_NAME.pattern)
    ranges: list[tuple[int, int]] = Field(min_length=1)
    counts: dict[ResultStatus, int] = Field(default_factory=dict)

    @classmethod
    def of(cls, shard: str, indices: Iterable[int], statuses: Iterable[ResultStatus]) -> ShardEntry:
        return cls(shard=shard, ranges=ranges_of(indices), counts=dict(Counter(statuses)))

    def indices(self) -> Iterator[int]:
        for lo, hi in self.ranges:
            yield from range(lo, hi + 1)

    def has_any(self, statuses: set[ResultStatus]) -> bool:
        return any(self.counts.get(s, 0) > 0 for s in statuses)

    def all_completed(self) -> bool:
        """Whether nothing in the job is left for ``retry`` (which reads failed requests from it)."""
        return set(self.counts) <= {ResultStatus.completed}

    def encode(self) -> str:
        return self.model_dump_json(exclude_defaults=True)


def ranges_of(indices: Iterable[int]) -> list[tuple[int, int]]:
    """Inclusive ``[first, last]`` runs of the sorted ``indices``."""
    runs: list[tuple[int, int]] = []
    for i in sorted(indices):
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def shard_key(batch_id: str, job_no: int) -> str:
    """The shard's key under the results URL."""
    return f"{batch_id}/results-{job_no:06d}.jsonl"


def decode_entry(raw: Any) -> ShardEntry | None:
    """An index entry as read from Redis, or None when it is not lmdq's."""
    if not isinstance(raw, bytes) or len(raw) > MAX_ENTRY_BYTES:
        return None
    try:
        return ShardEntry.model_validate_json(raw)
    except ValidationError:
        return None


def read_index(store: ResultStore, batch_id: str, total: int) -> dict[int, ShardEntry]:
    """The batch's shard index, validated: entries that are not lmdq's, or name indices outside the
    batch, are left out (their requests then read as missing, never from a wrong place)."""
    out: dict[int, ShardEntry] = {}
    for field, raw in store.index_items(batch_id):
        try:
            job_no = int(field)
        except ValueError:
            continue
        e = decode_entry(raw)
        if e is not None and job_no >= 0 and all(0 <= lo <= hi < total for lo, hi in e.ranges):
            out[job_no] = e
    return out


def _index_of(line: bytes, uri: str) -> int:
    try:
        return int(json.loads(line)["index"])
    except (ValueError, KeyError, TypeError) as e:
        raise ResultsUnavailable(f"results shard {uri} has a line that is not a result") from e


def read_shard(uri: str, expected: list[int]) -> dict[int, bytes]:
    """index -> line of one shard. A shard holds its job's records in index order, so with the job's
    ``expected`` indices (its index entry) only the first and last lines are parsed to check that;
    a shard that does not match is parsed line by line."""
    from lmdq.results.blobs import read_uri

    try:
        data = read_uri(uri)
    except Exception as e:  # noqa: BLE001 - any storage error is the same answer to the user
        raise ResultsUnavailable(f"cannot read results shard {uri}: {type(e).__name__}: {e}") from e
    lines = [ln for ln in data.splitlines() if ln.strip()]
    if (expected and len(lines) == len(expected) and _index_of(lines[0], uri) == expected[0]
            and _index_of(lines[-1], uri) == expected[-1]):
        return dict(zip(expected, lines))
    return {_index_of(ln, uri): ln for ln in lines}
