"""The canary through the OpenAI-compatible HTTP API (issue 46): the ``gates`` extension field on create, a
paused batch shown as OpenAI's ``in_progress`` with ``lmdq_status: "paused"`` and its report in
``lmdq_gates``, the ``/resume`` extension route, and every custom_id answered once in the output file.
A real ``lmdq-api`` process, the official ``openai`` SDK, a burst sim worker (deterministic: it runs only
what is queued, and exits)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI
from openai.types import Batch

from lmdq_bench.api_bench import ApiProcess
from tests.conftest import start_worker
from tests.helpers import api_process, openai_batch_until

KEY = f"canary-key-{uuid.uuid4().hex}"
SIM = ("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "1", "--burst")
BAD = {"type": "json_schema", "json_schema": {"name": "item", "schema": {
    "type": "object", "properties": {"id": {"type": "string", "pattern": "^[0-9]+$"}}, "required": ["id"]}}}
N = 20


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"capi{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def api(redis_url: str, prefix: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiProcess]:
    with api_process(redis_url, prefix, tmp_path_factory.mktemp("api"), {"alice": KEY},
                     {"LMDQ_KNOWN_MODELS": '["sim"]', "LMDQ_BATCH_SIZE": "2"}) as srv:
        yield srv


def _until(c: OpenAI, batch_id: str, ok: Any, polls: int = 600) -> Batch:
    b: Batch = openai_batch_until(c, batch_id, ok, polls)
    return b


def test_paused_in_the_api_and_resumed(api: ApiProcess, env: dict[str, str], prefix: str, tmp_path: Path) -> None:
    c = OpenAI(base_url=api.url + "/v1", api_key=KEY)
    rows = [{"custom_id": f"r{i:02d}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "sim", "messages": [{"role": "user", "content": f"item {i}"}], "max_tokens": 8,
                      "response_format": BAD}} for i in range(N)]
    f = c.files.create(file=("in.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode()), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="gates"):
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         extra_body={"gates": {"canary": "300%"}})
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         extra_body={"gates": {"canary": "10%", "gate": ["json=0"]}})
    b = _until(c, b.id, lambda x: x.status == "in_progress")
    extra = b.model_extra or {}
    assert extra["lmdq_gates"]["verdict"] is None and extra["lmdq_gates"]["held_jobs"] == N // 2 - 1
    worker_env = {**env, "LMDQ_KEY_PREFIX": prefix}
    assert start_worker(*SIM, env=worker_env).wait(60) == 0
    b = _until(c, b.id, lambda x: (x.model_extra or {}).get("lmdq_status") == "paused")
    extra = b.model_extra or {}
    assert b.status == "in_progress"  # OpenAI's word; lmdq's own beside it
    assert b.request_counts is not None and b.request_counts.completed == 2
    report = extra["lmdq_gates"]["report"]
    assert report["phase"] == "canary" and [x["gate"] for x in report["failures"]] == ["json"]
    assert [b.id] == [x.id for x in c.batches.list() if (x.model_extra or {}).get("lmdq_status") == "paused"]

    b = c.post(f"/batches/{b.id}/resume", cast_to=Batch)
    assert "lmdq_status" not in (b.model_extra or {}) and b.status == "in_progress"
    with pytest.raises(openai.ConflictError, match="paused"):
        c.post(f"/batches/{b.id}/resume", cast_to=Batch)
    assert start_worker(*SIM, env=worker_env).wait(60) == 0
    b = _until(c, b.id, lambda x: x.status == "completed")
    assert b.output_file_id
    lines = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in lines) == [r["custom_id"] for r in rows]  # each exactly once
