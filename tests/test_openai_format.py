"""OpenAI Batch API compatibility (issue #19), through the real CLIs, a real redis-server and the sim worker.

Output lines are validated against OpenAI's own published shapes: the ``openai`` package's pydantic
types (``ChatCompletion``, ``Completion``, ``ChatCompletionTokenLogprob``, ``BatchError``) plus exact
key sets where those types would accept extra keys.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import redis
from openai.types import BatchError, Completion
from openai.types.chat import ChatCompletion, ChatCompletionTokenLogprob

from lmdq.contract import BatchStatus, ResultStatus
from lmdq.redis.keys import BatchField, Keys
from lmdq.results.store import ResultStore
from tests.conftest import run_cli, start_worker
from tests.helpers import results_of, wait_batch, write_jsonl

SIM = ("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "1", "--burst")
TOKEN = re.compile(r"^token_id:\d+$")
LINE_KEYS = {"id", "custom_id", "response", "error"}


def _chat(cid: str, content: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], **body}}


def _completion(cid: str, prompt: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": "gpt-4o-mini", "prompt": prompt, **body}}


def _submit(path: Path, env: dict[str, str], *extra: str) -> dict[str, Any]:
    p = run_cli("lmdq.producer", "submit", str(path), "--allow-unknown-model", "--json", *extra, env=env)
    assert p.returncode == 0, p.stderr.decode()
    return json.loads(p.stdout)  # type: ignore[no-any-return]


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _nothing_enqueued(client: redis.Redis, prefix: str) -> None:
    assert ResultStore(client, keys=Keys(prefix)).batches.newest(10) == []
    # this test's own queues only: the redis-server is shared by the session (other tests' prefixes)
    assert not [k for k in client.scan_iter(f"rq:queue:{prefix}:*")]


def test_export_logprobs_error_file_and_model_redirect(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                                       prefix: str) -> None:
    rows = [
        _chat("top3", "hello there", max_tokens=5, logprobs=True, top_logprobs=3),
        _chat("plain", "no logprobs please", max_tokens=4),
        _chat("bad", "please [[sim:error]]", max_tokens=4),
        _completion("cmpl", "Once upon a time", max_tokens=6, logprobs=2),
        _chat("lp-only", "just the chosen token", max_tokens=3, logprobs=True),
    ]
    f = write_jsonl(tmp_path / "openai.jsonl", rows)
    # Every line names gpt-4o-mini; --model wins for all of them (a file written for OpenAI runs as is).
    batch = _submit(f, env, "--model", "sim")
    assert batch["model"] == "sim" and batch["request_counts"]["total"] == 5
    assert start_worker(*SIM, env=env).wait(60) == 0
    b = wait_batch(client, prefix, batch["id"])
    assert b.status is BatchStatus.completed and b.request_counts.completed == 4 and b.request_counts.failed == 1
    lmdq_results = {r.custom_id: r for r in results_of(client, prefix, batch["id"])}

    out, errs = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    p = run_cli("lmdq.producer", "results", batch["id"], "--format", "openai", "-o", str(out),
                "--errors-file", str(errs), env=env)
    assert p.returncode == 0, p.stderr.decode()
    ok = _lines(out)
    assert [x["custom_id"] for x in ok] == ["top3", "plain", "cmpl", "lp-only"]  # input order, successes only
    [bad] = _lines(errs)
    assert set(bad) == LINE_KEYS and bad["custom_id"] == "bad" and bad["response"] is None
    assert BatchError.model_validate(bad["error"]).code == "internal_error" and bad["error"]["message"]

    by_id = {x["custom_id"]: x for x in ok}
    for line in ok:
        assert set(line) == LINE_KEYS and line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["body"]["model"] == "sim"

    # chat with top_logprobs=3: one content entry per generated token, OpenAI's keys exactly
    chat = ChatCompletion.model_validate(by_id["top3"]["response"]["body"])
    lp = chat.choices[0].logprobs
    assert lp is not None and lp.content is not None
    assert chat.usage is not None and len(lp.content) == chat.usage.completion_tokens == 5
    want = lmdq_results["top3"].logprobs
    assert want is not None and len(want) == 5
    raw_content = by_id["top3"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    for entry, raw, token in zip(lp.content, raw_content, want, strict=True):
        assert set(raw) == {"token", "logprob", "bytes", "top_logprobs"}
        assert isinstance(entry, ChatCompletionTokenLogprob)
        assert entry.token == f"token_id:{token.token_id}" and entry.logprob == token.logprob <= 0
        assert entry.bytes is None  # lmdq has token ids, not token text: no bytes to give
        assert len(entry.top_logprobs) == 3
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [(f"token_id:{i}", x) for i, x in token.top]
        assert all(set(t) == {"token", "logprob", "bytes"} for t in raw["top_logprobs"])

    # logprobs: true without top_logprobs still gives the chosen token's logprob per token
    only = ChatCompletion.model_validate(by_id["lp-only"]["response"]["body"])
    lp_only = only.choices[0].logprobs
    assert lp_only is not None and lp_only.content is not None and len(lp_only.content) == 3
    assert all(TOKEN.match(e.token) and e.logprob <= 0 for e in lp_only.content)

    # not requested: null, as OpenAI does
    plain = ChatCompletion.model_validate(by_id["plain"]["response"]["body"])
    assert plain.choices[0].logprobs is None and by_id["plain"]["response"]["body"]["choices"][0]["logprobs"] is None

    # completions: parallel lists; top_logprobs maps token -> logprob; no text offsets without token text
    cmpl_body = by_id["cmpl"]["response"]["body"]
    cmpl = Completion.model_validate(cmpl_body)
    clp = cmpl.choices[0].logprobs
    assert clp is not None and clp.tokens is not None
    assert clp.token_logprobs is not None and clp.top_logprobs is not None
    assert set(cmpl_body["choices"][0]["logprobs"]) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert clp.text_offset is None
    want_c = lmdq_results["cmpl"].logprobs
    assert want_c is not None and cmpl.usage is not None and len(want_c) == cmpl.usage.completion_tokens == 6
    assert clp.tokens == [f"token_id:{t.token_id}" for t in want_c]
    assert clp.token_logprobs == [t.logprob for t in want_c]
    assert clp.top_logprobs == [{f"token_id:{i}": x for i, x in t.top} for t in want_c]
    assert all(len(top) == 2 for top in clp.top_logprobs)

    # without --errors-file: one stream, every request, input order (the same lines)
    one = run_cli("lmdq.producer", "results", batch["id"], "--format", "openai", env=env)
    assert one.returncode == 0, one.stderr.decode()
    merged = [json.loads(x) for x in one.stdout.splitlines()]
    assert [x["custom_id"] for x in merged] == ["top3", "plain", "bad", "cmpl", "lp-only"]
    assert merged[2] == bad and [x for x in merged if x["custom_id"] != "bad"] == ok


def test_cancelled_and_expired_use_openai_codes(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                                prefix: str) -> None:
    rows = [_chat(f"c{i}", f"question {i}", max_tokens=3) for i in range(3)]
    cancelled = _submit(write_jsonl(tmp_path / "a.jsonl", rows), env, "--model", "sim")
    p = run_cli("lmdq.producer", "cancel", cancelled["id"], env=env)
    assert p.returncode == 0, p.stderr.decode()
    expiring = _submit(write_jsonl(tmp_path / "b.jsonl", rows), env, "--model", "sim", "--completion-window", "1h")
    # the window passes with no worker: the deadline is put behind the Redis server's clock, the one the
    # worker judges expiry by (no sleeping, no race with the wall clock)
    sec, usec = client.time()
    client.hset(Keys(prefix).batch(expiring["id"]), BatchField.expires_at.value, sec + usec / 1e6 - 1.0)
    assert start_worker(*SIM, env=env).wait(60) == 0
    assert wait_batch(client, prefix, cancelled["id"]).status is BatchStatus.cancelled
    assert wait_batch(client, prefix, expiring["id"]).status is BatchStatus.expired

    for bid, status, code in ((cancelled["id"], ResultStatus.cancelled, "batch_cancelled"),
                              (expiring["id"], ResultStatus.expired, "batch_expired")):
        assert {r.status for r in results_of(client, prefix, bid)} == {status}
        out, errs = tmp_path / f"{code}.out", tmp_path / f"{code}.err"
        p = run_cli("lmdq.producer", "results", bid, "--format", "openai", "-o", str(out), "--errors-file", str(errs),
                    env=env)
        assert p.returncode == 0, p.stderr.decode()
        assert out.read_text() == ""  # nothing succeeded: the output file is empty, as OpenAI's would be
        lines = _lines(errs)
        assert [x["custom_id"] for x in lines] == ["c0", "c1", "c2"]
        for line in lines:
            assert set(line) == LINE_KEYS and line["response"] is None
            err = BatchError.model_validate(line["error"])
            assert set(line["error"]) == {"code", "message"} and err.code == code and err.message


def test_errors_file_needs_openai_format(tmp_path: Path, env: dict[str, str], client: redis.Redis) -> None:
    p = run_cli("lmdq.producer", "results", "batch_" + "0" * 24, "--errors-file", str(tmp_path / "e.jsonl"), env=env)
    assert p.returncode == 2 and "--errors-file: expected --format openai" in p.stderr.decode()
    same = tmp_path / "same.jsonl"
    p = run_cli("lmdq.producer", "results", "batch_" + "0" * 24, "--format", "openai", "-o", str(same),
                "--errors-file", str(same), env=env)
    assert p.returncode == 2 and "expected a file other than --output" in p.stderr.decode()
    assert not (tmp_path / "e.jsonl").exists() and not same.exists()


@pytest.mark.parametrize(
    ("bad_line", "field", "message"),
    [
        ({"method": "POST", "url": "/v1/chat/completions",
          "body": {"model": "sim", "messages": [{"role": "user", "content": "x"}]}},
         "custom_id", "required field is missing"),
        (_chat("s", "x", stream=True), "body.stream",
         "expected false or null, got true: a batch request cannot stream"),
    ],
)
def test_input_refusals_name_file_and_line(tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str,
                                           bad_line: dict[str, Any], field: str, message: str) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", [_chat("ok", "fine", stream=False), bad_line])
    p = run_cli("lmdq.producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", env=env)
    err = p.stderr.decode()
    assert p.returncode == 2, err
    assert f"{f}:2: field '{field}': {message}" in err and "Traceback" not in err
    _nothing_enqueued(client, prefix)


def test_model_rule_without_model_flag_lines_route_by_model(tmp_path: Path, env: dict[str, str],
                                                             client: redis.Redis, prefix: str) -> None:
    mixed = [_chat("a", "x"), {**_chat("b", "y"), "body": {"model": "other", "messages": [{"role": "user",
                                                                                          "content": "y"}]}}]
    f = write_jsonl(tmp_path / "mixed.jsonl", mixed)
    # lines naming different models: one batch over both (issue 24), each line on its own model
    several = _submit(f, env)
    assert several["model"] == "gpt-4o-mini"
    assert {m: c["total"] for m, c in several["model_counts"].items()} == {"gpt-4o-mini": 1, "other": 1}
    # the same file with --model: every line runs on it
    batch = _submit(f, env, "--model", "sim")
    assert batch["model"] == "sim" and batch["request_counts"]["total"] == 2 and batch.get("model_counts") is None
    # and agreeing lines without --model name the batch's model
    same = _submit(write_jsonl(tmp_path / "same.jsonl", [_chat("a", "x"), _chat("b", "y")]), env)
    assert same["model"] == "gpt-4o-mini" and same.get("model_counts") is None


def test_logprobs_come_from_the_results_shard(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                              prefix: str) -> None:
    """With --results-url Redis keeps no record once a job is sealed: the OpenAI export reads the full
    ones from the batch's shard, so logprobs are not silently null there."""
    env = {**env, "LMDQ_ALLOWED_OUTPUT_URLS": str(tmp_path)}
    rows = [_chat(f"c{i}", f"question {i}", max_tokens=4, logprobs=True, top_logprobs=2) for i in range(3)]
    f = write_jsonl(tmp_path / "in.jsonl", rows)
    bid = _submit(f, env, "--model", "sim", "--results-url", str(tmp_path / "sink"))["id"]
    assert start_worker(*SIM, env=env).wait(60) == 0
    assert wait_batch(client, prefix, bid).status is BatchStatus.completed
    assert not client.exists(Keys(prefix).results(bid))  # the premise: Redis has no record, so no logprobs
    assert [r.custom_id for r in results_of(client, prefix, bid)] == ["c0", "c1", "c2"]  # the shard has them
    assert client.hlen(Keys(prefix).shards(bid)) == 1
    p = run_cli("lmdq.producer", "results", bid, "--format", "openai", env=env)
    assert p.returncode == 0, p.stderr.decode()
    for line in p.stdout.splitlines():
        body = ChatCompletion.model_validate(json.loads(line)["response"]["body"])
        lp = body.choices[0].logprobs
        assert lp is not None and lp.content is not None and len(lp.content) == 4
        assert all(TOKEN.match(e.token) and len(e.top_logprobs) == 2 for e in lp.content)
