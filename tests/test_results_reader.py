"""lmdq.results.reader: the ONE reader every export goes through, on a real Redis and a real folder
sink. A batch half sealed into shards and half still in Redis reads back complete and in input order
through every export path; a job sealed WHILE the batch is read is not missed; shards that a caller
does not need are never read; an index entry naming a file outside the batch's folder is never read."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from lmdq.contract import Batch, BatchStatus, JobPayload, Request, RequestCounts, Result, ResultStatus
from lmdq.errors import ResultsUnavailable
from lmdq.redis.keys import Keys
from lmdq.results.reader import ResultReader
from lmdq.results.shards import shard_key
from lmdq.results.sink import flush_job
from lmdq.results.store import ResultStore

N = 8
"""Requests of the test batch: 4 jobs of 2 (job j holds requests 2j and 2j+1)."""

FAILED = 5
"""The one request that ends failed (retry's source, OpenAI's error file)."""


def _batch(store: ResultStore, results_url: str | None, total: int = N) -> Batch:
    bid = f"batch_{time.time_ns():024x}"[:30]
    b = Batch(id=bid, model="sim", status=BatchStatus.in_progress, batch_size=2,
              request_counts=RequestCounts(total=total), created_at=time.time(), results_url=results_url)
    store.batches.create(b)
    return b


def _job(b: Batch, j: int) -> JobPayload:
    return JobPayload(batch_id=b.id, model="sim", job_no=j, results_url=b.results_url,
                      requests=[Request(index=i, custom_id=f"r{i}", prompt="p") for i in (2 * j, 2 * j + 1)])


def _answer(store: ResultStore, b: Batch, indices: range | list[int]) -> None:
    for i in indices:
        status = ResultStatus.failed if i == FAILED else ResultStatus.completed
        assert store.write_result(Result(batch_id=b.id, custom_id=f"r{i}", index=i, status=status, model="sim",
                                         text=f"answer {i}", generate_token_len=2))


def _seal(client: redis.Redis, keys: Keys, b: Batch, *jobs: int) -> None:
    for j in jobs:
        assert flush_job(client, keys, _job(b, j)) is not None


def _half_sealed(client: redis.Redis, prefix: str, tmp_path: Path) -> tuple[ResultStore, Batch]:
    """Every request answered; jobs 0 and 2 sealed into shards, jobs 1 and 3 still whole in Redis."""
    keys = Keys(prefix)
    store = ResultStore(client, keys=keys)
    b = _batch(store, str(tmp_path / "sink"))
    _answer(store, b, range(N))
    _seal(client, keys, b, 0, 2)
    assert sorted(int(k) for k in client.hkeys(keys.results(b.id))) == [2, 3, 6, 7]  # the others: shards only
    assert sorted(p.name for p in (tmp_path / "sink" / b.id).iterdir()) == [
        "results-000000.jsonl", "results-000002.jsonl"]
    return store, store.batches.get(b.id)


def _indices(raws: list[bytes]) -> list[int]:
    return [json.loads(r)["index"] for r in raws]


def _complete(raws: list[bytes]) -> None:
    recs = [json.loads(r) for r in raws]
    assert [r["index"] for r in recs] == list(range(N))
    assert [r["text"] for r in recs] == [f"answer {i}" for i in range(N)]


def test_a_half_sealed_batch_reads_complete_and_in_order_through_every_export_path(
        client: redis.Redis, redis_url: str, prefix: str, tmp_path: Path) -> None:
    from lmdq.results.export import iter_lmdq_lines
    from lmdq.results.openai import iter_openai
    from lmdq.submission.follow import Follower
    from tests.helpers import results_of

    store, b = _half_sealed(client, prefix, tmp_path)
    assert b.status is BatchStatus.completed

    # the reader itself, and ResultStore.iter_results (what tests/helpers.results_of reads through)
    _complete([raw for _, raw in ResultReader.of(store, b).records() if raw is not None])
    _complete([raw for _, raw in store.iter_results(b.id) if raw is not None])
    assert [r.index for r in results_of(client, prefix, b.id)] == list(range(N))
    # `lmdq-producer results` (lmdq JSONL and OpenAI lines)
    _complete(list(iter_lmdq_lines(store, b)))
    openai = list(iter_openai(store, b))
    assert [json.loads(line)["custom_id"] for _, line in openai] == [f"r{i}" for i in range(N)]
    assert [i for i, (err, _) in enumerate(openai) if err] == [FAILED]
    # `results --follow`, both orders, given the ended batch at the first poll
    for in_order in (False, True):
        f = Follower(store, b, in_order=in_order)
        _complete(f.poll(b))
        assert f.finished
    # retry's source: the failed request, found in its job's shard
    from lmdq.submission.ledger import BatchLedger

    assert BatchLedger(client, keys=Keys(prefix), ttl_s=3600).indices_with(b, {ResultStatus.failed}) == [FAILED]


def test_a_half_sealed_batch_reads_complete_through_the_python_api_and_the_http_api(
        client: redis.Redis, redis_url: str, prefix: str, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    import lmdq
    from lmdq.submission.settings import ProducerSettings

    _, b = _half_sealed(client, prefix, tmp_path)
    batch = lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix)).batch(b.id)
    assert [r.index for r in batch.results()] == list(range(N))
    _complete([line for _, line in batch.lines("lmdq")])
    assert [json.loads(line)["custom_id"] for _, line in batch.lines("openai")] == [f"r{i}" for i in range(N)]
    assert [r.index for r in batch.as_completed(timeout=10)] == list(range(N))
    table = batch.to_arrow()
    assert isinstance(table, pa.Table) and table.column("row").to_pylist() == list(range(N))
    assert table.column("text").to_pylist() == [f"answer {i}" for i in range(N)]
    assert batch.to_parquet(tmp_path / "out.parquet") == N
    assert pq.read_table(tmp_path / "out.parquet").column("row").to_pylist() == list(range(N))
    # the HTTP API's output file is written from the backend's OpenAI lines
    pytest.importorskip("fastapi")
    from lmdq.api.backend import Backend
    from lmdq.api.settings import ApiSettings

    backend = Backend(ApiSettings(redis_url=redis_url, key_prefix=prefix), client=client)
    lines = list(backend.openai_lines(backend.store.batches.get(b.id)))
    assert [json.loads(line)["custom_id"] for _, line in lines] == [f"r{i}" for i in range(N)]
    assert [i for i, (err, _) in enumerate(lines) if err] == [FAILED]


def test_jobs_sealed_while_the_batch_is_read_are_not_missed(client: redis.Redis, prefix: str,
                                                            tmp_path: Path) -> None:
    """The seal moves a job's records out of Redis between two chunks of one read: the reader reads the
    index after each Redis read that missed something, so it finds them in the shard."""
    keys = Keys(prefix)
    store = ResultStore(client, keys=keys)
    b = _batch(store, str(tmp_path / "sink"))
    _answer(store, b, range(N))
    _seal(client, keys, b, 0)
    it = ResultReader.of(store, store.batches.get(b.id), chunk=2).records(partial=False)
    first = [next(it), next(it)]  # job 0, from its shard (the index read: one entry)
    _seal(client, keys, b, 2, 3)  # after the reader's index read, before it reaches them
    rest = list(it)
    _complete([raw for _, raw in first + rest if raw is not None])
    assert client.hlen(keys.results(b.id)) == 2  # job 1 only: read from Redis, the rest from shards


def test_a_follower_finds_jobs_sealed_between_its_polls(client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    from lmdq.submission.follow import Follower

    keys = Keys(prefix)
    store = ResultStore(client, keys=keys)
    b = _batch(store, str(tmp_path / "sink"))
    f, g = Follower(store, b), Follower(store, b, in_order=True)
    _answer(store, b, [2, 3])
    assert _indices(f.poll(store.batches.get(b.id))) == [2, 3]  # from Redis
    assert g.poll(store.batches.get(b.id)) == []  # 0 is not in yet
    _seal(client, keys, b, 1)
    _answer(store, b, [0, 1])
    _seal(client, keys, b, 0)
    assert _indices(g.poll(store.batches.get(b.id))) == [0, 1, 2, 3]  # all four from the shards
    assert _indices(f.poll(store.batches.get(b.id))) == [0, 1]  # never 2 and 3 twice
    _answer(store, b, range(4, N))
    _seal(client, keys, b, 3)
    end = store.batches.get(b.id)
    assert _indices(f.poll(end)) == [4, 5, 6, 7] and f.finished
    assert _indices(g.poll(end)) == [4, 5, 6, 7] and g.finished


def test_need_skips_shards_without_reading_them(client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    keys = Keys(prefix)
    store = ResultStore(client, keys=keys)
    b = _batch(store, str(tmp_path / "sink"))
    _answer(store, b, range(N))
    _seal(client, keys, b, 0, 1, 2, 3)
    (tmp_path / "sink" / shard_key(b.id, 1)).unlink()  # job 1 holds no failure: it must not be read
    got = dict(ResultReader.of(store, store.batches.get(b.id)).records(
        partial=False, need=lambda e: e.has_any({ResultStatus.failed})))
    assert [i for i, raw in got.items() if raw is not None] == [4, 5]  # job 2's, the one with the failure
    with pytest.raises(ResultsUnavailable, match="cannot read results shard"):
        list(ResultReader.of(store, store.batches.get(b.id)).records())


def test_partials_fill_in_only_for_requests_with_no_final_anywhere(client: redis.Redis, prefix: str,
                                                                   tmp_path: Path) -> None:
    keys = Keys(prefix)
    store = ResultStore(client, keys=keys)
    b = _batch(store, str(tmp_path / "sink"), total=4)
    _answer(store, b, [0, 1])
    _seal(client, keys, b, 0)
    assert store.write_partial(Result(batch_id=b.id, custom_id="r2", index=2, status=ResultStatus.in_progress,
                                      model="sim", text="half"))
    reader = ResultReader.of(store, store.batches.get(b.id))
    with_partials = [(i, raw and json.loads(raw)["text"]) for i, raw in reader.records()]
    assert with_partials == [(0, "answer 0"), (1, "answer 1"), (2, "half"), (3, None)]
    assert [raw is None for _, raw in reader.records(partial=False)] == [False, False, True, True]
    assert [i for i, _ in store.iter_results(b.id, 2)] == [0, 1]  # ``total`` reads the first requests only


def test_an_index_entry_naming_a_file_outside_the_batch_folder_is_never_read(
        client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    """The index is read from Redis: an entry naming ``../../secret.jsonl``, or indices outside the batch,
    is left out, so its requests read as missing and nothing of that file is ever printed."""
    keys = Keys(prefix)
    store = ResultStore(client, keys=keys)
    b = _batch(store, str(tmp_path / "sink"), total=2)
    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"index": 0, "text": "TOP-SECRET"}\n{"index": 1, "text": "TOP-SECRET"}\n')
    client.hset(keys.shards(b.id), mapping={
        "0": json.dumps({"shard": "../../secret.jsonl", "ranges": [[0, 1]]}),
        "1": json.dumps({"shard": "results-000001.jsonl", "ranges": [[0, 5]]}),  # past the batch's end
        "x": b"\xff not json"})
    got = list(ResultReader.of(store, store.batches.get(b.id)).records())
    assert got == [(0, None), (1, None)]


def test_a_batch_without_a_record_reads_redis_only(client: redis.Redis, prefix: str) -> None:
    """``iter_results`` of a batch whose record is gone (purged, expired) reads what Redis still holds."""
    keys = Keys(prefix)
    store = ResultStore(client, keys=keys)
    client.hset(keys.results("gone"), "1", b'{"index": 1}')
    assert list(store.iter_results("gone", 3)) == [(0, None), (1, b'{"index": 1}'), (2, None)]


def test_a_half_sealed_batch_reads_complete_through_the_results_cli(
        client: redis.Redis, prefix: str, env: dict[str, str], tmp_path: Path) -> None:
    """``lmdq-producer results`` as a user runs it: lmdq JSONL, OpenAI lines (errors to their own file),
    Parquet, and ``--follow`` in both orders, on the same half-sealed batch."""
    from tests.conftest import run_cli

    _, b = _half_sealed(client, prefix, tmp_path)
    p = run_cli("lmdq.producer", "results", b.id, env=env)
    assert p.returncode == 0, p.stderr.decode()
    _complete(p.stdout.splitlines())
    p = run_cli("lmdq.producer", "results", b.id, "--format", "openai", "--errors-file", str(tmp_path / "err.jsonl"),
                env=env)
    assert p.returncode == 0, p.stderr.decode()
    assert [json.loads(x)["custom_id"] for x in p.stdout.splitlines()] == [f"r{i}" for i in range(N) if i != FAILED]
    assert [json.loads(x)["custom_id"] for x in (tmp_path / "err.jsonl").read_text().splitlines()] == [f"r{FAILED}"]
    for follow in (("--follow",), ("--follow", "--in-order")):
        p = run_cli("lmdq.producer", "results", b.id, *follow, env=env)
        assert p.returncode == 0, p.stderr.decode()
        _complete(p.stdout.splitlines())
    pq = pytest.importorskip("pyarrow.parquet")
    p = run_cli("lmdq.producer", "results", b.id, "-o", str(tmp_path / "out.parquet"), env=env)
    assert p.returncode == 0, p.stderr.decode()
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column("row").to_pylist() == list(range(N))
    assert table.column("text").to_pylist() == [f"answer {i}" for i in range(N)]
