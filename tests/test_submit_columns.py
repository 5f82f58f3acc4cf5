"""Issue 49: a Parquet file's rows validated column-wise, straight into submit's pass 1 (lmdq.client.sources
``_Columns``): the jobs staged are the ones the same rows give as lmdq JSONL, and a bad row still names its row
and column with nothing enqueued (real redis-server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

import lmdq
import lmdq.client.sources as sources
import lmdq.submission.submit as submit_mod
from lmdq.jobs.data import REQUESTS_FIELD, read_job
from lmdq.jobs.queue import SERIALIZER
from lmdq.redis.keys import Keys, queue_name, rq_queue_key
from lmdq.submission.settings import ProducerSettings

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TRICKY = ['say "hi" \\ then\nstop', "naïve café ☕ \u2028 end", "tab\there", "x" * 3000, "  padded  "]


@pytest.fixture()
def api(redis_url: str, prefix: str) -> lmdq.Client:
    return lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix))


def _rows(n: int, *, int_ids: bool = False) -> list[dict[str, Any]]:
    shared = "You are a careful grader. " * 60  # a prefix long enough to be grouped (prefix keys computed)
    rows = []
    for i in range(n):
        q = TRICKY[i % len(TRICKY)] if i % 7 == 3 else (shared if i % 3 == 0 else "") + f"question {i}?"
        rows.append({"qid": i * 10 + 1 if int_ids else f"q-{i:04d}\"{i % 2}", "question": q,
                     "max_new_tokens": None if i % 5 == 4 else 8 + i % 4,
                     "temperature": 0.0 if i % 6 == 1 else None})
    return rows


def _jsonl(rows: list[dict[str, Any]], path: Path) -> Path:
    with path.open("w") as f:
        for r in rows:
            params = {k: r[k] for k in ("max_new_tokens", "temperature") if r[k] is not None}
            f.write(json.dumps({"custom_id": r["qid"], "prompt": r["question"], **({"params": params} if params
                                                                                  else {})}) + "\n")
    return path


def _jobs(client: redis.Redis, prefix: str, batch_id: str) -> list[tuple[dict[str, Any], list[Any]]]:
    """Every staged job of the batch, in job order: (its payload less the batch id, its request manifest)."""
    out = []
    for job_id in client.lrange(Keys(prefix).batch_jobs(batch_id), 0, -1):
        job = read_job(client, job_id.decode(), serializer=SERIALIZER)
        payload = json.loads(job.data)[2][0]
        payload.pop("batch_id")
        out.append((payload, json.loads(client.hget(job.key, REQUESTS_FIELD))))
    return out


@pytest.mark.parametrize("int_ids", [False, True])
def test_parquet_rows_stage_the_jobs_their_jsonl_does_without_parsing_a_spool(
        api: lmdq.Client, client: redis.Redis, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        int_ids: bool) -> None:
    rows = _rows(60, int_ids=int_ids)
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=16)
    jsonl = _jsonl(rows, tmp_path / "rows.jsonl")
    b1 = api.submit(jsonl, model="sim", allow_unknown_model=True, batch_size=4)
    monkeypatch.setattr(sources, "ARROW_BATCH_ROWS", 7)  # several record batches, across row groups

    def no_parse(*a: Any, **k: Any) -> Any:
        raise AssertionError("the spool was parsed: the column path was not taken")

    monkeypatch.setattr(submit_mod, "_validate", no_parse)
    b2 = api.submit(tmp_path / "rows.parquet", model="sim", allow_unknown_model=True, batch_size=4,
                    prompt_column="question", id_column="qid", params_columns=["max_new_tokens", "temperature"])
    j1, j2 = _jobs(client, prefix, b1.id), _jobs(client, prefix, b2.id)
    assert len(j1) >= 15 and j1 == j2  # grouped by prefix: a group may leave a job short
    requests = [r for payload, _ in j2 for r in payload["requests"]]
    assert sorted(r["index"] for r in requests) == list(range(60))
    assert {r["prompt"] for r in requests} >= set(TRICKY)
    assert b1.info().request_counts.total == b2.info().request_counts.total == 60


def _submit_parquet(api: lmdq.Client, path: Path) -> None:
    api.submit(path, model="sim", allow_unknown_model=True, prompt_column="question", id_column="qid",
               params_columns=["max_new_tokens"])


@pytest.mark.parametrize("bad, says", [
    ({"question": " \t "}, "column 'question': expected some text, got only whitespace"),
    ({"question": None}, "column 'question': expected a value, got null"),
    ({"qid": None}, "column 'qid': expected a string or an integer id, got null"),
    ({"qid": ""}, "column 'qid': expected a non-empty string, got ''"),
    ({"max_new_tokens": 0}, "column 'max_new_tokens': "),
    ({"qid": "q-0003"}, "column 'qid': expected a unique id, 'q-0003' already used on row 4 (1-based)"),
])
def test_a_bad_parquet_row_late_in_the_file_names_row_and_column_and_enqueues_nothing(
        api: lmdq.Client, client: redis.Redis, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        bad: dict[str, Any], says: str) -> None:
    """The column path took the first record batches; a bad row in a later one is named exactly (its 1-based
    row, its column), and nothing is enqueued."""
    rows = [{"qid": f"q-{i:04d}", "question": f"question {i}?", "max_new_tokens": 8} for i in range(40)]
    rows[33].update(bad)
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([("qid", pa.string()), ("question", pa.string()),
                                                                ("max_new_tokens", pa.int64())])),
                   tmp_path / "bad.parquet")
    monkeypatch.setattr(sources, "ARROW_BATCH_ROWS", 10)
    with pytest.raises(lmdq.SubmitRejected) as e:
        _submit_parquet(api, tmp_path / "bad.parquet")
    assert str(e.value).startswith(f"{tmp_path / 'bad.parquet'}: row 34 (1-based): {says}"), str(e.value)
    assert e.value.row == 33
    assert client.keys(f"{prefix}:*") == []
    assert client.llen(rq_queue_key(queue_name("sim", "normal", prefix))) == 0


def test_the_column_path_checks_what_python_calls_whitespace(api: lmdq.Client, client: redis.Redis, prefix: str,
                                                             tmp_path: Path) -> None:
    """A prompt of only non-ASCII whitespace (U+3000, U+2029, the file separator) is refused as the row
    parser refuses it; one with a single visible non-ASCII character is a prompt."""
    for i, blank in enumerate(["\u3000\u2029", "\x1c\x1d"]):
        rows = [{"qid": "a", "question": "ok"}, {"qid": "b", "question": blank}]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"w{i}.parquet")
        with pytest.raises(lmdq.SubmitRejected, match=r"row 2 \(1-based\): column 'question': expected some text"):
            api.submit(tmp_path / f"w{i}.parquet", model="sim", allow_unknown_model=True, prompt_column="question",
                       id_column="qid")
        assert client.keys(f"{prefix}:*") == []
    pq.write_table(pa.Table.from_pylist([{"qid": "a", "question": "\u3000☕"}]), tmp_path / "ok.parquet")
    b = api.submit(tmp_path / "ok.parquet", model="sim", allow_unknown_model=True, prompt_column="question",
                   id_column="qid")
    assert b.info().request_counts.total == 1
