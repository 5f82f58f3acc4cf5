"""lmdq.results.shards: the shard index entry, its validation (untrusted), and reading one shard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
from pydantic import ValidationError

from lmdq.contract import ResultStatus
from lmdq.errors import ResultsUnavailable
from lmdq.redis.keys import Keys
from lmdq.results.shards import MAX_ENTRY_BYTES, ShardEntry, decode_entry, ranges_of, read_index, read_shard, shard_key
from lmdq.results.store import ResultStore


def test_ranges_of_runs_unsorted_and_empty() -> None:
    assert ranges_of([]) == []
    assert ranges_of([5, 3, 4, 9, 0]) == [(0, 0), (3, 5), (9, 9)]
    assert ranges_of(range(7)) == [(0, 6)]


def test_entry_round_trips_and_answers_retry() -> None:
    e = ShardEntry.of(shard_key("b", 3).split("/")[1], [4, 2, 3, 7],
                      [ResultStatus.completed, ResultStatus.failed, ResultStatus.completed, ResultStatus.completed])
    assert e.shard == "results-000003.jsonl"
    assert list(e.indices()) == [2, 3, 4, 7]
    assert e.has_any({ResultStatus.failed}) and not e.all_completed()
    back = decode_entry(e.encode().encode())
    assert back == e
    ok = ShardEntry.of("results-000000.jsonl", [0], [ResultStatus.completed])
    assert ok.all_completed() and not ok.has_any({ResultStatus.failed})


def test_shard_key_pads_the_job_number() -> None:
    assert shard_key("batch_x", 12) == "batch_x/results-000012.jsonl"


@pytest.mark.parametrize("raw", [
    "not bytes", None, b"{", b"[]", b'{"shard": "../../etc/passwd", "ranges": [[0, 0]]}',
    b'{"shard": "results-000001.jsonl", "ranges": []}',
    b'{"shard": "results-000001.jsonl", "ranges": [[0, 0]], "extra": 1}',
    b'{"shard": "results-000001.jsonl", "ranges": [[0, 0]], "counts": {"bogus": 1}}',
    b" " * (MAX_ENTRY_BYTES + 1),
])
def test_decode_entry_refuses_what_is_not_lmdqs(raw: object) -> None:
    assert decode_entry(raw) is None


def test_entry_name_must_be_a_shard() -> None:
    with pytest.raises(ValidationError):
        ShardEntry(shard="results-1.jsonl", ranges=[(0, 0)])


def test_read_index_keeps_only_valid_entries_inside_the_batch(client: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    good = ShardEntry.of("results-000000.jsonl", [0, 1], [ResultStatus.completed] * 2)
    outside = ShardEntry.of("results-000001.jsonl", [2, 9], [ResultStatus.completed] * 2)
    client.hset(keys.shards("b"), mapping={"0": good.encode(), "1": outside.encode(), "x": good.encode(),
                                             "-1": good.encode(), "2": b"\xff garbage"})
    assert read_index(ResultStore(client, keys=keys), "b", total=4) == {0: good}


def _shard(tmp_path: Path, indices: list[int]) -> str:
    p = tmp_path / "results-000000.jsonl"
    p.write_bytes(b"".join(json.dumps({"index": i, "text": f"t{i}"}).encode() + b"\n" for i in indices))
    return str(p)


def test_read_shard_by_expected_indices_and_by_parsing(tmp_path: Path) -> None:
    uri = _shard(tmp_path, [3, 4, 8])
    got = read_shard(uri, [3, 4, 8])
    assert list(got) == [3, 4, 8] and json.loads(got[8])["text"] == "t8"
    # an index entry that does not match the file: every line is parsed, the file's own indices win
    assert list(read_shard(uri, [0, 1, 2])) == [3, 4, 8]


def test_read_shard_errors_are_results_unavailable(tmp_path: Path) -> None:
    with pytest.raises(ResultsUnavailable, match="cannot read"):
        read_shard(str(tmp_path / "absent.jsonl"), [0])
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"index": 0}\nnot json\n')
    with pytest.raises(ResultsUnavailable, match="not a result"):
        read_shard(str(bad), [0])
