"""lmdq.results.shards: index entries and shard files, as read back from Redis and storage (untrusted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmdq.contract import ResultStatus
from lmdq.errors import ResultsUnavailable
from lmdq.results.shards import (
    MAX_ENTRY_BYTES,
    SHARD_NAME,
    ShardEntry,
    decode_entry,
    ranges_of,
    read_shard,
    shard_key,
)


def test_ranges_are_inclusive_runs_of_the_sorted_indices() -> None:
    assert ranges_of([]) == []
    assert ranges_of([3, 0, 1, 2]) == [(0, 3)]
    assert ranges_of([9, 1, 2, 5]) == [(1, 2), (5, 5), (9, 9)]


def test_an_entry_round_trips_and_says_what_its_job_holds() -> None:
    e = ShardEntry.of("results-000007.jsonl", [4, 2, 3, 9],
                      [ResultStatus.completed, ResultStatus.failed, ResultStatus.completed, ResultStatus.completed])
    assert e.ranges == [(2, 4), (9, 9)] and list(e.indices()) == [2, 3, 4, 9]
    assert e.counts == {ResultStatus.completed: 3, ResultStatus.failed: 1}
    assert e.has_any({ResultStatus.failed}) and not e.has_any({ResultStatus.expired})
    assert not e.all_completed()
    assert ShardEntry.of("results-000007.jsonl", [1], [ResultStatus.completed]).all_completed()
    assert decode_entry(e.encode().encode()) == e


def test_shard_names_are_the_only_names_an_entry_may_hold() -> None:
    assert shard_key("batch_x", 7) == "batch_x/results-000007.jsonl"
    assert SHARD_NAME.fullmatch(shard_key("b", 1_000_000).rsplit("/", 1)[1])
    for bad in ("../../secret.jsonl", "results-1.jsonl", "/etc/passwd", "results-000001.jsonl/../x"):
        assert decode_entry(json.dumps({"shard": bad, "ranges": [[0, 0]]}).encode()) is None, bad


@pytest.mark.parametrize("raw", [None, "text", b"not json", b'{"shard": "results-000001.jsonl"}',
                                 b'{"shard": "results-000001.jsonl", "ranges": []}',
                                 b'{"shard": "results-000001.jsonl", "ranges": [[0, 1]], "extra": 1}',
                                 b" " * (MAX_ENTRY_BYTES + 1)])
def test_what_is_not_an_lmdq_entry_decodes_to_none(raw: object) -> None:
    assert decode_entry(raw) is None


def _line(i: int) -> bytes:
    return json.dumps({"index": i, "text": f"answer {i}"}).encode()


def test_a_shard_is_read_by_its_entry_and_checked(tmp_path: Path) -> None:
    shard = tmp_path / "results-000000.jsonl"
    shard.write_bytes(b"".join(_line(i) + b"\n" for i in (3, 4, 5)))
    assert read_shard(str(shard), [3, 4, 5]) == {i: _line(i) for i in (3, 4, 5)}
    # a shard that does not match its entry (other order, other indices) is parsed line by line
    shard.write_bytes(b"".join(_line(i) + b"\n" for i in (5, 3, 4)))
    assert read_shard(str(shard), [3, 4, 5]) == {i: _line(i) for i in (3, 4, 5)}
    shard.write_bytes(_line(3) + b"\nnot a result\n")
    with pytest.raises(ResultsUnavailable, match="has a line that is not a result"):
        read_shard(str(shard), [3, 4])
    with pytest.raises(ResultsUnavailable, match="cannot read results shard"):
        read_shard(str(tmp_path / "missing.jsonl"), [0])
