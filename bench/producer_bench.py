"""Producer and collector throughput: submit a generated JSONL, export its results.

Both sides run as real CLI subprocesses (``python -m lmdq.producer``), timed from outside, with their
peak RSS read from ``wait4``. Results are written straight into the store (as workers would,
pipelined) so the export measures reading, not generation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmdq.contract import FinishReason, Result, ResultStatus, Timings
from lmdq.redis.connection import connect
from lmdq.redis.keys import Keys
from lmdq.redis.server import info
from lmdq.results.store import ResultStore
from lmdq_bench.keyspace import delete, scan

#: where child processes start: never inside the installed package, whose lmdq/redis/ would hide the
#: redis library from `python -m` (sys.path[0] is the working directory)
CHILD_CWD = tempfile.gettempdir()


def _gen_file(path: Path, lines: int) -> int:
    with path.open("w") as f:
        for i in range(lines):
            f.write(json.dumps({"custom_id": f"req-{i:08d}", "messages": [
                {"role": "user", "content": f"Summarise item {i} of the nightly evaluation set in one sentence."}],
                "params": {"max_new_tokens": 128}}) + "\n")
    return path.stat().st_size


def _run(args: list[str], env: dict[str, str]) -> tuple[float, int, bytes]:
    """(seconds, peak RSS bytes of THIS child, stdout) of one CLI subprocess, via wait4."""
    secs, rss, out, _cpu = _run_cpu(args, env)
    return secs, rss, out


def _run_cpu(args: list[str], env: dict[str, str]) -> tuple[float, int, bytes, float]:
    """:func:`_run` plus the child's CPU seconds (user + system): on a shared machine the wall time
    of two runs depends on what else ran meanwhile, their CPU time much less."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "lmdq.producer", *args], env=env, cwd=CHILD_CWD,
                             stdout=out, stderr=err)
        _, status, usage = os.wait4(p.pid, 0)
        secs = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if p.returncode != 0:
            raise RuntimeError(f"producer {args[0]} failed: {err.read().decode()[-2000:]}")
        return secs, int(usage.ru_maxrss) * 1024, out.read(), usage.ru_utime + usage.ru_stime


_QUESTION = "Question {i}: in one sentence, what does item {i} of the nightly evaluation set test?"


def _gen_tabular(parquet: Path | str, jsonl: Path | str, rows: int, chunk: int = 100_000) -> None:
    """The same ``rows`` as a 3-column Parquet file (qid, question, max_new_tokens) and as lmdq JSONL."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("qid", pa.string()), ("question", pa.string()), ("max_new_tokens", pa.int64())])
    with pq.ParquetWriter(parquet, schema) as w, open(jsonl, "w") as j:
        for s in range(0, rows, chunk):
            ids = [f"q-{i:08d}" for i in range(s, min(rows, s + chunk))]
            qs = [_QUESTION.format(i=i) for i in range(s, min(rows, s + chunk))]
            mx = [64 + i % 64 for i in range(s, min(rows, s + chunk))]
            w.write_table(pa.table([ids, qs, mx], schema=schema))
            j.writelines(json.dumps({"custom_id": c, "prompt": q, "params": {"max_new_tokens": m}}) + "\n"
                         for c, q, m in zip(ids, qs, mx))


def floors(path: str, kind: str) -> None:
    """Print (JSON) the floors of a submit of ``path``, in rows per CPU-second of this process: ``json``, a loop
    that only reads each row into Python (JSONL: the stdlib's ``json.loads`` of each line; Parquet: the row
    dicts of each record batch), and ``pydantic``, one that also builds each row's request model
    (:class:`lmdq.contract.Request`, params included). Issue 49's yardstick: lmdq's submit within 0.4 of the
    pydantic floor. Run in a child (:func:`_in_child`), so the bench process never imports pyarrow."""
    import time as _time

    from lmdq.contract import Request

    def rows() -> Any:
        if kind == "jsonl":
            with open(path, "rb") as f:
                for line in f:
                    yield json.loads(line)
        else:
            import pyarrow.parquet as pq

            for rb in pq.ParquetFile(path).iter_batches(batch_size=4096):
                for r in rb.to_pylist():
                    yield {"custom_id": r["qid"], "prompt": r["question"],
                           "params": {"max_new_tokens": r["max_new_tokens"]}}

    out: dict[str, float] = {}
    for name in ("json", "pydantic"):
        t0 = _time.process_time()
        n = 0
        if name == "json":
            for _ in rows():
                n += 1
        else:
            for i, obj in enumerate(rows()):
                Request(index=i, **obj)
                n += 1
        out[name] = n / (_time.process_time() - t0)
    print(json.dumps(out))


def _floors(path: Path | str, kind: str) -> dict[str, float]:
    code = "import sys; from lmdq_bench.producer_bench import floors; floors(sys.argv[1], sys.argv[2])"
    p = subprocess.run([sys.executable, "-c", code, str(path), kind], check=True, cwd=CHILD_CWD, capture_output=True,
                       text=True)
    got: dict[str, float] = json.loads(p.stdout.strip().splitlines()[-1])
    return got


def _in_child(fn: str, *args: Any) -> None:
    """Run one of this module's functions in a child process: the bench process stays small, so the
    CLI children it forks start small (a forked child's peak RSS counts the parent's pages it had
    before exec), and pyarrow is never imported here."""
    code = f"from lmdq_bench.producer_bench import {fn}; from pathlib import Path; {fn}(*{args!r})"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=CHILD_CWD)


def _check_parquet_results(path: Path | str, rows: int) -> None:
    """Every result there, in input order, each under its own id (read a row group at a time)."""
    import pyarrow.parquet as pq

    n = 0
    for rb in pq.ParquetFile(path).iter_batches(columns=["custom_id", "row"], batch_size=100_000):
        ids, idx = rb.column(0).to_pylist(), rb.column(1).to_pylist()
        if idx != list(range(n, n + len(idx))) or ids != [f"q-{i:08d}" for i in idx]:
            raise RuntimeError(f"{path}: results out of order or under the wrong ids near row {n}")
        n += len(idx)
    if n != rows:
        raise RuntimeError(f"{path}: {n} results, expected {rows}")


def run_tabular_bench(*, rows: int, batch_size: int, redis_url: str, log: Callable[[str], None],
                      rounds: int = 2) -> dict[str, Any]:
    """A ``rows``-row 3-column Parquet file vs the same rows as JSONL through ``lmdq-producer submit``
    (rows/s and peak RSS side by side; ``rounds`` alternated runs each, the best rate of each side),
    then ``results -o out.parquet`` of as many results."""
    client = connect(redis_url)
    prefix = f"ptab{rows}"
    env = {**os.environ, "LMDQ_REDIS_URL": redis_url, "LMDQ_KEY_PREFIX": prefix, "LMDQ_LOG_FORMAT": "json"}
    common = ["--model", "bench", "--allow-unknown-model", "--json", "--batch-size", str(batch_size)]
    with tempfile.TemporaryDirectory() as d:
        parquet, jsonl = Path(d) / "rows.parquet", Path(d) / "rows.jsonl"
        _in_child("_gen_tabular", str(parquet), str(jsonl), rows)
        log(f"generated {rows:,} rows: Parquet {parquet.stat().st_size / 1e6:.1f} MB, "
            f"JSONL {jsonl.stat().st_size / 1e6:.1f} MB")
        parquet_args = ["submit", str(parquet), "--prompt-column", "question", "--id-column", "qid",
                        "--params-column", "max_new_tokens", *common]
        runs: dict[str, list[tuple[float, int, bytes, float]]] = {"jsonl": [], "parquet": []}
        for r in range(rounds):  # alternated, so a load spike on the shared machine hits both sides
            for kind, args in (("jsonl", ["submit", str(jsonl), *common]), ("parquet", parquet_args)):
                runs[kind].append(_run_cpu(args, env))
                w, rss_b, _, cpu = runs[kind][-1]
                log(f"round {r + 1} submit {kind:<7}: {rows / w:,.0f} rows/s wall, {rows / cpu:,.0f} rows per "
                    f"CPU-s, peak RSS {rss_b / 2**20:.0f} MiB")
                if kind == "jsonl" or r < rounds - 1:
                    delete(client, list(scan(client, f"{prefix}:*")))
        batch = json.loads(runs["parquet"][-1][2])
        j_s, p_s = min(x[0] for x in runs["jsonl"]), min(x[0] for x in runs["parquet"])
        j_cpu, p_cpu = min(x[3] for x in runs["jsonl"]), min(x[3] for x in runs["parquet"])
        j_rss, p_rss = max(x[1] for x in runs["jsonl"]), max(x[1] for x in runs["parquet"])
        fl = {"jsonl": _floors(jsonl, "jsonl"), "parquet": _floors(parquet, "parquet")}
        for kind, cpu in (("jsonl", j_cpu), ("parquet", p_cpu)):
            log(f"floors {kind:<7}: lmdq {rows / cpu:,.0f} rows/CPU-s | json floor {fl[kind]['json']:,.0f} | "
                f"pydantic floor {fl[kind]['pydantic']:,.0f} | lmdq/pydantic {rows / cpu / fl[kind]['pydantic']:.2f}")
        log(f"submit JSONL   : {rows / j_s:,.0f} rows/s, {rows / j_cpu:,.0f} rows/CPU-s, peak RSS "
            f"{j_rss / 2**20:.0f} MiB")
        log(f"submit Parquet : {rows / p_s:,.0f} rows/s, {rows / p_cpu:,.0f} rows/CPU-s, peak RSS "
            f"{p_rss / 2**20:.0f} MiB ({j_s / p_s:.2f}x JSONL's rate, {j_cpu / p_cpu:.2f}x per CPU-s)")
        store = ResultStore(client, keys=Keys(prefix))
        now = time.time()
        text = "The item tests a routine evaluation example and its expected answer in one sentence."
        store.write_results(
            Result(batch_id=batch["id"], custom_id=f"q-{i:08d}", index=i, status=ResultStatus.completed, text=text,
                   finish_reason=FinishReason.stop, input_token_len=31, generate_token_len=17, model="bench",
                   backend="sim", worker="bench-worker", attempt=1,
                   timings=Timings(enqueued_at=now, started_at=now, first_token_at=now, finished_at=now))
            for i in range(rows))
        out_file = Path(d) / "out.parquet"
        e_s, e_rss, _ = _run(["results", batch["id"], "-o", str(out_file)], env)
        _in_child("_check_parquet_results", str(out_file), rows)
        log(f"results -o .parquet: {rows / e_s:,.0f} results/s, peak RSS {e_rss / 2**20:.0f} MiB, "
            f"{out_file.stat().st_size / 1e6:.1f} MB; order and ids checked")
    delete(client, list(scan(client, f"{prefix}:*")))
    return {
        "rows": rows, "batch_size": batch_size,
        "submit_jsonl_rows_s": round(rows / j_s), "submit_parquet_rows_s": round(rows / p_s),
        "parquet_rate_vs_jsonl": round(j_s / p_s, 3), "rounds": rounds,
        "submit_jsonl_rows_per_cpu_s": round(rows / j_cpu), "submit_parquet_rows_per_cpu_s": round(rows / p_cpu),
        "parquet_cpu_rate_vs_jsonl": round(j_cpu / p_cpu, 3),
        "floors_rows_per_cpu_s": {k: {f: round(v) for f, v in d.items()} for k, d in fl.items()},
        "jsonl_vs_pydantic_floor": round(rows / j_cpu / fl["jsonl"]["pydantic"], 3),
        "parquet_vs_pydantic_floor": round(rows / p_cpu / fl["parquet"]["pydantic"], 3),
        "submit_jsonl_peak_rss_mib": round(j_rss / 2**20), "submit_parquet_peak_rss_mib": round(p_rss / 2**20),
        "results_parquet_per_s": round(rows / e_s), "results_parquet_peak_rss_mib": round(e_rss / 2**20),
        "results_parquet_order_and_ids_checked": True,
    }


def run_producer_bench(*, lines: int, batch_size: int, redis_url: str, log: Callable[[str], None]) -> dict[str, Any]:
    client = connect(redis_url)  # timeouts like every lmdq client
    prefix = f"pbench{lines}"
    env = {**os.environ, "LMDQ_REDIS_URL": redis_url, "LMDQ_KEY_PREFIX": prefix, "LMDQ_LOG_FORMAT": "json"}
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "prompts.jsonl"
        size = _gen_file(f, lines)
        log(f"generated {lines:,} lines ({size / 1e6:.1f} MB)")
        mem0 = int(info(client, "memory")["used_memory"])
        secs, rss, out, cpu = _run_cpu(["submit", str(f), "--model", "bench", "--allow-unknown-model", "--json",
                                        "--batch-size", str(batch_size)], env)
        batch = json.loads(out)
        mem_jobs = int(info(client, "memory")["used_memory"]) - mem0
        fl = _floors(f, "jsonl")
        log(f"submit: {secs:.2f} s = {lines / secs:,.0f} req/s, peak RSS {rss / 2**20:.0f} MiB")
        log(f"submit rows per CPU-s: lmdq {lines / cpu:,.0f} | json floor {fl['json']:,.0f} | pydantic floor "
            f"{fl['pydantic']:,.0f} | lmdq/pydantic {lines / cpu / fl['pydantic']:.2f} (the submit CLI's CPU, "
            "start-up included)")
        store = ResultStore(client, keys=Keys(prefix))
        now = time.time()
        mem1 = int(info(client, "memory")["used_memory"])
        text = "The item describes a routine evaluation example and its expected answer in one sentence."
        store.write_results(
            Result(batch_id=batch["id"], custom_id=f"req-{i:08d}", index=i, status=ResultStatus.completed, text=text,
                   finish_reason=FinishReason.stop, input_token_len=31, generate_token_len=17, model="bench",
                   backend="sim", worker="bench-worker", attempt=1,
                   timings=Timings(enqueued_at=now, started_at=now, first_token_at=now, finished_at=now))
            for i in range(lines))
        mem_results = int(info(client, "memory")["used_memory"]) - mem1
        out_file = Path(d) / "results.jsonl"
        esecs, ersss, _ = _run(["results", batch["id"], "-o", str(out_file)], env)
        exported = sum(1 for _ in out_file.open("rb"))
        log(f"results: {esecs:.2f} s = {exported / esecs:,.0f} results/s")
        esecs_oa, _, _ = _run(["results", batch["id"], "--format", "openai", "-o", str(out_file)], env)
    delete(client, list(scan(client, f"{prefix}:*")))
    return {
        "lines": lines, "batch_size": batch_size, "file_mb": round(size / 1e6, 1),
        "submit_s": round(secs, 2), "submit_req_s": round(lines / secs), "submit_peak_rss_mib": round(rss / 2**20),
        "submit_rows_per_cpu_s": round(lines / cpu), "json_floor_rows_per_cpu_s": round(fl["json"]),
        "pydantic_floor_rows_per_cpu_s": round(fl["pydantic"]),
        "vs_pydantic_floor": round(lines / cpu / fl["pydantic"], 3),
        "results_s": round(esecs, 2), "results_per_s": round(exported / esecs),
        "results_openai_per_s": round(exported / esecs_oa), "results_peak_rss_mib": round(ersss / 2**20),
        "redis_bytes_per_queued_request": round(mem_jobs / lines), "redis_bytes_per_result": round(mem_results / lines),
    }
