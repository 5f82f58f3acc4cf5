"""The Python API (lmdq.Client / lmdq.Batch) in-process, against a real redis-server and a real lmdq
worker (sim engine, in a thread of this process): every source kind gives the same results; as_completed
yields while later jobs of the batch have not started (a gate on the engine and its step counter, no
wall clock); a DataFrame with a bad row names row and column and enqueues nothing; cancel and retry;
Parquet / Arrow / pandas results with one schema; producer/cli.py makes no Redis or store call."""

from __future__ import annotations

import ast
import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis

import lmdq
from lmdq.contract import BatchStatus, ResultStatus
from lmdq.redis.keys import queue_name, rq_queue_key
from lmdq.submission.settings import ProducerSettings
from tests.conftest import ROOT

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pd = pytest.importorskip("pandas")

N = 7
QUESTIONS = [f"question number {i}: what comes after {i}?" for i in range(N)]
IDS = [f"q{i:02d}" for i in range(N)]


@pytest.fixture()
def api(redis_url: str, prefix: str) -> lmdq.Client:
    return lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix))


def _worker(redis_url: str, prefix: str, engine: Any = None, **settings: Any) -> Any:
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, health_port=0, **settings)
    return Worker(engine=engine or SimEngine(model_name="sim", step_ms=0), client=redis.Redis.from_url(redis_url),
                  settings=s)


def drain(redis_url: str, prefix: str) -> None:
    """Run a burst worker until the queue is empty (every queued job done)."""
    assert _worker(redis_url, prefix, burst=True).run() == 0


def _answers(batch: lmdq.Batch) -> list[tuple[str, int, str, str]]:
    return [(r.custom_id, r.index, r.status.value, r.text) for r in batch.results()]


# ---------------------------------------------------------------- every source kind, same results


def _sources(tmp_path: Path) -> dict[str, Any]:
    rows = [{"qid": q, "question": t, "max_new_tokens": 3 + i % 3} for i, (q, t) in enumerate(zip(IDS, QUESTIONS))]
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=3)  # several row groups
    pd.DataFrame(rows).to_csv(tmp_path / "d.csv", index=False)
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"custom_id": r["qid"], "prompt": r["question"],
                                         "params": {"max_new_tokens": r["max_new_tokens"]}}) + "\n" for r in rows))
    import polars as pl

    def gen() -> Iterator[dict[str, Any]]:
        yield from (dict(r) for r in rows)

    out: dict[str, Any] = {}
    try:
        import datasets  # not a CI dependency: covered where it is installed

        out["HF Dataset"] = datasets.Dataset.from_list(rows)
    except ImportError:
        pass
    return out | {
        "jsonl file": jsonl,
        "parquet file": tmp_path / "d.parquet",
        "csv file": str(tmp_path / "d.csv"),
        "list of dicts": rows,
        "generator of dicts": gen(),
        "pyarrow Table": table,
        "RecordBatchReader": pa.RecordBatchReader.from_batches(table.schema, table.to_batches(max_chunksize=2)),
        "pandas DataFrame": pd.DataFrame(rows),
        "polars DataFrame": pl.DataFrame(rows),
    }


def test_every_source_kind_gives_the_same_results(api: lmdq.Client, tmp_path: Path, redis_url: str,
                                                  prefix: str) -> None:
    batches: dict[str, lmdq.Batch] = {}
    for kind, src in _sources(tmp_path).items():
        columns: dict[str, Any] = {} if kind == "jsonl file" else {
            "prompt_column": "question", "id_column": "qid", "params_columns": ["max_new_tokens"]}
        batches[kind] = api.submit(src, model="sim", allow_unknown_model=True, batch_size=2, **columns)
    drain(redis_url, prefix)
    expected = _answers(batches["jsonl file"])
    assert [a[0] for a in expected] == IDS and {a[2] for a in expected} == {"completed"}
    for kind, b in batches.items():
        assert b.status() is BatchStatus.completed, kind
        assert _answers(b) == expected, kind
        assert [r.generate_token_len for r in b.results()] == [3 + i % 3 for i in range(N)], kind
    assert batches["pandas DataFrame"].info().input_file == "DataFrame"


def test_strings_dicts_and_templates(api: lmdq.Client, redis_url: str, prefix: str) -> None:
    plain = api.submit(iter(QUESTIONS), model="sim", allow_unknown_model=True, max_new_tokens=4)
    templated = api.submit(({"n": i} for i in range(N)), model="sim", allow_unknown_model=True, max_new_tokens=4,
                           template="question number {n}: what comes after {n}?")
    jsonl_like = api.submit([{"prompt": q} for q in QUESTIONS], model="sim", allow_unknown_model=True,
                            max_new_tokens=4)
    drain(redis_url, prefix)
    a, b, c = _answers(plain), _answers(templated), _answers(jsonl_like)
    assert a == b == c and [x[0] for x in a] == [str(i) for i in range(N)]  # no id column: the row number


# ---------------------------------------------------------------- bad rows: row and column, nothing enqueued


def _nothing_enqueued(client: redis.Redis, prefix: str) -> None:
    assert client.keys(f"{prefix}:*") == []
    assert client.llen(rq_queue_key(queue_name("sim", "normal", prefix))) == 0


@pytest.mark.parametrize("bad, says", [
    ({"question": "   "}, "index 4: column 'question': expected some text, got only whitespace ('   ')"),
    ({"question": None}, "index 4: column 'question': expected a value, got null"),
    ({"temperature": 9.0}, "index 4: column 'temperature': expected a number from 0.0 to 2.0, got 9.0"),
    ({"qid": "q01"}, "index 4: column 'qid': expected a unique id, 'q01' already used on index 1"),
])
def test_dataframe_with_a_bad_row_names_row_and_column_and_enqueues_nothing(
        api: lmdq.Client, client: redis.Redis, prefix: str, bad: dict[str, Any], says: str) -> None:
    rows = [{"qid": q, "question": t, "temperature": 0.5} for q, t in zip(IDS, QUESTIONS)]
    rows[4].update(bad)
    df = pd.DataFrame(rows)
    with pytest.raises(lmdq.SubmitRejected) as e:
        api.submit(df, model="sim", allow_unknown_model=True, prompt_column="question", id_column="qid",
                   params_columns=["temperature"])
    assert str(e.value).startswith(f"DataFrame: {says}"), str(e.value)
    assert (e.value.row, e.value.index) == (4, 4)
    assert e.value.exit_code == 2
    _nothing_enqueued(client, prefix)


def test_a_missing_column_and_a_bad_option_are_refused_before_reading(api: lmdq.Client, client: redis.Redis,
                                                                     prefix: str) -> None:
    df = pd.DataFrame({"question": QUESTIONS})
    with pytest.raises(lmdq.SubmitRejected, match="column 'qid' not found; the source has: question"):
        api.submit(df, model="sim", allow_unknown_model=True, prompt_column="question", id_column="qid")
    with pytest.raises(lmdq.SubmitRejected, match="^result_ttl: expected at least 60 seconds"):
        api.submit(df, model="sim", allow_unknown_model=True, prompt_column="question", result_ttl=5)
    with pytest.raises(lmdq.SubmitRejected, match="^max_new_tokens: "):
        api.submit(df, model="sim", allow_unknown_model=True, prompt_column="question", max_new_tokens=0)
    # the CLI's rule, declared once (lmdq.client.options.parse_window): a window as text takes its unit
    with pytest.raises(lmdq.SubmitRejected, match=r"^completion_window: expected a duration with its unit .*'2'"):
        api.submit(df, model="sim", allow_unknown_model=True, prompt_column="question", completion_window="2")
    with pytest.raises(TypeError, match="max_tokens_typo"):
        api.submit(df, model="sim", prompt_column="question", max_tokens_typo=3)
    with pytest.raises(lmdq.UnknownModel):
        api.submit(df, model="nobody-serves-this", prompt_column="question")
    _nothing_enqueued(client, prefix)


def test_a_generator_is_streamed_not_held(api: lmdq.Client, prefix: str) -> None:
    """The generator is consumed chunk by chunk: the submit reads it as it goes (the spool), it never
    asks for a length, and it reads all of it before anything is visible."""
    pulled: list[int] = []

    def rows() -> Iterator[str]:
        for i in range(20_000):
            pulled.append(i)
            yield f"prompt {i}"

    b = api.submit(rows(), model="sim", allow_unknown_model=True, batch_size=1000)
    assert len(pulled) == 20_000 and b.counts().total == 20_000 and b.status() is BatchStatus.queued


# ---------------------------------------------------------------- as_completed while the batch runs


class GatedSim:
    """A sim engine whose second and later ``stream`` calls (jobs) wait for ``gate``: while the test holds
    it, no later job of the batch can start, whatever the machine's speed."""

    def __init__(self) -> None:
        from lmdq.worker.engines.sim import SimEngine

        self.inner = SimEngine(model_name="sim", step_ms=0)
        self.gate = threading.Event()
        self.started: list[list[str]] = []  # prompts of each job that reached the engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def stream(self, requests: Sequence[Any], abort: threading.Event) -> Iterator[Any]:
        if self.started and not self.gate.wait(60):
            raise RuntimeError("gate never opened")
        self.started.append([r.prompt for r in requests])
        yield from self.inner.stream(requests, abort)


def test_as_completed_yields_while_later_jobs_have_not_started(api: lmdq.Client, redis_url: str,
                                                               prefix: str) -> None:
    b = api.submit([{"custom_id": f"r{i}", "prompt": f"p{i}"} for i in range(4)], model="sim",
                   allow_unknown_model=True, batch_size=1, max_new_tokens=5)
    engine = GatedSim()
    w = _worker(redis_url, prefix, engine=engine, jobs_in_flight=1)
    th = threading.Thread(target=w.run, daemon=True)
    th.start()
    try:
        it = b.as_completed(timeout=60)
        first = next(it)
        # the gate is still shut: only the first job ever reached the engine, and it ran exactly its 5 steps
        assert first.custom_id == "r0" and first.status is ResultStatus.completed
        assert engine.started == [["p0"]]
        assert engine.inner.steps == 5
        assert b.status() is not BatchStatus.completed and b.counts().done == 1
        engine.gate.set()
        rest = list(it)
        assert sorted(r.custom_id for r in rest) == ["r1", "r2", "r3"]
        assert b.status() is BatchStatus.completed
    finally:
        engine.gate.set()
        w.stop()
        th.join(30)


# ---------------------------------------------------------------- cancel and retry


def test_cancel_then_retry_through_the_api(api: lmdq.Client, redis_url: str, prefix: str) -> None:
    b = api.submit([f"prompt {i}" for i in range(12)], model="sim", allow_unknown_model=True, batch_size=4,
                   max_new_tokens=3, metadata={"run": "nightly"})
    info = b.cancel()  # no worker: every job was still queued
    assert info.status is BatchStatus.cancelled and info.request_counts.cancelled == 12
    assert {r.status for r in b.results()} == {ResultStatus.cancelled}
    with pytest.raises(lmdq.RetryRejected):
        b.retry()  # nothing failed: cancelled requests only with include_cancelled
    again = b.retry(include_cancelled=True)
    assert again.id != b.id and again.created and again.counts().total == 12
    drain(redis_url, prefix)
    assert again.wait(timeout=30, progress=False).status is BatchStatus.completed
    assert [r.custom_id for r in again.results()] == [str(i) for i in range(12)]
    assert api.batch(again.id).info().metadata["retry_of"] == b.id
    assert {x.id for x in api.batches(limit=5)} == {b.id, again.id}
    with pytest.raises(lmdq.BatchNotFound):
        api.batch("batch_000000000000000000000000")


def test_idempotency_key_returns_the_same_batch(api: lmdq.Client) -> None:
    a = api.submit(["x", "y"], model="sim", allow_unknown_model=True, idempotency_key="nightly-1")
    b = api.submit(["x", "y"], model="sim", allow_unknown_model=True, idempotency_key="nightly-1")
    assert a.id == b.id and a.created and not b.created


# ---------------------------------------------------------------- results as Arrow, pandas, Parquet


def test_results_as_arrow_pandas_and_parquet(api: lmdq.Client, tmp_path: Path, redis_url: str,
                                             prefix: str) -> None:
    from lmdq.results.export import RESULT_COLUMNS, result_schema

    rows = [{"qid": q, "question": t} for q, t in zip(IDS, QUESTIONS)]
    rows[2]["question"] = "[[sim:error]] this one fails"
    b = api.submit(pd.DataFrame(rows), model="sim", allow_unknown_model=True, prompt_column="question",
                   id_column="qid", max_new_tokens=4, logprobs=2)
    drain(redis_url, prefix)
    t = b.to_arrow()
    assert t.schema.equals(result_schema()) and [c for c, _, _ in RESULT_COLUMNS] == t.column_names
    assert t.column("custom_id").to_pylist() == IDS and t.column("row").to_pylist() == list(range(N))
    assert t.column("status").to_pylist()[2] == "failed" and t.column("error_code").to_pylist()[2]
    lp = t.column("logprobs").to_pylist()[0]
    assert len(lp) == 4 and len(lp[0]["top"]) == 2  # nested: one struct per generated token
    df = b.to_pandas()
    assert list(df["text"]) == [r.text for r in b.results()]
    out = tmp_path / "out.parquet"
    assert b.to_parquet(out) == N
    back = pq.read_table(out)
    assert back.equals(t) and json.loads(back.schema.metadata[b"lmdq.batch"])["id"] == b.id
    assert not (tmp_path / "out.parquet.tmp").exists()


def test_cli_submit_parquet_and_results_to_parquet(tmp_path: Path, env: dict[str, str], redis_url: str,
                                                   prefix: str) -> None:
    from tests.conftest import run_cli

    rows = [{"qid": q, "question": t, "split": "test"} for q, t in zip(IDS, QUESTIONS)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data.parquet")
    p = run_cli("lmdq.producer", "submit", str(tmp_path / "data.parquet"), "--prompt-column", "question",
                "--id-column", "qid", "--model", "sim", "--allow-unknown-model", "--max-new-tokens", "3", env=env)
    assert p.returncode == 0, p.stderr.decode()
    bid = p.stdout.decode().strip()
    drain(redis_url, prefix)
    p = run_cli("lmdq.producer", "results", bid, "-o", str(tmp_path / "out.parquet"), env=env)
    assert p.returncode == 0, p.stderr.decode()
    t = pq.read_table(tmp_path / "out.parquet")
    assert t.column("custom_id").to_pylist() == IDS and set(t.column("status").to_pylist()) == {"completed"}
    rows[3]["question"] = ""
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    p = run_cli("lmdq.producer", "submit", str(tmp_path / "bad.parquet"), "--prompt-column", "question",
                "--model", "sim", "--allow-unknown-model", env=env)
    err = p.stderr.decode()
    # the file's rows are counted from 1 (issue 45), and the message says so
    assert p.returncode == 2 and f"{tmp_path / 'bad.parquet'}: row 4 (1-based): column 'question': expected a " \
        "non-empty" in err, err


# ---------------------------------------------------------------- the CLI is a thin client


#: Modules that talk to Redis or a results store, or hold submit/cancel/retry logic: the CLI reaches
#: them only through lmdq.Client.
_BELOW_THE_API = {"redis", "rq", "lmdq.redis.connection", "lmdq.results.store", "lmdq.submission.ledger",
                  "lmdq.registry.store", "lmdq.redis.keys", "lmdq.results.sink", "lmdq.jobs.queue",
                  "lmdq.submission.submit", "lmdq.submission.retry", "lmdq.submission.cancel",
                  "lmdq.results.openai", "lmdq.results.export", "lmdq.results.reader", "lmdq.results.writer",
                  "lmdq.batches.records", "lmdq.submission.formats", "lmdq.batches.headroom", "lmdq.guided"}
_REDIS_COMMANDS = {"hget", "hset", "hgetall", "hmget", "lrange", "llen", "rpush", "zadd", "zrevrange",
                   "pipeline", "execute", "eval", "evalsha", "register_script", "keys", "scan", "delete",
                   "get_batch", "list_batches", "iter_results", "write_result", "enqueue", "purge_batch",
                   "newest", "get_many", "read_records", "new_finals"}


def _cli_imports_and_calls(source: str) -> tuple[set[str], set[str]]:
    tree = ast.parse(source)
    imported: set[str] = set()
    called: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            called.add(node.func.attr)
    return imported, called


def test_the_check_below_can_fail() -> None:
    imported, called = _cli_imports_and_calls(
        "from lmdq.results.store import ResultStore\nimport redis\ndef f(c):\n    c.hgetall('k')\n")
    assert {"lmdq.results.store", "redis"} <= imported and "hgetall" in called


def test_producer_cli_makes_no_redis_or_store_call() -> None:
    imported, called = _cli_imports_and_calls((ROOT / "producer/cli.py").read_text())
    below = {m for m in imported if any(m == b or m.startswith(b + ".") for b in _BELOW_THE_API)}
    assert not below, below
    assert not called & _REDIS_COMMANDS, called & _REDIS_COMMANDS
    assert "lmdq.client.client" in imported


def test_the_column_wise_fast_path_spools_exactly_what_the_row_parser_does(tmp_path: Path) -> None:
    """Arrow record batches of the common shape skip the per-row parser; the spool must be the same bytes."""
    from lmdq.client.sources import classify, spool
    from lmdq.submission.formats.tabular import ColumnMap

    rows = [{"qid": f"id-{i}", "question": f"q {i} \u00e9\u4e2d \"quoted\"\n", "temperature": [None, 0.0, 0.7][i % 3],
             "max_tokens": 5 + i % 2} for i in range(10_000)]
    cmap = ColumnMap(prompt_column="question", id_column="qid", params_columns=["temperature", "max_tokens"])
    from lmdq.client.sources import _FastPath
    from lmdq.submission.formats.tabular import RowMapper

    table = pa.Table.from_pylist(rows)
    fast = _FastPath(cmap, RowMapper("t", cmap), table.schema)
    assert fast.ok and fast.lines(table.to_batches()[0], 0) is not None  # the fast path does take these rows
    out = {}
    for kind, src in (("arrow", pa.Table.from_pylist(rows)), ("rows", rows)):
        with (tmp_path / kind).open("wb") as f:
            assert spool(classify(src, fmt=None, cmap=cmap), cmap, f) == 10_000
        out[kind] = (tmp_path / kind).read_bytes()
    assert out["arrow"] == out["rows"] and out["rows"].count(b"\n") == 10_000


def test_openai_names_of_generation_options_are_accepted_as_in_files(api: lmdq.Client, redis_url: str,
                                                                    prefix: str) -> None:
    """Issue 45: ``submit(..., max_tokens=5)`` was a TypeError though JSONL and OpenAI bodies take the alias;
    ``max_tokens``, ``seed`` and ``stop`` now set ``max_new_tokens``, ``random_seed`` and ``stop_words``, and
    passing both spellings is refused by name."""
    aliased = api.submit(["hi", "there"], model="sim", allow_unknown_model=True, max_tokens=5, seed=7, stop=["\n"])
    named = api.submit(["hi", "there"], model="sim", allow_unknown_model=True, max_new_tokens=5, random_seed=7,
                       stop_words=["\n"])
    drain(redis_url, prefix)
    assert [r.generate_token_len for r in aliased.results()] == [5, 5]
    assert _answers(aliased) == _answers(named)
    with pytest.raises(lmdq.SubmitRejected, match="^max_tokens: the same option as max_new_tokens"):
        api.submit(["hi"], model="sim", allow_unknown_model=True, max_tokens=5, max_new_tokens=6)


def test_results_is_an_iterator_as_the_docs_say(api: lmdq.Client, redis_url: str, prefix: str) -> None:
    """Issue 45: docs/python-api.md described a list; it is an iterator (memory flat in the batch's size),
    and the docs now say so and how to slice it."""
    from collections.abc import Iterator

    b = api.submit(["a", "b", "c", "d"], model="sim", allow_unknown_model=True, max_new_tokens=2)
    drain(redis_url, prefix)
    it = b.results()
    assert isinstance(it, Iterator)
    assert [r.index for r in list(b.results())[:3]] == [0, 1, 2]
    doc = (ROOT / "docs" / "python-api.md").read_text()
    assert "| `.results()` | an iterator" in doc and "list(b.results())[:3]" in doc


def test_a_column_option_on_string_rows_is_an_error_not_ignored(api: lmdq.Client, client: redis.Redis,
                                                                 prefix: str) -> None:
    """Issue 45: ``prompt_column=`` on a list of strings was silently ignored."""
    with pytest.raises(lmdq.InvalidArgument, match="^prompt_column: the rows are strings") as e:
        api.submit(["a", "b"], model="sim", allow_unknown_model=True, prompt_column="question")
    assert e.value.field == "prompt_column" and e.value.value == "question"
    _nothing_enqueued(client, prefix)


def test_a_dataframe_warning_names_the_dataframe_and_its_rows_not_a_spool_file(api: lmdq.Client) -> None:
    """Issue 45: ``warning: /tmp/lmdq-spool-.../rows.jsonl: 1 line set temperature ... (first: line 1)``."""
    import pandas as pd

    seen: list[str] = []
    df = pd.DataFrame({"question": ["a?", "b?"], "temperature": [0.0, 0.7]})
    api.submit(df, model="sim", allow_unknown_model=True, prompt_column="question", params_columns=["temperature"],
               on_warning=seen.append)
    warned = [w for w in seen if "temperature" in w]
    assert warned, seen
    assert all("lmdq-spool" not in w and "rows.jsonl" not in w for w in seen), seen
    assert warned[0].startswith("DataFrame: 2 rows set temperature") and "(first: index 0)" in warned[0], warned


def test_a_mixed_object_column_is_an_lmdq_error_naming_row_and_column(api: lmdq.Client, client: redis.Redis,
                                                                       prefix: str) -> None:
    """Issue 45: a pandas object column mixing str and int raised a raw pyarrow ArrowTypeError, no row."""
    import pandas as pd

    df = pd.DataFrame({"question": ["a?", "b?", 3, "d?"]})
    with pytest.raises(lmdq.SubmitRejected, match=r"^DataFrame: index 2: column 'question': expected a str") as e:
        api.submit(df, model="sim", allow_unknown_model=True, prompt_column="question")
    assert (e.value.row, e.value.index, e.value.column, e.value.value) == (2, 2, "question", 3)
    _nothing_enqueued(client, prefix)


def test_a_csv_prompt_or_id_that_looks_numeric_is_read_as_the_text_in_the_file(api: lmdq.Client, tmp_path: Path,
                                                                              redis_url: str, prefix: str) -> None:
    """Issue 45: a CSV prompt column of digits was refused (``expected a string, got 1``), and an id like
    ``007`` would lose its zeros: both are text as written."""
    f = tmp_path / "q.csv"
    f.write_text("qid,question\n007,1\n010,22\n")
    b = api.submit(f, model="sim", allow_unknown_model=True, prompt_column="question", id_column="qid",
                   max_new_tokens=2)
    drain(redis_url, prefix)
    assert [(r.custom_id, r.status.value) for r in b.results()] == [("007", "completed"), ("010", "completed")]


def test_gen_config_takes_lmdeploys_generation_config_or_a_dict(api: lmdq.Client, redis_url: str,
                                                               prefix: str) -> None:
    """Issue 45: ``gen_config=GenerationConfig(...)`` was a TypeError. LMDeploy's own class (installed here,
    as on a GPU worker) maps to the options; a field lmdq lacks is refused by name."""
    from lmdeploy import GenerationConfig

    a = api.submit(["hi", "yo"], model="sim", allow_unknown_model=True,
                   gen_config=GenerationConfig(max_new_tokens=3, random_seed=5))
    b = api.submit(["hi", "yo"], model="sim", allow_unknown_model=True, gen_config={"max_new_tokens": 3, "seed": 5})
    drain(redis_url, prefix)
    assert [r.generate_token_len for r in a.results()] == [3, 3]
    assert _answers(a) == _answers(b)
    with pytest.raises(lmdq.InvalidArgument, match="^gen_config.return_ppl: lmdq does not support") as e:
        api.submit(["hi"], model="sim", allow_unknown_model=True, gen_config=GenerationConfig(return_ppl=True))
    assert e.value.field == "gen_config.return_ppl"
    with pytest.raises(lmdq.InvalidArgument, match="^gen_config.max_new_tokens: also given"):
        api.submit(["hi"], model="sim", allow_unknown_model=True, max_new_tokens=4,
                   gen_config=GenerationConfig(max_new_tokens=3))


def test_an_unknown_model_is_worded_in_the_python_callers_terms(api: lmdq.Client, tmp_path: Path) -> None:
    """Issue 45: from Python, ``UnknownModel: --model: unknown model ... or pass --allow-unknown-model`` named
    CLI flags; it now names ``model=`` and ``allow_unknown_model=True`` (the CLI keeps its flags:
    tests/test_cli_errors.py)."""
    from lmdq.errors import UnknownModel

    for source in (["hi"], [{"prompt": "hi"}]):
        with pytest.raises(UnknownModel) as e:
            api.submit(source, model="no-such-model")
        text = str(e.value)
        assert text.startswith("model=: unknown model 'no-such-model'"), text
        assert text.endswith("or pass allow_unknown_model=True to queue anyway."), text
        assert "--" not in text, text


def test_gen_config_as_a_dict_of_all_its_fields_and_asdict_as_keywords(api: lmdq.Client, redis_url: str,
                                                                       client: redis.Redis, prefix: str) -> None:
    """Issue 45: ``gen_config=dataclasses.asdict(GenerationConfig(...))`` (every field, most at LMDeploy's
    defaults) was refused on its first unsupported default, and ``**asdict(gen_config)`` was a TypeError
    listing lmdq's options; a dict's fields at LMDeploy's defaults are now skipped as the dataclass's are,
    and the keywords' TypeError says to pass ``gen_config=``."""
    import dataclasses

    from lmdeploy import GenerationConfig

    gc = GenerationConfig(max_new_tokens=3, random_seed=5)
    a = api.submit(["hi", "yo"], model="sim", allow_unknown_model=True, gen_config=dataclasses.asdict(gc))
    assert a.info().params.max_new_tokens == 3 and a.info().params.random_seed == 5
    with pytest.raises(lmdq.InvalidArgument, match="^gen_config.return_ppl: lmdq does not support"):
        api.submit(["hi"], model="sim", allow_unknown_model=True,
                   gen_config=dataclasses.asdict(GenerationConfig(return_ppl=True)))
    with pytest.raises(TypeError, match=r"GenerationConfig fields as keywords .*gen_config=GenerationConfig"):
        api.submit(["hi"], model="sim", allow_unknown_model=True, **dataclasses.asdict(gc))  # type: ignore[misc]
    drain(redis_url, prefix)
    assert [r.generate_token_len for r in a.results()] == [3, 3]


def test_a_params_column_naming_no_parameter_is_one_error_before_any_row(api: lmdq.Client, client: redis.Redis,
                                                                         prefix: str) -> None:
    """Issue 45: ``params_columns=["mnt"]`` was refused once per row, each a 286-column line."""
    df = pd.DataFrame({"question": ["a", "b", "c"], "mnt": [3, 4, 5]})
    with pytest.raises(lmdq.InvalidArgument) as e:
        api.submit(df, model="sim", allow_unknown_model=True, prompt_column="question", params_columns=["mnt"])
    assert str(e.value).startswith("params_columns=: 'mnt' is not a generation parameter (max_new_tokens, ")
    assert "row" not in str(e.value) and e.value.field == "params_columns"
    with pytest.raises(lmdq.InvalidArgument, match="^params_columns=: 'mnt' is not"):
        api.submit(df, model="sim", allow_unknown_model=True, prompt_column="question",
                   params_columns={"question": "mnt"})
    _nothing_enqueued(client, prefix)
    b = api.submit(df, model="sim", allow_unknown_model=True, prompt_column="question",
                   params_columns={"mnt": "max_tokens"})  # a mapping to a parameter (or its OpenAI name) is fine
    assert b.counts().total == 3


# ---------------------------------------------------------------- rows named as their user counts them (issue 45)


def _bad_third_row() -> list[dict[str, Any]]:
    rows = [{"qid": q, "question": t} for q, t in zip(IDS, QUESTIONS)]
    rows[3]["question"] = "   "
    return rows


def test_a_dataframe_row_is_named_by_its_index_label(api: lmdq.Client, client: redis.Redis, prefix: str) -> None:
    """Issue 45: a DataFrame's bad row was ``row 3`` (0-based, unsaid); its user finds it by its index label:
    ``index 'a7'`` (``df.loc``), while ``e.row`` stays its ``df.iloc`` position."""
    df = pd.DataFrame(_bad_third_row(), index=[f"a{2 * i + 1}" for i in range(N)])  # labels that are not positions
    with pytest.raises(lmdq.SubmitRejected) as e:
        api.submit(df, model="sim", allow_unknown_model=True, prompt_column="question", id_column="qid")
    assert str(e.value) == "DataFrame: index 'a7': column 'question': expected some text, got only whitespace " \
        "('   ')"
    assert (e.value.row, e.value.index, e.value.column) == (3, "a7", "question")
    assert df.loc[e.value.index, "question"] == df.iloc[e.value.row]["question"] == "   "
    # an integer index is named by its label too, and a duplicate id names the label that used it first
    dup = pd.DataFrame({"qid": ["x", "y", "x"], "question": ["a", "b", "c"]}, index=[10, 42, 7])
    with pytest.raises(lmdq.SubmitRejected) as e:
        api.submit(dup, model="sim", allow_unknown_model=True, prompt_column="question", id_column="qid")
    assert str(e.value) == "DataFrame: index 7: column 'qid': expected a unique id, 'x' already used on index 10"
    assert (e.value.row, e.value.index) == (2, 7) and type(e.value.index) is int
    _nothing_enqueued(client, prefix)


def test_a_dataframe_warning_and_a_late_error_name_index_labels_not_spool_lines(api: lmdq.Client, client: redis.Redis,
                                                                                prefix: str) -> None:
    """What the file pipeline finds in the spool (a warning's first row, a row's unknown model) is said of
    the DataFrame's rows by index label: no spool line, no temporary path."""
    seen: list[str] = []
    df = pd.DataFrame({"question": ["a?", "b?", "c?"], "temperature": [0.0, 0.7, 0.7]}, index=["p", "q", "r"])
    api.submit(df, model="sim", allow_unknown_model=True, prompt_column="question", params_columns=["temperature"],
               on_warning=seen.append)
    warned = [w for w in seen if "temperature" in w]
    assert warned and "(first: index 'p')" in warned[0], seen
    models = pd.DataFrame({"question": ["a?", "b?"], "model": ["sim", "nobody-serves-this"]}, index=["m1", "m2"])
    api.register_models(["sim"])
    with pytest.raises(lmdq.LmdqError) as e:
        api.submit(models, prompt_column="question", model_column="model")
    text = str(e.value)
    assert text.startswith("DataFrame: index 'm2': "), text
    assert "lmdq-spool" not in text and "rows.jsonl" not in text and "line" not in text, text


@pytest.mark.parametrize("kind", ["pyarrow Table", "list of dicts", "generator of dicts"])
def test_an_in_memory_row_is_named_by_its_position_said_0_based(api: lmdq.Client, client: redis.Redis, prefix: str,
                                                                 kind: str) -> None:
    """Issue 45: ``rows: row 3`` did not say which count; in-memory rows are positions, said 0-based."""
    rows = _bad_third_row()
    source: Any = {"pyarrow Table": pa.Table.from_pylist(rows), "list of dicts": rows,
                   "generator of dicts": (r for r in rows)}[kind]
    name = "Table" if kind == "pyarrow Table" else "rows"
    with pytest.raises(lmdq.SubmitRejected) as e:
        api.submit(source, model="sim", allow_unknown_model=True, prompt_column="question", id_column="qid")
    assert str(e.value) == f"{name}: row 3 (0-based): column 'question': expected some text, got only " \
        "whitespace ('   ')"
    assert (e.value.row, e.value.index, e.value.column, e.value.source) == (3, None, "question", name)
    _nothing_enqueued(client, prefix)


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_a_tabular_files_row_is_named_1_based_and_said_so(api: lmdq.Client, client: redis.Redis, prefix: str,
                                                          tmp_path: Path, suffix: str) -> None:
    """Issue 45: a Parquet/CSV file's rows are counted from 1, as a viewer or spreadsheet shows them (the CSV
    header not counted); ``e.row`` is the 0-based position still (``table.slice(e.row, 1)``)."""
    f = tmp_path / f"q.{suffix}"
    rows = _bad_third_row()
    if suffix == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), f)
    else:
        pd.DataFrame(rows).to_csv(f, index=False)
    with pytest.raises(lmdq.SubmitRejected) as e:
        api.submit(f, model="sim", allow_unknown_model=True, prompt_column="question", id_column="qid")
    assert str(e.value) == f"{f}: row 4 (1-based): column 'question': expected some text, got only " \
        "whitespace ('   ')"
    assert (e.value.row, e.value.index, e.value.line) == (3, None, None)
    _nothing_enqueued(client, prefix)


def test_a_prompt_files_line_is_1_based(api: lmdq.Client, client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    """A JSONL file's problem names its 1-based line (``q.jsonl:4``), as editors number them."""
    f = tmp_path / "q.jsonl"
    f.write_text("".join(json.dumps({"custom_id": r["qid"], "prompt": r["question"]}) + "\n"
                         for r in _bad_third_row()))
    with pytest.raises(lmdq.SubmitRejected) as e:
        api.submit(f, model="sim", allow_unknown_model=True)
    assert str(e.value).startswith(f"{f}:4: field 'prompt': "), str(e.value)
    assert (e.value.line, e.value.row, e.value.index) == (4, None, None)
    _nothing_enqueued(client, prefix)
