"""lmdq-api (issue #25) end to end: a real ``lmdq-api`` process on 127.0.0.1, a real redis-server and
the sim engine worker, driven through the official ``openai`` SDK with only ``base_url`` and
``api_key`` set, exactly as existing OpenAI Batch code would.

Deterministic: no worker runs while a batch must stay queued (cancel, pollers, pagination); a burst
worker drains the queue and exits when a batch must run; the completion window passes by moving the
batch's deadline behind the Redis server's clock (the clock the worker judges expiry by). Every wait
is a bounded number of polls.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from openai import OpenAI
from openai.types import Batch, BatchError, Completion, FileObject
from openai.types.chat import ChatCompletion

from lmdq.redis.keys import BatchField, Keys
from lmdq_bench.api_bench import ApiProcess, write_batch_file
from tests.conftest import start_worker

KEYS = {t: f"{t}-key-{uuid.uuid4().hex}" for t in ("alice", "bob", "pager", "poll", "mem")}
SIM = ("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "1", "--burst")
TERMINAL = ("completed", "failed", "expired", "cancelled")
EMBEDDED = "smollm2-135m-instruct"  # the model `lmdq-worker` serves with no --model (CPU, transformers)


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"api{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def api(redis_url: str, prefix: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiProcess]:
    work = tmp_path_factory.mktemp("api")
    srv = ApiProcess(redis_url=redis_url, prefix=prefix, keys=KEYS, files_dir=work / "files", log=work / "api.log",
                     env={"LMDQ_KNOWN_MODELS": f'["sim", "{EMBEDDED}"]'}).start()
    try:
        yield srv
    finally:
        srv.stop()
    # the server's whole log: JSON lines only, and no API key anywhere in it
    text = srv.log.read_text()
    for line in text.splitlines():
        json.loads(line)
    for key in KEYS.values():
        assert key not in text


@pytest.fixture()
def worker_env(env: dict[str, str], prefix: str) -> dict[str, str]:
    return {**env, "LMDQ_KEY_PREFIX": prefix}


def sdk(api: ApiProcess, tenant: str) -> OpenAI:
    return OpenAI(base_url=api.url + "/v1", api_key=KEYS[tenant])


def chat_line(cid: str, text: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "sim", "messages": [{"role": "user", "content": text}], "max_tokens": 4, **body}}


def upload(c: OpenAI, rows: list[dict[str, Any]] | bytes, name: str = "in.jsonl") -> FileObject:
    data = rows if isinstance(rows, bytes) else "".join(json.dumps(r) + "\n" for r in rows).encode()
    return c.files.create(file=(name, data), purpose="batch")


def until(c: OpenAI, batch_id: str, *statuses: str, polls: int = 600) -> Batch:
    """``batches.retrieve`` until the status is one of ``statuses`` (at most ``polls`` times)."""
    b = c.batches.retrieve(batch_id)
    for _ in range(polls):
        if b.status in statuses:
            return b
        time.sleep(0.05)
        b = c.batches.retrieve(batch_id)
    raise AssertionError(f"batch {batch_id} still {b.status} after {polls} polls, want {statuses}")


def raw_get(url: str) -> tuple[int, bytes]:
    """A plain GET (no SDK, no Authorization header): status and body."""
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def lmdq_batch_id(client: redis.Redis, prefix: str, api_batch_id: str) -> str:
    raw = client.hget(f"{prefix}:api:batch:{api_batch_id}", "lmdq_id")
    assert raw, "the batch was not submitted"
    return raw.decode()


# ------------------------------------------------------------------ the OpenAI Batch flow


def test_files_batches_retrieve_content_every_custom_id_once(api: ApiProcess, worker_env: dict[str, str]) -> None:
    c = sdk(api, "alice")
    rows = [chat_line(f"req-{i}", f"question {i}") for i in range(40)]
    f = upload(c, rows)
    assert isinstance(f, FileObject) and f.purpose == "batch" and f.bytes > 0 and f.filename == "in.jsonl"
    assert c.files.retrieve(f.id) == f
    assert c.files.content(f.id).content == "".join(json.dumps(r) + "\n" for r in rows).encode()

    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={"run": "nightly"})
    assert isinstance(b, Batch) and b.status == "validating" and b.metadata == {"run": "nightly"}
    b = until(c, b.id, "in_progress")
    assert b.request_counts is not None and b.request_counts.total == 40 and b.model == "sim"
    assert start_worker(*SIM, env=worker_env).wait(60) == 0

    b = until(c, b.id, *TERMINAL)
    assert b.status == "completed", b
    assert b.request_counts is not None
    assert (b.request_counts.completed, b.request_counts.failed, b.request_counts.total) == (40, 0, 40)
    assert b.output_file_id and b.error_file_id is None
    assert b.created_at <= (b.in_progress_at or 0) <= (b.finalizing_at or 0) <= (b.completed_at or 0)
    out = c.files.retrieve(b.output_file_id)
    assert out.purpose == "batch_output"
    lines = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in lines) == sorted(r["custom_id"] for r in rows)  # each exactly once
    for x in lines:
        assert x["error"] is None and x["response"]["status_code"] == 200
        cc = ChatCompletion.model_validate(x["response"]["body"])
        assert cc.object == "chat.completion" and cc.choices[0].message.content
    assert out.bytes == len(c.files.content(b.output_file_id).content)
    assert b.id in [x.id for x in c.batches.list()]


def test_body_n_gives_n_choices_through_the_sdk(api: ApiProcess, worker_env: dict[str, str]) -> None:
    """Issue 24: ``body.n`` through Files + Batches: one output line per request with choices[0..n-1]."""
    c = sdk(api, "alice")
    rows = [chat_line(f"n-{i}", f"question {i}", n=3, temperature=0.9, seed=i) for i in range(4)]
    b = c.batches.create(input_file_id=upload(c, rows).id, endpoint="/v1/chat/completions", completion_window="24h")
    until(c, b.id, "in_progress")
    assert start_worker(*SIM, env=worker_env).wait(60) == 0
    b = until(c, b.id, *TERMINAL)
    assert b.status == "completed" and b.output_file_id, b
    lines = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in lines) == [f"n-{i}" for i in range(4)]
    for x in lines:
        cc = ChatCompletion.model_validate(x["response"]["body"])
        assert [ch.index for ch in cc.choices] == [0, 1, 2] and all(ch.message.content for ch in cc.choices)
        assert cc.usage is not None and cc.usage.completion_tokens > 0


@pytest.mark.model
def test_the_embedded_model_answers_through_the_sdk(api: ApiProcess, worker_env: dict[str, str]) -> None:
    """The same flow on real generation: the embedded CPU model, chat and completions endpoints."""
    c = sdk(api, "alice")
    chat = [chat_line("capital", "What is the capital of France? Answer in one word.", model=EMBEDDED,
                      max_tokens=16)]
    raw = [{"custom_id": "count", "method": "POST", "url": "/v1/completions",
            "body": {"model": EMBEDDED, "prompt": "One, two, three,", "max_tokens": 4}}]
    b1 = c.batches.create(input_file_id=upload(c, chat).id, endpoint="/v1/chat/completions", completion_window="24h")
    b2 = c.batches.create(input_file_id=upload(c, raw).id, endpoint="/v1/completions", completion_window="24h")
    until(c, b1.id, "in_progress")
    until(c, b2.id, "in_progress")
    assert start_worker("--burst", env=worker_env).wait(600) == 0
    b1, b2 = until(c, b1.id, *TERMINAL), until(c, b2.id, *TERMINAL)
    assert (b1.status, b2.status) == ("completed", "completed")
    assert b1.output_file_id and b2.output_file_id
    (line,) = [json.loads(x) for x in c.files.content(b1.output_file_id).text.splitlines()]
    answer = ChatCompletion.model_validate(line["response"]["body"])
    assert answer.model == EMBEDDED and "Paris" in (answer.choices[0].message.content or "")
    (line,) = [json.loads(x) for x in c.files.content(b2.output_file_id).text.splitlines()]
    done = Completion.model_validate(line["response"]["body"])
    assert done.object == "text_completion" and done.choices[0].text and done.usage is not None
    assert done.usage.completion_tokens == 4


def test_completions_endpoint_and_a_mismatched_url(api: ApiProcess) -> None:
    """Every line must use the batch's endpoint: a /v1/completions line in a chat batch fails, with its line."""
    c = sdk(api, "alice")
    other = {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"model": "sim", "prompt": "p"}}
    body = (json.dumps(chat_line("a", "x")) + "\n" + json.dumps(other) + "\n"
            + json.dumps({**other, "custom_id": "c"}).replace("/", "\\/") + "\n").encode()  # JSON's escaped slashes
    b = c.batches.create(input_file_id=upload(c, body).id, endpoint="/v1/chat/completions", completion_window="24h")
    b = until(c, b.id, *TERMINAL)
    assert b.status == "failed" and b.errors and b.errors.data
    assert [(e.line, e.param, e.code) for e in b.errors.data] == [(2, "url", "invalid_url"), (3, "url", "invalid_url")]
    assert "'/v1/completions'" in (b.errors.data[0].message or "")


def test_bad_file_fails_with_line_numbered_errors(api: ApiProcess) -> None:
    c = sdk(api, "alice")
    body = b"".join([
        json.dumps(chat_line("ok-1", "fine")).encode() + b"\n",
        b"{not json\n",
        json.dumps(chat_line("ok-3", "fine")).encode() + b"\n",
        json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"}).encode() + b"\n",
    ])
    b = c.batches.create(input_file_id=upload(c, body, "bad.jsonl").id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    b = until(c, b.id, *TERMINAL)
    assert b.status == "failed" and b.failed_at and b.errors is not None and b.errors.object == "list"
    errs = [BatchError.model_validate(e.model_dump()) for e in b.errors.data or []]
    assert [e.line for e in errs] == [2, 4]
    assert errs[0].code == "invalid_json_line" and errs[1].param == "body"
    for e in errs:  # messages name the uploaded file, never the server's path to it
        assert e.message and str(api.files_dir) not in e.message
    assert b.output_file_id is None and b.request_counts is not None and b.request_counts.total == 0
    # nothing was enqueued: a failed batch is not in lmdq at all; its model is the file's, from creation (issue 45)
    assert b.model == "sim"


def test_cancel_a_queued_batch(api: ApiProcess) -> None:
    c = sdk(api, "alice")
    rows = [chat_line(f"c{i}", "wait") for i in range(5)]
    b = c.batches.create(input_file_id=upload(c, rows).id, endpoint="/v1/chat/completions", completion_window="24h")
    until(c, b.id, "in_progress")  # submitted; no worker runs, so nothing starts
    got = c.batches.cancel(b.id)
    assert got.status in ("cancelling", "cancelled") and got.cancelling_at
    b = until(c, b.id, "cancelled")
    assert b.cancelled_at and b.request_counts is not None and b.request_counts.failed == 5
    assert b.output_file_id is None and b.error_file_id
    errs = [json.loads(x) for x in c.files.content(b.error_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in errs) == [f"c{i}" for i in range(5)]
    assert {x["error"]["code"] for x in errs} == {"batch_cancelled"}
    assert c.batches.cancel(b.id).status == "cancelled"  # idempotent
    failed = c.batches.create(input_file_id=upload(c, b"{}\n").id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    until(c, failed.id, "failed")
    with pytest.raises(openai.ConflictError):  # an ended batch cannot be cancelled
        c.batches.cancel(failed.id)


def test_expired_window(api: ApiProcess, worker_env: dict[str, str], client: redis.Redis, prefix: str) -> None:
    c = sdk(api, "alice")
    rows = [chat_line(f"e{i}", "late") for i in range(3)]
    b = c.batches.create(input_file_id=upload(c, rows).id, endpoint="/v1/chat/completions", completion_window="24h")
    until(c, b.id, "in_progress")
    sec, usec = client.time()  # the window passes: the deadline is put behind the Redis server's clock
    client.hset(Keys(prefix).batch(lmdq_batch_id(client, prefix, b.id)), BatchField.expires_at.value,
                sec + usec / 1e6 - 1.0)
    assert start_worker(*SIM, env=worker_env).wait(60) == 0
    b = until(c, b.id, *TERMINAL)
    assert b.status == "expired" and b.expired_at and b.request_counts is not None
    assert (b.request_counts.completed, b.request_counts.failed) == (0, 3)
    assert b.output_file_id is None and b.error_file_id
    errs = [json.loads(x) for x in c.files.content(b.error_file_id).text.splitlines()]
    assert [x["custom_id"] for x in errs] == ["e0", "e1", "e2"]
    assert {x["error"]["code"] for x in errs} == {"batch_expired"}


def test_a_submission_a_stopped_replica_left_is_run_again_and_never_twice(api: ApiProcess, client: redis.Redis,
                                                                        prefix: str) -> None:
    """A replica that stops between enqueueing a batch and recording it leaves the batch ``validating``
    with no lease: a replica runs the submission again, and the idempotency key (the API batch id)
    returns the lmdq batch the first run made instead of enqueueing the file twice."""
    c = sdk(api, "alice")
    b = c.batches.create(input_file_id=upload(c, [chat_line("once", "x")]).id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    until(c, b.id, "in_progress")
    first = lmdq_batch_id(client, prefix, b.id)
    lmdq_batches = client.zcard(Keys(prefix).batches())
    key = f"{prefix}:api:batch:{b.id}"
    client.hset(key, "state", "validating")  # as the stopped replica left it
    client.hdel(key, "lmdq_id")
    client.sadd(f"{prefix}:api:open", b.id)
    b = until(c, b.id, "in_progress")
    assert lmdq_batch_id(client, prefix, b.id) == first
    assert client.zcard(Keys(prefix).batches()) == lmdq_batches
    assert b.request_counts is not None and b.request_counts.total == 1


# ------------------------------------------------------------------ lists


def test_list_batches_and_files_with_pagination(api: ApiProcess) -> None:
    c = sdk(api, "pager")
    files = [upload(c, [chat_line("p", "x")], f"p{i}.jsonl") for i in range(5)]
    made = [c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id
            for f in files]
    first = c.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    second = c.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in second.data] == made[::-1][2:4]
    assert [b.id for b in c.batches.list(limit=2)] == made[::-1]  # the SDK's auto-paging: each once, newest first
    assert [f.id for f in c.files.list(limit=2)] == [f.id for f in files][::-1]
    assert [f.id for f in c.files.list(limit=3, order="asc")] == [f.id for f in files]
    with pytest.raises(openai.BadRequestError):
        c.batches.list(limit=101)
    with pytest.raises(openai.BadRequestError):
        c.batches.list(after="batch_" + "0" * 24)
    gone = files[0].id
    assert c.files.delete(gone).deleted
    assert gone not in [f.id for f in c.files.list()]
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(gone)


# ------------------------------------------------------------------ tenants and keys


def test_a_second_tenant_gets_404_for_the_first_tenants_batch_and_file(api: ApiProcess) -> None:
    a, b = sdk(api, "alice"), sdk(api, "bob")
    f = upload(a, [chat_line("t", "mine")])
    batch = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: b.batches.retrieve(batch.id), lambda: b.batches.cancel(batch.id),
                 lambda: b.files.retrieve(f.id), lambda: b.files.content(f.id), lambda: b.files.delete(f.id),
                 lambda: b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.status_code == 404
        assert set(e.value.body) == {"message", "type", "param", "code"}
    assert batch.id not in [x.id for x in b.batches.list()]
    assert f.id not in [x.id for x in b.files.list()]
    assert a.batches.retrieve(batch.id).id == batch.id and a.files.retrieve(f.id).id == f.id  # still there


def test_a_wrong_key_gets_401(api: ApiProcess) -> None:
    bad = OpenAI(base_url=api.url + "/v1", api_key="not-a-key-" + uuid.uuid4().hex)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.batches.list()
    assert e.value.status_code == 401 and "not-a-key" not in str(e.value.body)
    with pytest.raises(openai.AuthenticationError):
        bad.files.create(file=("x.jsonl", b"{}\n"), purpose="batch")
    status, body = raw_get(api.url + "/v1/files")  # no Authorization header at all
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"


# ------------------------------------------------------------------ errors, health, metrics


def test_openai_error_shapes_for_bad_requests(api: ApiProcess) -> None:
    c = sdk(api, "alice")
    f = upload(c, [chat_line("x", "y")])
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=f.id, endpoint="/v1/moderations", completion_window="24h")
    assert e.value.param == "endpoint"
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="soon")
    assert e.value.param == "completion_window"
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert e.value.param == "purpose"
    with pytest.raises(openai.NotFoundError):
        c.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        c.files.content("../../etc/passwd")


def test_health_ready_and_metrics(api: ApiProcess) -> None:
    assert raw_get(api.url + "/healthz") == (200, b'{"status":"ok"}')
    status, body = raw_get(api.url + "/readyz")
    assert status == 200 and json.loads(body)["checks"] == {"redis": True, "files_dir": True}
    text = raw_get(api.url + "/metrics")[1].decode()
    assert 'lmdq_api_requests_total{method="POST",route="/v1/files",status="200"}' in text
    assert "lmdq_api_upload_bytes_total" in text and "lmdq_api_batches_created_total" in text


# ------------------------------------------------------------------ load (the bench has the numbers)


def test_fifty_clients_polling_a_running_batch_see_no_error(api: ApiProcess) -> None:
    c = sdk(api, "poll")
    b = c.batches.create(input_file_id=upload(c, [chat_line("r", "x")]).id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    until(c, b.id, "in_progress")  # no worker runs until this test ends: it stays in_progress
    results: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(50)

    def poll() -> None:
        mine = sdk(api, "poll")
        barrier.wait()
        for _ in range(6):
            try:
                got = mine.batches.retrieve(b.id).status
            except BaseException as e:
                with lock:
                    errors.append(e)
            else:
                with lock:
                    results.append(got)

    threads = [threading.Thread(target=poll) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert results == ["in_progress"] * 300


def test_a_large_upload_is_streamed_not_held_in_memory(api: ApiProcess, tmp_path: Path) -> None:
    """64 MB through the SDK: the server's RSS high-water mark (VmHWM, exact) grows by far less than the
    file, and the bytes come back identical. bench/api_bench.py runs the 200 MB case and prints it."""
    c = sdk(api, "mem")
    big = tmp_path / "big.jsonl"
    write_batch_file(big, 64 << 20)
    before = api.peak_rss_bytes()
    with open(big, "rb") as fh:
        f = c.files.create(file=("big.jsonl", fh), purpose="batch")
    growth = api.peak_rss_bytes() - before
    assert f.bytes == big.stat().st_size
    assert growth < 24 << 20, f"peak RSS grew {growth / 2**20:.1f} MB for a 64 MB upload"
    digest = hashlib.sha256()
    with c.files.with_streaming_response.content(f.id) as resp:
        for chunk in resp.iter_bytes():
            digest.update(chunk)
    assert digest.hexdigest() == hashlib.sha256(big.read_bytes()).hexdigest()
    c.files.delete(f.id)


def test_an_upload_over_the_limit_is_413_and_leaves_nothing(redis_url: str, tmp_path: Path) -> None:
    """Refused by its Content-Length (the SDK sends one) or, chunked, while it streams in: either way a
    413 in OpenAI's shape, no file listed and no partial file left on disk."""
    import http.client

    key = "lim-" + uuid.uuid4().hex
    files_dir = tmp_path / "files"
    srv = ApiProcess(redis_url=redis_url, prefix=f"lim{uuid.uuid4().hex[:8]}", keys={"lim": key},
                     files_dir=files_dir, log=tmp_path / "api.log",
                     env={"LMDQ_API_MAX_UPLOAD_BYTES": "100000"}).start()
    try:
        c = OpenAI(base_url=srv.url + "/v1", api_key=key)
        with pytest.raises(openai.APIStatusError) as e:
            c.files.create(file=("big.jsonl", b"x" * 300_000), purpose="batch")
        assert e.value.status_code == 413 and e.value.param == "file"

        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.putrequest("POST", "/v1/files")
        conn.putheader("Authorization", f"Bearer {key}")
        conn.putheader("Content-Type", "multipart/form-data; boundary=XyZ")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        head = (b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n')
        try:
            for chunk in [head, *([b"y" * 65536] * 4)]:
                conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            conn.send(b"0\r\n\r\n")
        except OSError:
            pass  # the server may answer and close before the rest is sent
        resp = conn.getresponse()
        assert resp.status == 413 and json.loads(resp.read())["error"]["param"] == "file"
        conn.close()
        assert list(c.files.list()) == []
        assert [p.name for p in files_dir.iterdir()] == []
    finally:
        srv.stop()


def test_output_files_from_a_results_sink(redis_url: str, tmp_path: Path, env: dict[str, str]) -> None:
    """With LMDQ_RESULTS_URL the workers write results to JSONL shards and Redis keeps an index: the
    output file is still every custom_id once, read back from the shards."""
    key = "sink-" + uuid.uuid4().hex
    pfx = f"sink{uuid.uuid4().hex[:8]}"
    sink = tmp_path / "results"
    srv = ApiProcess(redis_url=redis_url, prefix=pfx, keys={"sink": key}, files_dir=tmp_path / "files",
                     log=tmp_path / "api.log", env={"LMDQ_KNOWN_MODELS": '["sim"]', "LMDQ_RESULTS_URL": str(sink)}
                     ).start()
    try:
        c = OpenAI(base_url=srv.url + "/v1", api_key=key)
        rows = [chat_line(f"s{i}", f"q {i}") for i in range(70)]
        b = c.batches.create(input_file_id=upload(c, rows).id, endpoint="/v1/chat/completions",
                             completion_window="24h")
        until(c, b.id, "in_progress")
        assert start_worker(*SIM, env={**env, "LMDQ_KEY_PREFIX": pfx, "LMDQ_RESULTS_URL": str(sink)}).wait(60) == 0
        b = until(c, b.id, *TERMINAL)
        assert b.status == "completed" and b.output_file_id
        assert any(sink.rglob("*.jsonl*")), "the results went to the sink's shards"
        lines = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
        assert [x["custom_id"] for x in lines] == [r["custom_id"] for r in rows]
    finally:
        srv.stop()


def test_score_and_reward_batches_through_the_sdk(api: ApiProcess, worker_env: dict[str, str]) -> None:
    """Issue 24: ``/v1/score`` and ``/v1/reward`` are batch endpoints; output bodies are vLLM-/v1/score-shaped
    (``object: list``, ``data[i].score``) and a chat line in a score batch is refused with its line."""
    c = sdk(api, "alice")
    score = [{"custom_id": f"s{i}", "method": "POST", "url": "/v1/score",
              "body": {"model": "sim", "prompt": f"Q{i}: 2+2=", "continuations": ["4", "five", "6 7"]}}
             for i in range(3)]
    reward = [{"custom_id": "r0", "method": "POST", "url": "/v1/reward",
               "body": {"model": "sim", "messages": [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "hello"}]}}]
    b1 = c.batches.create(input_file_id=upload(c, score).id, endpoint="/v1/score",  # type: ignore[arg-type]
                          completion_window="24h")
    b2 = c.batches.create(input_file_id=upload(c, reward).id, endpoint="/v1/reward",  # type: ignore[arg-type]
                          completion_window="24h")
    mixed = c.batches.create(input_file_id=upload(c, [score[0], chat_line("c", "hi")]).id,
                             endpoint="/v1/score", completion_window="24h")  # type: ignore[arg-type]
    until(c, b1.id, "in_progress")
    until(c, b2.id, "in_progress")
    bad = until(c, mixed.id, "failed")
    assert bad.errors and bad.errors.data and bad.errors.data[0].line == 2
    assert start_worker(*SIM, env=worker_env).wait(60) == 0
    b1, b2 = until(c, b1.id, *TERMINAL), until(c, b2.id, *TERMINAL)
    assert (b1.status, b2.status) == ("completed", "completed")
    assert b1.output_file_id and b2.output_file_id
    lines = sorted((json.loads(x) for x in c.files.content(b1.output_file_id).text.splitlines()),
                   key=lambda x: x["custom_id"])
    assert [x["custom_id"] for x in lines] == ["s0", "s1", "s2"]
    for x in lines:
        body = x["response"]["body"]
        assert body["object"] == "list" and [d["num_tokens"] for d in body["data"]] == [1, 1, 2]
        assert all(d["score"] == d["logprob"] <= 0 for d in body["data"])
    (line,) = [json.loads(x) for x in c.files.content(b2.output_file_id).text.splitlines()]
    (entry,) = line["response"]["body"]["data"]
    assert entry["object"] == "score" and -5 <= entry["score"] < 5
