"""``lmdq-bench sink``: Redis bytes per completed request with and without a results sink.

One batch of N requests goes through the real paths (``submit_file``, an in-process worker on the sim
engine, the ``results`` export) against a private redis-server, once with a results sink (a local
folder) and once without. For each it reports the ``used_memory`` delta from before the submit to after
completion, the MEMORY USAGE of the batch's keys, both per request, and the export rate; with a sink,
that the export returned every request in input order.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from lmdq.contract import BatchStatus, GenerationParams, Result
from lmdq.redis.keys import Keys
from lmdq.redis.server import info
from lmdq.results.export import iter_lmdq_lines
from lmdq.results.store import ResultStore
from lmdq.submission.submit import SubmitOptions, submit_file
from lmdq_bench.keyspace import keys_memory, scan

__all__ = ["run_sink_bench"]

MODEL = "sim-bench"


def _worker(client: redis.Redis, url: str, prefix: str, allowed: str) -> None:
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    s = WorkerSettings(redis_url=url, key_prefix=prefix, burst=True, health_port=0, allowed_output_urls=allowed,
                       log_level="WARNING")
    Worker(engine=SimEngine(model_name=MODEL, step_ms=0), client=client, settings=s).run()


def _one(client: redis.Redis, url: str, n: int, batch_size: int, tokens: int, sink: Path | None, work: Path,
         log: Callable[[str], None]) -> dict[str, Any]:
    prefix = f"b{int(time.time() * 1000) % 10**8}"
    f = work / "prompts.jsonl"
    if not f.exists():
        f.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": f"question {i} about the sink"}) + "\n"
                             for i in range(n)))
    _worker(client, url, prefix, str(work))  # registration and scripts: not the batch's bytes
    before = int(info(client, "memory")["used_memory"])
    t0 = time.perf_counter()
    opts = SubmitOptions(model=MODEL, allow_unknown_model=True, batch_size=batch_size,
                         params=GenerationParams(max_new_tokens=tokens), results_url=str(sink) if sink else None)
    batch, _ = submit_file(f, opts, client=client, keys=Keys(prefix), ttl_s=3600)
    t1 = time.perf_counter()
    staged = int(info(client, "memory")["used_memory"]) - before
    log(f"{'sink' if sink else 'no sink'}: submitted {n:,} in {t1 - t0:.1f}s; running the worker")
    _worker(client, url, prefix, str(work))
    t2 = time.perf_counter()
    store = ResultStore(client, keys=Keys(prefix))
    b = store.batches.get(batch.id)
    if b.status is not BatchStatus.completed or b.request_counts.completed != n:
        raise RuntimeError(f"batch ended {b.status.value} with {b.request_counts}")
    after = int(info(client, "memory")["used_memory"])
    keys = [*scan(client, f"{prefix}:batch:{batch.id}*"), *scan(client, f"rq:job:{batch.id}-*")]
    usage = keys_memory(client, keys)
    t3 = time.perf_counter()
    order_ok = True
    count = 0
    for i, line in enumerate(iter_lmdq_lines(store, b)):
        if i % 997 == 0 or i == n - 1:
            order_ok &= Result.model_validate_json(line).index == i
        count += 1
    t4 = time.perf_counter()
    return {"sink": bool(sink), "n": n, "used_memory_delta_b_per_request": round((after - before) / n, 1),
            "memory_usage_b_per_request": round(usage / n, 1), "staged_b_per_request": round(staged / n, 1),
            "keys": len(keys), "submit_s": round(t1 - t0, 2), "run_s": round(t2 - t1, 2),
            "export_req_s": round(count / (t4 - t3)), "exported": count, "in_order": order_ok and count == n}


def run_sink_bench(*, n: int, batch_size: int, tokens: int, redis_url: str,
                   log: Callable[[str], None]) -> dict[str, Any]:
    """Both runs against ``redis_url`` (a private server: used_memory is server-wide)."""
    client = redis.Redis.from_url(redis_url)
    work = Path(tempfile.mkdtemp(prefix="lmdq-sink-bench-"))
    try:
        with_sink = _one(client, redis_url, n, batch_size, tokens, work / "sink", work, log)
        without = _one(client, redis_url, n, batch_size, tokens, None, work, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"n": n, "batch_size": batch_size, "max_new_tokens": tokens, "with_sink": with_sink, "without": without}
