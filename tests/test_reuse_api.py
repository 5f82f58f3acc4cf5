"""Result reuse through the OpenAI-compatible HTTP API (issue 47): the ``reuse`` / ``reuse_ttl_s`` extension
fields on ``batches.create`` (``extra_body``, as ``deadline``, ``gates`` and ``webhook`` are passed). A real
``lmdq-api`` process, the official ``openai`` SDK, a real sim worker whose step counter says whether the
second, identical batch reached the engine."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai import OpenAI
from openai.types import Batch

from lmdq_bench.api_bench import ApiProcess
from tests.helpers import api_process, openai_batch_until
from tests.test_reuse import SimWorker

KEY = f"reuse-key-{uuid.uuid4().hex}"
N = 12


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"rapi{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def api(redis_url: str, prefix: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiProcess]:
    with api_process(redis_url, prefix, tmp_path_factory.mktemp("api"), {"alice": KEY},
                     {"LMDQ_KNOWN_MODELS": '["sim"]', "LMDQ_BATCH_SIZE": "4"}) as srv:
        yield srv


def _until(c: OpenAI, batch_id: str, ok: Any, polls: int = 1200) -> Batch:
    b: Batch = openai_batch_until(c, batch_id, ok, polls)
    return b


def _run(c: OpenAI, redis_url: str, prefix: str, file_id: str, **extra: Any) -> tuple[list[dict[str, Any]], int]:
    """Create a batch of ``file_id`` with ``extra_body=extra``, drain it with a fresh sim worker; (lines, steps)."""
    b = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                         extra_body=extra or None)
    b = _until(c, b.id, lambda x: x.status == "in_progress")
    w = SimWorker(redis_url, prefix)
    try:
        b = _until(c, b.id, lambda x: x.status == "completed")
    finally:
        w.stop()
    assert b.output_file_id
    lines = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
    return sorted(lines, key=lambda x: x["custom_id"]), w.engine.steps


def test_a_second_identical_batch_is_answered_from_reuse(api: ApiProcess, redis_url: str, prefix: str) -> None:
    c = OpenAI(base_url=api.url + "/v1", api_key=KEY)
    rows = [{"custom_id": f"r{i:02d}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "sim", "messages": [{"role": "user", "content": f"item {i}"}], "max_tokens": 8,
                      "temperature": 0}} for i in range(N)]
    f = c.files.create(file=("in.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode()), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="reuse_ttl_s"):
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         extra_body={"reuse": True, "reuse_ttl_s": 5})
    first, steps1 = _run(c, redis_url, prefix, f.id, reuse=True, reuse_ttl_s=7200)
    assert steps1 > 0 and not any("reused_from" in x for x in first)
    shown = c.batches.list().data[0]
    assert (shown.model_extra or {}).get("reuse_ttl_s") == 7200
    plain, steps_plain = _run(c, redis_url, prefix, f.id)  # no reuse asked (LMDQ_REUSE off): computed again
    assert steps_plain > 0 and not any("reused_from" in x for x in plain)
    second, steps2 = _run(c, redis_url, prefix, f.id, reuse=True)
    assert steps2 == 0  # nothing reached the engine
    assert [x["custom_id"] for x in second] == [r["custom_id"] for r in rows]  # each exactly once
    for a, b in zip(first, second, strict=True):
        assert b["reused_from"]["custom_id"] == a["custom_id"]
        assert b["reused_from"]["batch"]  # lmdq's batch id of the first run
        assert b["response"]["body"]["choices"] == a["response"]["body"]["choices"]
        assert b["response"]["body"]["usage"] == a["response"]["body"]["usage"]
    assert len({x["reused_from"]["batch"] for x in second}) == 1
