"""OpenAI Batch parity of lmdq-api (issue 45), through the official ``openai`` SDK against a real ``lmdq-api``
on 127.0.0.1, a real redis-server and the sim engine worker: ``usage`` on the batch once its requests are
done, ``batch_req_`` / ``req_`` ids that never name an internal batch, ``model`` from creation, and a
request the worker had started when the cancel came worded as cancelled while running.

Deterministic: the cancel waits (bounded polls) until every request of the running job has written a
partial (so it is in the engine) while the second job cannot start (one job in flight), and each
request asks for far more tokens than it can make before the cancel reaches it.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from openai import OpenAI
from openai.types import Batch, FileObject
from openai.types.chat import ChatCompletion

from lmdq.redis.keys import Keys
from lmdq.results.store import ResultStore
from lmdq_bench.api_bench import ApiProcess
from tests.conftest import start_worker

KEYS = {"alice": f"alice-key-{uuid.uuid4().hex}"}
TERMINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"apiq{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def api(redis_url: str, prefix: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiProcess]:
    work = tmp_path_factory.mktemp("api")
    # four requests a job: the cancel test's batch is two jobs, one running and one never started
    srv = ApiProcess(redis_url=redis_url, prefix=prefix, keys=KEYS, files_dir=work / "files", log=work / "api.log",
                     env={"LMDQ_KNOWN_MODELS": '["sim"]', "LMDQ_BATCH_SIZE": "4"}).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture()
def worker_env(env: dict[str, str], prefix: str) -> dict[str, str]:
    return {**env, "LMDQ_KEY_PREFIX": prefix, "LMDQ_PARTIAL_INTERVAL_S": "0.05"}


def sdk(api: ApiProcess) -> OpenAI:
    return OpenAI(base_url=api.url + "/v1", api_key=KEYS["alice"])


def chat_line(cid: str, text: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "sim", "messages": [{"role": "user", "content": text}], "max_tokens": 4, **body}}


def upload(c: OpenAI, rows: list[dict[str, Any]]) -> FileObject:
    return c.files.create(file=("in.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode()), purpose="batch")


def until(c: OpenAI, batch_id: str, *statuses: str, polls: int = 600) -> Batch:
    b = c.batches.retrieve(batch_id)
    for _ in range(polls):
        if b.status in statuses:
            return b
        time.sleep(0.05)
        b = c.batches.retrieve(batch_id)
    raise AssertionError(f"batch {batch_id} still {b.status} after {polls} polls, want {statuses}")


def lmdq_batch_id(client: redis.Redis, prefix: str, api_batch_id: str) -> str:
    raw = client.hget(f"{prefix}:api:batch:{api_batch_id}", "lmdq_id")
    assert raw, "the batch was not submitted"
    return raw.decode()


def lines_of(c: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()] if file_id else []


def test_usage_ids_and_model_through_the_sdk(api: ApiProcess, worker_env: dict[str, str], client: redis.Redis,
                                             prefix: str) -> None:
    """5467e47: ``usage`` stayed null after completion, line ids were ``<lmdq batch>-<index>`` and ``model``
    was null until the batch was validated."""
    c = sdk(api)
    rows = [chat_line(f"u-{i}", f"question number {i} " * (i + 1), max_tokens=3 + i) for i in range(6)]
    created = c.batches.create(input_file_id=upload(c, rows).id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    assert created.model == "sim"  # from the file's lines, in the create call's own answer
    b = until(c, created.id, "in_progress")
    assert b.model == "sim" and b.usage is None  # no usage before the requests are done
    assert start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "1", "--burst",
                        env=worker_env).wait(60) == 0
    b = until(c, b.id, *TERMINAL)
    assert b.status == "completed" and b.model == "sim", b
    lines = lines_of(c, b.output_file_id)
    assert len(lines) == 6
    bodies = [ChatCompletion.model_validate(x["response"]["body"]) for x in lines]
    prompt = sum(cc.usage.prompt_tokens for cc in bodies if cc.usage)
    completion = sum(cc.usage.completion_tokens for cc in bodies if cc.usage)
    assert prompt > 0 and completion == sum(3 + i for i in range(6))
    assert b.usage is not None  # OpenAI's BatchUsage, the sums of the output lines' usage
    assert (b.usage.input_tokens, b.usage.output_tokens, b.usage.total_tokens) == (prompt, completion,
                                                                                  prompt + completion)
    assert b.usage.input_tokens_details.cached_tokens >= 0 and b.usage.output_tokens_details.reasoning_tokens == 0

    internal = lmdq_batch_id(client, prefix, b.id)
    ids = [x["id"] for x in lines]
    request_ids = [x["response"]["request_id"] for x in lines]
    assert all(re.fullmatch(r"batch_req_[0-9a-f]{32}", i) for i in ids), ids
    assert all(re.fullmatch(r"req_[0-9a-f]{32}", i) for i in request_ids), request_ids
    assert len(set(ids)) == len(set(request_ids)) == 6
    text = c.files.content(b.output_file_id).text
    assert internal not in text and internal.removeprefix("batch_") not in text  # no internal name anywhere
    assert c.batches.retrieve(b.id).usage == b.usage  # kept, not recomputed per read


def test_a_request_cancelled_while_running_says_so(api: ApiProcess, worker_env: dict[str, str],
                                                   client: redis.Redis, prefix: str, procs: list[Any]) -> None:
    """5467e47: after a cancel, requests the worker had started said 'cancelled before it ran'."""
    c = sdk(api)
    rows = [chat_line(f"c-{i}", f"long answer {i}", max_tokens=4000) for i in range(8)]  # two jobs of four
    b = c.batches.create(input_file_id=upload(c, rows).id, endpoint="/v1/chat/completions", completion_window="24h")
    b = until(c, b.id, "in_progress")
    bid = lmdq_batch_id(client, prefix, b.id)
    w = start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "10", "--jobs-in-flight", "1",
                     env=worker_env)
    procs.append(w)
    store = ResultStore(client, keys=Keys(prefix))
    for _ in range(600):  # until the running job's four requests have each written a partial: in the engine
        if store.partial_count(bid) >= 4:
            break
        time.sleep(0.05)
    assert store.partial_count(bid) == 4  # the first job's four; the second job never started
    c.batches.cancel(b.id)
    b = until(c, b.id, "cancelled")
    assert b.output_file_id is None and b.request_counts is not None and b.request_counts.failed == 8
    errs = {x["custom_id"]: x["error"] for x in lines_of(c, b.error_file_id)}
    assert {e["code"] for e in errs.values()} == {"batch_cancelled"}
    running = {cid for cid, e in errs.items() if "while it was running" in e["message"]}
    before = {cid for cid, e in errs.items() if e["message"] == "This request was cancelled before it ran."}
    assert running == {f"c-{i}" for i in range(4)}, errs
    assert before == {f"c-{i}" for i in range(4, 8)}, errs
    assert all(re.search(r"\(\d+ tokens generated\)", errs[cid]["message"]) for cid in running)


def test_readme_says_what_body_n_does() -> None:
    """5467e47: the README said ``n > 1`` is refused in OpenAI files while ``body.n`` gives n choices
    (tests/test_api.py::test_body_n_gives_n_choices_through_the_sdk runs it)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    flat = " ".join(readme.split())
    assert "`n > 1` is refused" not in flat
    assert "`body.n` gives n choices" in flat


def test_an_unknown_model_is_worded_for_an_http_caller(api: ApiProcess) -> None:
    """5467e47: the batch's error ended "or pass --allow-unknown-model", a flag an HTTP caller has no way to
    pass; it now names the line, the model and the server setting, and no CLI flag."""
    c = sdk(api)
    rows = [chat_line("ok", "fine"), chat_line("bad", "x", model="no-such-model")]
    b = c.batches.create(input_file_id=upload(c, rows).id, endpoint="/v1/chat/completions", completion_window="24h")
    b = until(c, b.id, *TERMINAL)
    assert b.status == "failed" and b.errors is not None and b.errors.data, b
    e = b.errors.data[0]
    assert (e.code, e.line) == ("model_not_found", 2), e
    assert e.message and "'no-such-model'" in e.message and "--" not in e.message, e.message
    assert "allow-unknown" not in e.message and "allow_unknown" not in e.message, e.message
