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

from lmdq.connection import connect
from lmdq.contract import FinishReason, Result, ResultStatus, Timings
from lmdq.keys import Keys
from lmdq.store import ResultStore

ROOT = Path(__file__).resolve().parents[1]


def _gen_file(path: Path, lines: int) -> int:
    with path.open("w") as f:
        for i in range(lines):
            f.write(json.dumps({"custom_id": f"req-{i:08d}", "messages": [
                {"role": "user", "content": f"Summarise item {i} of the nightly evaluation set in one sentence."}],
                "params": {"max_new_tokens": 128}}) + "\n")
    return path.stat().st_size


def _run(args: list[str], env: dict[str, str]) -> tuple[float, int, bytes]:
    """(seconds, peak RSS bytes of THIS child, stdout) of one CLI subprocess, via wait4."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "lmdq.producer", *args], env=env, cwd=ROOT, stdout=out, stderr=err)
        _, status, usage = os.wait4(p.pid, 0)
        secs = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if p.returncode != 0:
            raise RuntimeError(f"producer {args[0]} failed: {err.read().decode()[-2000:]}")
        return secs, int(usage.ru_maxrss) * 1024, out.read()


def run_producer_bench(*, lines: int, batch_size: int, redis_url: str, log: Callable[[str], None]) -> dict[str, Any]:
    client = connect(redis_url)  # timeouts like every lmdq client
    prefix = f"pbench{lines}"
    env = {**os.environ, "LMDQ_REDIS_URL": redis_url, "LMDQ_KEY_PREFIX": prefix, "LMDQ_LOG_FORMAT": "json"}
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "prompts.jsonl"
        size = _gen_file(f, lines)
        log(f"generated {lines:,} lines ({size / 1e6:.1f} MB)")
        mem0 = int(client.info("memory")["used_memory"])
        secs, rss, out = _run(["submit", str(f), "--model", "bench", "--allow-unknown-model", "--json",
                               "--batch-size", str(batch_size)], env)
        batch = json.loads(out)
        mem_jobs = int(client.info("memory")["used_memory"]) - mem0
        log(f"submit: {secs:.2f} s = {lines / secs:,.0f} req/s, peak RSS {rss / 2**20:.0f} MiB")
        store = ResultStore(client, keys=Keys(prefix))
        now = time.time()
        mem1 = int(client.info("memory")["used_memory"])
        text = "The item describes a routine evaluation example and its expected answer in one sentence."
        store.write_results(
            Result(batch_id=batch["id"], custom_id=f"req-{i:08d}", index=i, status=ResultStatus.completed, text=text,
                   finish_reason=FinishReason.stop, input_token_len=31, generate_token_len=17, model="bench",
                   backend="sim", worker="bench-worker", attempt=1,
                   timings=Timings(enqueued_at=now, started_at=now, first_token_at=now, finished_at=now))
            for i in range(lines))
        mem_results = int(client.info("memory")["used_memory"]) - mem1
        out_file = Path(d) / "results.jsonl"
        esecs, ersss, _ = _run(["results", batch["id"], "-o", str(out_file)], env)
        exported = sum(1 for _ in out_file.open("rb"))
        log(f"results: {esecs:.2f} s = {exported / esecs:,.0f} results/s")
        esecs_oa, _, _ = _run(["results", batch["id"], "--format", "openai", "-o", str(out_file)], env)
    client.delete(*client.keys(f"{prefix}:*") or ["-"])
    return {
        "lines": lines, "batch_size": batch_size, "file_mb": round(size / 1e6, 1),
        "submit_s": round(secs, 2), "submit_req_s": round(lines / secs), "submit_peak_rss_mib": round(rss / 2**20),
        "results_s": round(esecs, 2), "results_per_s": round(exported / esecs),
        "results_openai_per_s": round(exported / esecs_oa), "results_peak_rss_mib": round(ersss / 2**20),
        "redis_bytes_per_queued_request": round(mem_jobs / lines), "redis_bytes_per_result": round(mem_results / lines),
    }
