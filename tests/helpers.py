"""Shared helpers for tests: write prompt files, run CLIs, wait for batches."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import redis

from lmdq.contract import Batch, Result
from lmdq.redis.keys import Keys
from lmdq.results.store import ResultStore


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def wait_batch(client: redis.Redis, prefix: str, batch_id: str, timeout: float = 60) -> Batch:
    store = ResultStore(client, keys=Keys(prefix))
    deadline = time.monotonic() + timeout
    while True:
        b = store.batches.get(batch_id)
        if b.status.terminal:
            return b
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id} still {b.status} {b.request_counts}")
        time.sleep(0.05)


def results_of(client: redis.Redis, prefix: str, batch_id: str) -> list[Result]:
    store = ResultStore(client, keys=Keys(prefix))
    b = store.batches.get(batch_id)
    return [Result.model_validate_json(raw) for _, raw in store.iter_results(batch_id, b.request_counts.total) if raw]


# A small JSON schema the guided-decoding tests constrain output to (CPU engines and the GPU suite).
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def commit_staged(client: Any, keys: Any, batch_id: str, model: str, n_jobs: int, n_requests: int) -> int:
    """Make jobs staged with ``JobQueue.stage`` visible through the ledger's commit (the production one,
    one Lua call); the batch record must exist (``BatchRecords.create``). Returns the jobs queued."""
    from lmdq.batches.ledger import BatchLedger, Staged
    from lmdq.contract import Batch, BatchStatus, Priority, RequestCounts

    batch = Batch(id=batch_id, model=model, status=BatchStatus.validating, priority=Priority.normal,
                  batch_size=max(1, n_requests // max(1, n_jobs)), num_jobs=n_jobs,
                  request_counts=RequestCounts(total=n_requests), created_at=0.0)
    return BatchLedger(client, keys=keys, ttl_s=3600).commit(batch, Staged(jobs=n_jobs, requests=n_requests))


def stage_jobs(client: Any, jq: Any, batch_id: str, queue: str, n_jobs: int) -> None:
    """Stage ``n_jobs`` one-request jobs of ``batch_id`` with ``JobQueue.stage`` (invisible until a commit)."""
    with client.pipeline() as p:
        for j in range(n_jobs):
            jq.stage({"format_version": 1, "batch_id": batch_id, "model": "sim", "job_no": j, "params": {},
                      "requests": [{"index": j, "custom_id": str(j), "prompt": "hi"}]}, queue=queue, job_no=j, pipe=p)
        p.execute()
