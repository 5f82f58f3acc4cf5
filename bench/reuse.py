"""``lmdq-bench reuse``: a batch run twice with ``--reuse``; the second is answered from the reuse index.

The same file of N greedy requests goes through the real paths twice (``submit_file`` with a reuse TTL and
a results sink in a local folder, then an in-process worker on the sim engine, in burst mode) against a
private redis-server. Reported per run: the submit time and the RUN time (from the worker's start to the
batch's completion: what reuse saves), the engine's decode steps (0 on the second run: nothing reached
it) and whether every answer came back identical with ``reused_from`` set; and the reuse index's exact
Redis bytes (``MEMORY USAGE`` of every bucket, source table and counter key) per entry.

What the first run costs is the sim's pacing (``--step-ms`` per decode step, ``--max-new-tokens`` steps a
request, ``--max-batch`` requests a step): a real engine's cost per request is the same kind of number,
usually larger (a 7B model decodes ~20-30 ms a step). The second run's cost is lmdq's own per request: one
index lookup, one shard line read and one exactly-once result write.
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
from lmdq.results.reader import ResultReader
from lmdq.results.store import ResultStore
from lmdq.reuse.index import ReuseIndex
from lmdq.reuse.store import ReuseStore
from lmdq.submission.submit import SubmitOptions, submit_file

__all__ = ["run_reuse_bench"]

MODEL = "sim-bench"


def _worker(client: redis.Redis, url: str, prefix: str, allowed: str, sim: dict[str, Any]) -> int:
    """Drain the queue with one burst worker; returns its engine's decode steps."""
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    s = WorkerSettings(redis_url=url, key_prefix=prefix, burst=True, health_port=0, allowed_output_urls=allowed,
                       log_level="WARNING", partial_interval_s=3600)
    engine = SimEngine(model_name=MODEL, **sim)
    Worker(engine=engine, client=client, settings=s).run()
    return engine.steps


def _answers(store: ResultStore, batch_id: str) -> list[tuple[str, int, int, str | None, str | None]]:
    """(text, input tokens, generated tokens, reused_from batch, custom_id) of every request, in input order."""
    out = []
    for _, raw in ResultReader.of(store, store.batches.get(batch_id)).records(partial=False):
        r = Result.model_validate_json(raw or b"")
        out.append((r.text, r.input_token_len, r.generate_token_len,
                    r.reused_from.batch if r.reused_from else None, r.custom_id))
    return out


def fill_index(client: redis.Redis, keys: Keys, n: int, *, chunk: int = 1000) -> dict[str, Any]:
    """``n`` pointer entries written through :meth:`ReuseIndex.record` (the worker's own call, as a sealed
    job of ``chunk`` requests records them) for a model of their own; its exact Redis bytes per entry.

    Why a fill beside the end-to-end runs: an entry's share of its bucket key depends on how many entries
    the index holds (65,536 buckets a model), so bytes per entry is a figure AT a size; this measures it at
    ``n`` without running ``n`` requests through the engine twice."""
    from lmdq.contract import ResultStatus
    from lmdq.reuse.identity import identity
    from lmdq.reuse.index import Completed

    idx = ReuseIndex(ReuseStore(client, keys=keys))
    model = MODEL + "-fill"
    wkey = b"\x01" * 16
    t0 = time.perf_counter()
    for job in range((n + chunk - 1) // chunk):
        done = []
        for i in range(job * chunk, min(n, (job + 1) * chunk)):
            r = Result.model_construct(batch_id=f"batch_{job // 1000:024x}", custom_id=f"r{i}", index=i,
                                       status=ResultStatus.completed, reused_from=None)
            done.append(Completed(identity(wkey, str(i).encode()), r, job % 1000))
        idx.record(model, batch_id=f"batch_{job // 1000:024x}", results_url="file:///sink", ttl_s=86400,
                   done=done, sealed=True)
    st = idx.stats(model)[0]
    return {"entries": st.entries, "bytes": st.bytes, "bytes_per_entry": round(st.bytes / max(st.entries, 1), 1),
            "fill_s": round(time.perf_counter() - t0, 1)}


def run_reuse_bench(*, n: int, batch_size: int, tokens: int, sim: dict[str, Any], redis_url: str,
                    log: Callable[[str], None], index_n: int = 0) -> dict[str, Any]:
    client = redis.Redis.from_url(redis_url)
    work = Path(tempfile.mkdtemp(prefix="lmdq-reuse-bench-"))
    prefix = f"r{int(time.time() * 1000) % 10**8}"
    keys = Keys(prefix)
    store = ResultStore(client, keys=keys)
    try:
        f = work / "prompts.jsonl"
        with open(f, "w") as out:
            for i in range(n):
                out.write(json.dumps({"custom_id": f"r{i}", "prompt": f"question {i}: what is {i % 1000} about"})
                          + "\n")
        sink = work / "sink"
        opts = SubmitOptions(model=MODEL, allow_unknown_model=True, batch_size=batch_size,
                             params=GenerationParams(max_new_tokens=tokens), results_url=str(sink),
                             reuse_ttl_s=30 * 86400)
        runs: list[dict[str, Any]] = []
        ids: list[str] = []
        for label in ("first", "second"):
            t0 = time.perf_counter()
            batch, _ = submit_file(f, opts, client=client, keys=keys, ttl_s=3600)
            t1 = time.perf_counter()
            log(f"{label} run: submitted {n:,} in {t1 - t0:.1f}s; running the worker")
            steps = _worker(client, redis_url, prefix, str(sink), sim)
            t2 = time.perf_counter()
            b = store.batches.get(batch.id)
            if b.status is not BatchStatus.completed or b.request_counts.completed != n:
                raise RuntimeError(f"batch ended {b.status.value} with {b.request_counts}")
            log(f"{label} run: {n:,} answered in {t2 - t1:.1f}s ({steps:,} engine steps)")
            ids.append(batch.id)
            runs.append({"submit_s": round(t1 - t0, 2), "run_s": round(t2 - t1, 2), "engine_steps": steps,
                         "req_per_s": round(n / (t2 - t1))})
        first, second = _answers(store, ids[0]), _answers(store, ids[1])
        identical = len(first) == len(second) == n and all(
            a[:3] == b[:3] and a[4] == b[4] for a, b in zip(first, second, strict=True))
        reused = sum(b[3] == ids[0] for b in second)
        st = ReuseIndex(ReuseStore(client, keys=keys)).stats(MODEL)[0]
        filled = fill_index(client, keys, index_n) if index_n else None
        if filled:
            log(f"index filled with {index_n:,} entries: {filled['bytes_per_entry']} B/entry")
        return {
            "index_fill": filled,
            "n": n, "batch_size": batch_size, "max_new_tokens": tokens, "sim": sim, "sink": "folder",
            "first": runs[0], "second": runs[1],
            "speedup_run": round(runs[0]["run_s"] / runs[1]["run_s"], 1),
            "speedup_submit_and_run": round((runs[0]["submit_s"] + runs[0]["run_s"])
                                            / (runs[1]["submit_s"] + runs[1]["run_s"]), 1),
            "identical_answers": identical, "reused_from_set": reused,
            "index_entries": st.entries, "index_bytes": st.bytes,
            "index_bytes_per_entry": round(st.bytes / max(st.entries, 1), 1),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
