"""One batch over several models (issue 24): each line's ``model`` routes it to that model's queue.

Real redis-server, real CLIs as processes, sim workers (one per model, ``--burst``): the jobs never mix
models, every model must be known or the submit fails naming the line with nothing enqueued, status
counts per model, and every export keeps input order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from lmdq.contract import BatchStatus, Result, ResultStatus
from lmdq.jobs.queue import JobQueue
from lmdq.redis.keys import Keys, queue_names, rq_queue_key
from lmdq.results.store import ResultStore
from tests.conftest import run_cli, start_worker
from tests.helpers import wait_batch, write_jsonl

MODELS = ("m-alpha", "m-beta", "m-gamma")


def _sim(model: str) -> tuple[str, ...]:
    return ("--engine", "sim", "--served-model-name", model, "--sim-step-ms", "1", "--burst")


def _rows(n: int) -> list[dict[str, Any]]:
    """Lines naming the three models in an uneven interleave (a shared long prefix for some, so prefix
    grouping is on and must still keep models apart)."""
    doc = "shared document " * 80
    out = []
    for i in range(n):
        model = MODELS[(i * 7 + i // 5) % 3]
        prompt = f"{doc} question {i}" if i % 4 == 0 else f"question number {i}"
        out.append({"custom_id": f"r{i}", "prompt": prompt, "model": model})
    return out


def _keys_added(client: redis.Redis, before: set[bytes], prefix: str) -> list[bytes]:
    now = set(client.scan_iter(f"{prefix}:*")) | set(client.scan_iter(f"rq:queue:{prefix}:*"))
    return sorted(k for k in now - before if not k.startswith(f"{prefix}:models".encode()))


def _register(env: dict[str, str], *names: str) -> None:
    p = run_cli("lmdq.producer", "models", "add", *names, env=env)
    assert p.returncode == 0, p.stderr.decode()


def _queued_jobs(client: redis.Redis, prefix: str, model: str) -> list[Any]:
    jq = JobQueue(client, keys=Keys(prefix))
    ids = []
    for q in queue_names(model, prefix):
        ids += [x.decode() for x in client.lrange(rq_queue_key(q), 0, -1)]
    return [JobQueue.payload_of(jq.fetch_job(j)) for j in ids]


def test_batch_over_three_models_routes_and_counts_in_input_order(
        tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str) -> None:
    rows = _rows(90)
    want = {m: sum(1 for r in rows if r["model"] == m) for m in MODELS}
    assert all(want.values())
    _register(env, *MODELS)
    f = write_jsonl(tmp_path / "three.jsonl", rows)
    p = run_cli("lmdq.producer", "submit", str(f), "--batch-size", "4", "--max-new-tokens", "5", "--json", env=env)
    assert p.returncode == 0, p.stderr.decode()
    batch = json.loads(p.stdout)
    bid = batch["id"]
    assert batch["model"] == rows[0]["model"]
    assert {m: c["total"] for m, c in batch["model_counts"].items()} == want
    assert list(batch["model_counts"]) == list(dict.fromkeys(r["model"] for r in rows))  # first-named order

    # before any worker: each model's queue holds only its own jobs, and they hold only its requests
    seen: set[int] = set()
    for m in MODELS:
        jobs = _queued_jobs(client, prefix, m)
        assert jobs and all(j.model == m for j in jobs)
        idx = [r.index for j in jobs for r in j.requests]
        assert all(rows[i]["model"] == m for i in idx), m
        assert all(len(j.requests) <= 4 for j in jobs)
        seen.update(idx)
    assert seen == set(range(len(rows)))
    assert sum(len(_queued_jobs(client, prefix, m)) for m in MODELS) == batch["num_jobs"]

    workers = [start_worker(*_sim(m), env=env) for m in MODELS]
    assert [w.wait(120) for w in workers] == [0, 0, 0]
    b = wait_batch(client, prefix, bid)
    assert b.status is BatchStatus.completed and b.request_counts.completed == len(rows)
    assert b.model_counts is not None
    assert {m: (c.total, c.completed, c.failed) for m, c in b.model_counts.items()} == {
        m: (n, n, 0) for m, n in want.items()}

    out = run_cli("lmdq.producer", "results", bid, env=env)
    assert out.returncode == 0, out.stderr.decode()
    results = [Result.model_validate_json(x) for x in out.stdout.splitlines()]
    assert [r.custom_id for r in results] == [r["custom_id"] for r in rows]
    assert [r.model for r in results] == [r["model"] for r in rows]  # each ran on its own model's worker
    assert all(r.status is ResultStatus.completed for r in results)
    oai = run_cli("lmdq.producer", "results", bid, "--format", "openai", env=env)
    assert oai.returncode == 0, oai.stderr.decode()
    lines = [json.loads(x) for x in oai.stdout.splitlines()]
    assert [x["custom_id"] for x in lines] == [r["custom_id"] for r in rows]
    assert [x["response"]["body"]["model"] for x in lines] == [r["model"] for r in rows]
    pq = tmp_path / "out.parquet"
    assert run_cli("lmdq.producer", "results", bid, "-o", str(pq), env=env).returncode == 0
    import pyarrow.parquet as papq

    table = papq.read_table(pq)
    assert table.column("custom_id").to_pylist() == [r["custom_id"] for r in rows]
    assert table.column("model").to_pylist() == [r["model"] for r in rows]

    st = run_cli("lmdq.producer", "status", bid, env=env)
    text = st.stdout.decode()
    assert st.returncode == 0 and f"models={','.join(batch['model_counts'])}" in text
    for m, n in want.items():
        assert f"  model={m}  total={n} completed={n} failed=0" in text


def test_unknown_model_on_line_k_fails_naming_it_with_nothing_enqueued(
        tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str) -> None:
    _register(env, "m-alpha", "m-beta")
    rows = _rows(12)
    for r in rows:
        r["model"] = "m-alpha" if r["model"] == "m-gamma" else r["model"]
    rows[6]["model"] = "m-nope"  # line 7
    rows[9]["model"] = "m-nope"
    f = write_jsonl(tmp_path / "bad.jsonl", rows)
    before = set(client.scan_iter(f"{prefix}:*")) | set(client.scan_iter(f"rq:queue:{prefix}:*"))
    p = run_cli("lmdq.producer", "submit", str(f), env=env)
    err = p.stderr.decode()
    assert p.returncode != 0, err
    assert f"{f}:7: field 'model': unknown model 'm-nope'" in err and "Traceback" not in err
    assert ":10:" not in err  # one line per unknown model: where it was first named
    assert _keys_added(client, before, prefix) == []
    # an OpenAI file names the field body.model
    oai = [{"custom_id": f"o{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m-beta" if i != 2 else "m-nope", "messages": [{"role": "user", "content": "hi"}]}}
           for i in range(4)]
    f2 = write_jsonl(tmp_path / "bad-openai.jsonl", oai)
    p = run_cli("lmdq.producer", "submit", str(f2), env=env)
    assert p.returncode != 0 and f"{f2}:3: field 'body.model': unknown model 'm-nope'" in p.stderr.decode()
    assert _keys_added(client, before, prefix) == []


@pytest.mark.parametrize("bad, message", [
    ({"model": "has space"}, "field 'model': model name"),
    ({"model": 7}, "field 'model': expected a served model name (a string), got 7"),
])
def test_bad_model_names_on_a_line_are_refused_by_line(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                                       prefix: str, bad: dict[str, Any], message: str) -> None:
    rows = [{"custom_id": "a", "prompt": "x", "model": "m-alpha"}, {"custom_id": "b", "prompt": "y", **bad}]
    f = write_jsonl(tmp_path / "bad.jsonl", rows)
    p = run_cli("lmdq.producer", "submit", str(f), "--allow-unknown-model", env=env)
    assert p.returncode == 2, p.stderr.decode()
    assert f"{f}:2: {message}" in p.stderr.decode()


def test_lines_naming_none_in_a_several_model_file_are_refused(tmp_path: Path, env: dict[str, str],
                                                               client: redis.Redis, prefix: str) -> None:
    rows = [{"custom_id": "a", "prompt": "x", "model": "m-alpha"}, {"custom_id": "b", "prompt": "y"},
            {"custom_id": "c", "prompt": "z", "model": "m-beta"}]
    f = write_jsonl(tmp_path / "mixed.jsonl", rows)
    p = run_cli("lmdq.producer", "submit", str(f), "--allow-unknown-model", env=env)
    assert p.returncode == 2
    assert f"{f}:2: field 'model': expected a model name: the file names several models" in p.stderr.decode()
    # --model still sets every line's: one batch of one model
    p = run_cli("lmdq.producer", "submit", str(f), "--model", "m-alpha", "--allow-unknown-model", "--json", env=env)
    assert p.returncode == 0, p.stderr.decode()
    b = json.loads(p.stdout)
    assert b["model"] == "m-alpha" and b.get("model_counts") is None


def test_python_api_model_column_and_counts_by_model(env: dict[str, str], client: redis.Redis,
                                                     prefix: str) -> None:
    import lmdq
    from lmdq.submission.settings import ProducerSettings

    _register(env, *MODELS[:2])
    rows = [{"q": f"question {i}", "which": MODELS[i % 2]} for i in range(10)]
    url = env["LMDQ_REDIS_URL"]
    c = lmdq.Client(url, settings=ProducerSettings(redis_url=url, key_prefix=prefix))
    batch = c.submit(rows, prompt_column="q", model_column="which", batch_size=3)
    assert {m: n.total for m, n in batch.counts_by_model().items()} == {MODELS[0]: 5, MODELS[1]: 5}
    for m in MODELS[:2]:
        assert start_worker(*_sim(m), env=env).wait(120) == 0
    info = batch.wait(timeout=60, progress=False)
    assert info.status is BatchStatus.completed
    assert {m: n.completed for m, n in batch.counts_by_model().items()} == {MODELS[0]: 5, MODELS[1]: 5}
    got = list(batch.results())
    assert [r.index for r in got] == list(range(10)) and [r.model for r in got] == [r["which"] for r in rows]
    df = batch.to_pandas()
    assert list(df["model"]) == [r["which"] for r in rows]
    # a row without a model under model_column: refused by row and column
    with pytest.raises(lmdq.SubmitRejected, match="column 'which'"):
        c.submit([{"q": "x", "which": MODELS[0]}, {"q": "y", "which": None}], prompt_column="q",
                 model_column="which")
    assert ResultStore(client, keys=Keys(prefix)).batches.newest(10)[0].id == batch.id


def test_cancel_of_a_several_model_batch_answers_every_queue(tmp_path: Path, env: dict[str, str],
                                                             client: redis.Redis, prefix: str) -> None:
    _register(env, *MODELS)
    rows = _rows(30)
    f = write_jsonl(tmp_path / "c.jsonl", rows)
    p = run_cli("lmdq.producer", "submit", str(f), "--batch-size", "4", env=env)
    assert p.returncode == 0, p.stderr.decode()
    bid = p.stdout.decode().strip()
    c = run_cli("lmdq.producer", "cancel", bid, env=env)
    assert c.returncode == 0, c.stderr.decode()
    b = wait_batch(client, prefix, bid)
    assert b.status is BatchStatus.cancelled and b.request_counts.cancelled == 30
    assert b.model_counts is not None
    assert {m: x.cancelled for m, x in b.model_counts.items()} == {
        m: sum(1 for r in rows if r["model"] == m) for m in MODELS}
    assert all(not _queued_jobs(client, prefix, m) for m in MODELS)


@pytest.mark.parametrize("kind", ["dataframe", "table", "parquet", "csv", "cli-parquet", "cli-csv"])
def test_model_column_names_each_rows_model_for_every_tabular_source(kind: str, tmp_path: Path, redis_url: str,
                                                                     env: dict[str, str], prefix: str,
                                                                     client: redis.Redis) -> None:
    """Issue 45: ``model_column=`` worked only for dicts and JSONL; a DataFrame, an Arrow table, a .parquet
    and a .csv file were refused with "no model given", and the CLI had no ``--model-column``."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    import lmdq

    df = pd.DataFrame({"question": ["a?", "b?", "c?"], "model": ["ma", "mb", "ma"]})
    if kind.endswith("parquet"):
        source: object = tmp_path / "q.parquet"
        pq.write_table(pa.Table.from_pandas(df, preserve_index=False), source)
    elif kind.endswith("csv"):
        source = tmp_path / "q.csv"
        df.to_csv(source, index=False)
    else:
        source = df if kind == "dataframe" else pa.Table.from_pandas(df, preserve_index=False)
    if kind.startswith("cli-"):
        p = run_cli("lmdq.producer", "submit", str(source), "--prompt-column", "question", "--model-column", "model",
                    "--allow-unknown-model", env=env)
        assert p.returncode == 0, p.stderr.decode()[-2000:]
        batch_id = p.stdout.decode().strip().splitlines()[-1]
    else:
        c = lmdq.Client(redis_url)
        c.settings.key_prefix = prefix
        batch_id = c.submit(source, prompt_column="question", model_column="model", allow_unknown_model=True).id
    info = ResultStore(client, keys=Keys(prefix)).batches.get(batch_id)
    assert info.request_counts.total == 3
    assert sorted(info.models) == ["ma", "mb"], info
