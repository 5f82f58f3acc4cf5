"""``lmdq-bench export``: peak RSS of ``lmdq-producer results -o out.parquet`` (and ``-o out.jsonl``) for a
batch of N results of ~``--record-bytes`` each.

Issue 49 measured the Parquet export growing with the batch (sim results of ~3.7 KB: 20,000 -> 331 MB peak
RSS, 100,000 -> 450 MB) while JSONL stayed at 80 MB; the goal is 1,000,000 x 4 KB under 300 MB. Holding
1,000,000 x 4 KB (4 GB) in one shared test box's Redis is not an option, so the results are laid down the
way a batch with a results URL keeps them once its jobs are sealed (:mod:`lmdq.results.shards`): one JSONL
shard per job in a local folder and one index entry per job in Redis (each job written to Redis as a
worker writes it, then sealed as a worker's sink seals it). ``--in-redis`` puts them in the
batch's results hash instead (the path issue 49 measured; keep N small). The export itself is the real CLI
in a child process, its peak RSS read from ``wait4``; the file is then checked row by row (count, order,
ids) in another child, so this process never imports pyarrow.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmdq.contract import Batch, BatchStatus, FinishReason, RequestCounts, Result, ResultStatus, Timings
from lmdq.redis.connection import connect
from lmdq.redis.keys import Keys
from lmdq.results.sink import flush_shard
from lmdq.results.store import ResultStore
from lmdq_bench.keyspace import delete, scan

__all__ = ["run_export_bench"]

#: where child processes start: never inside the installed package (see producer_bench.CHILD_CWD)
CHILD_CWD = tempfile.gettempdir()

_WORDS = ["the", "model", "answers", "each", "question", "with", "a", "short", "paragraph", "that", "names",
          "evaluation", "item", "its", "expected", "output", "and", "reasons", "reviewer", "would", "accept", "or",
          "reject", "it", "in", "nightly", "run"]


def _pool(seed: int = 49) -> str:
    """1 MB of varied words: each result's text is a different slice of it (see :func:`_text`)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(160_000))[: 1 << 20]


def _text(pool: str, i: int, record_bytes: int) -> str:
    """About ``record_bytes`` minus the record's other fields, a different slice of ``pool`` for every
    result: nothing repeats row to row, so the export holds (and compresses) real text, as a batch's
    answers would be, not a dictionary of a few values."""
    want = max(16, record_bytes - 420)
    start = (i * 7919) % (len(pool) - want)
    return pool[start : start + want]


def _result(batch_id: str, i: int, text: str, now: float) -> Result:
    return Result(batch_id=batch_id, custom_id=f"r-{i:08d}", index=i, status=ResultStatus.completed, text=text,
                  finish_reason=FinishReason.stop, input_token_len=64, generate_token_len=900, model="bench",
                  backend="sim", worker="bench-worker", attempt=1,
                  timings=Timings(enqueued_at=now, started_at=now, first_token_at=now, finished_at=now))


def _lay_down(client: Any, keys: Keys, n: int, per_job: int, record_bytes: int, sink: Path | None) -> Batch:
    """A batch of ``n`` completed results written as workers write them (:meth:`ResultStore.write_results`);
    with a ``sink``, each job of ``per_job`` is then sealed into its shard as a worker's sink seals it
    (:func:`lmdq.results.sink.flush_shard`), so Redis holds one job's records at a time."""
    store = ResultStore(client, keys=keys)
    bid = f"batch_bench{time.time_ns():019x}"[:30]
    b = Batch(id=bid, model="bench", status=BatchStatus.in_progress, batch_size=per_job,
              request_counts=RequestCounts(total=n), created_at=time.time(),
              results_url=str(sink) if sink else None)
    store.batches.create(b)
    pool = _pool()
    now = time.time()
    for job, lo in enumerate(range(0, n, per_job)):
        hi = min(n, lo + per_job)
        store.write_results(_result(bid, i, _text(pool, i, record_bytes), now) for i in range(lo, hi))
        if sink is not None and flush_shard(client, keys, bid, job, str(sink), list(range(lo, hi))) is None:
            raise RuntimeError(f"job {job} of {bid} was not sealed")
    return b


def _run(args: list[str], env: dict[str, str]) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of one ``python -m lmdq.producer`` child, via wait4."""
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "lmdq.producer", *args], env=env, cwd=CHILD_CWD,
                             stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(p.pid, 0)
        secs = time.perf_counter() - t0
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            raise RuntimeError(f"producer {' '.join(args)} failed: {err.read().decode()[-2000:]}")
        return secs, int(usage.ru_maxrss) * 1024


def check_parquet(path: str, n: int) -> None:
    """Every result in the file, in input order, under its own id, a row group at a time (run in a child)."""
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    seen = 0
    for rb in f.iter_batches(columns=["custom_id", "row", "text"], batch_size=50_000):
        idx = rb.column(1).to_pylist()
        if idx != list(range(seen, seen + len(idx))) or rb.column(0).to_pylist() != [f"r-{i:08d}" for i in idx]:
            raise SystemExit(f"{path}: out of order or wrong ids near row {seen}")
        seen += len(idx)
    if seen != n:
        raise SystemExit(f"{path}: {seen} rows, expected {n}")
    print(f.metadata.num_row_groups)


def run_export_bench(*, n: int, record_bytes: int, per_job: int, in_redis: bool, jsonl: bool, redis_url: str,
                     log: Callable[[str], None]) -> dict[str, Any]:
    client = connect(redis_url)
    prefix = f"xbench{n}"
    keys = Keys(prefix)
    env = {**os.environ, "LMDQ_REDIS_URL": redis_url, "LMDQ_KEY_PREFIX": prefix, "LMDQ_LOG_FORMAT": "json"}
    work = Path(tempfile.mkdtemp(prefix="lmdq-export-bench-"))
    try:
        t0 = time.perf_counter()
        b = _lay_down(client, keys, n, per_job, record_bytes, None if in_redis else work / "sink")
        raw_bytes = len(_result(b.id, n - 1, _text(_pool(), n - 1, record_bytes), time.time()).model_dump_json(
            exclude_none=True)) * n
        log(f"laid down {n:,} results ({raw_bytes / n:,.0f} B each, {'Redis' if in_redis else 'shards'}) "
            f"in {time.perf_counter() - t0:.0f} s")
        out = work / "out.parquet"
        secs, rss = _run(["results", b.id, "-o", str(out)], env)
        groups = subprocess.run([sys.executable, "-c", "import sys; from lmdq_bench.export_memory import "
                                 "check_parquet as c; c(sys.argv[1], int(sys.argv[2]))", str(out), str(n)],
                                cwd=CHILD_CWD, check=True, capture_output=True, text=True).stdout.strip()
        log(f"results -o out.parquet: {secs:.1f} s, {n / secs:,.0f} results/s, peak RSS {rss / 2**20:.0f} MiB, "
            f"{out.stat().st_size / 1e6:.0f} MB, {groups} row groups; count, order and ids checked")
        res: dict[str, Any] = {
            "n": n, "record_bytes": round(raw_bytes / n), "where": "redis" if in_redis else "shards",
            "parquet_s": round(secs, 1), "parquet_results_per_s": round(n / secs),
            "parquet_peak_rss_mib": round(rss / 2**20), "parquet_mb": round(out.stat().st_size / 1e6),
            "parquet_row_groups": int(groups), "parquet_checked": True,
        }
        out.unlink()
        if jsonl:
            out = work / "out.jsonl"
            secs, rss = _run(["results", b.id, "-o", str(out)], env)
            log(f"results -o out.jsonl: {secs:.1f} s, peak RSS {rss / 2**20:.0f} MiB")
            res |= {"jsonl_s": round(secs, 1), "jsonl_peak_rss_mib": round(rss / 2**20)}
        return res
    finally:
        delete(client, list(scan(client, f"{prefix}:*")))
        shutil.rmtree(work, ignore_errors=True)
