"""End to end through the real CLIs and a real redis-server, on the SIMULATED engine."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import redis

from lmdq.contract import BatchStatus, Result, ResultStatus
from lmdq.redis.keys import Keys
from lmdq.results.store import ResultStore
from tests.conftest import run_cli, start_worker
from tests.helpers import results_of, wait_batch, write_jsonl


def _submit(path: Path, env: dict[str, str], *extra: str) -> dict:
    p = run_cli("producer", "submit", str(path), "--model", "sim", "--allow-unknown-model", "--json", *extra, env=env)
    assert p.returncode == 0, p.stderr.decode()
    return json.loads(p.stdout)


def test_submit_worker_results_in_order_with_metadata(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                                       prefix: str) -> None:
    rows = [{"custom_id": f"r{i}", "prompt": f"question number {i}"} for i in range(50)]
    rows[7] = {"custom_id": "r7", "messages": [{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": "hi"}], "params": {"max_new_tokens": 3}}
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    batch = _submit(f, env, "--batch-size", "8", "--max-new-tokens", "12", "--metadata", "team=eval")
    assert batch["status"] == "queued" and batch["request_counts"]["total"] == 50
    assert batch["metadata"] == {"team": "eval"} and batch["num_jobs"] == 7
    w = start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "1", "--burst", env=env)
    assert w.wait(60) == 0
    b = wait_batch(client, prefix, batch["id"])
    assert b.status is BatchStatus.completed and b.request_counts.completed == 50

    out = run_cli("producer", "results", batch["id"], env=env)
    assert out.returncode == 0
    lines = [Result.model_validate_json(x) for x in out.stdout.splitlines()]
    assert [r.custom_id for r in lines] == [f"r{i}" for i in range(50)]
    assert [r.index for r in lines] == list(range(50))
    for r in lines:
        assert r.status is ResultStatus.completed and r.backend == "sim" and r.model == "sim"
        assert r.worker and r.attempt == 1 and r.text
        assert r.input_token_len > 0
        t = r.timings
        assert t.enqueued_at <= t.started_at <= t.first_token_at <= t.finished_at  # type: ignore[operator]
    assert lines[7].generate_token_len == 3 and lines[7].finish_reason.value == "length"
    assert all(r.generate_token_len == 12 for i, r in enumerate(lines) if i != 7)
    # deterministic text from the prompt: the same prompt gives the same text
    assert lines[0].text != lines[1].text


def test_openai_output_format(tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str) -> None:
    rows = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}},
        {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
         "body": {"model": "sim", "prompt": "Once upon a time", "max_tokens": 4}},
    ]
    f = write_jsonl(tmp_path / "openai.jsonl", rows)
    p = run_cli("producer", "submit", str(f), "--allow-unknown-model", env=env)  # model from the bodies
    assert p.returncode == 0, p.stderr.decode()
    bid = p.stdout.decode().strip()
    start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "1", "--burst", env=env).wait(60)
    out = run_cli("producer", "results", bid, "--format", "openai", "--wait", "--timeout", "30", env=env)
    assert out.returncode == 0, out.stderr.decode()
    chat, cmpl = (json.loads(x) for x in out.stdout.splitlines())
    assert chat["custom_id"] == "chat-1" and chat["error"] is None
    body = chat["response"]["body"]
    assert chat["response"]["status_code"] == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5
    assert cmpl["response"]["body"]["object"] == "text_completion"
    cbody = cmpl["response"]["body"]
    assert cbody["choices"][0]["text"] and cbody["usage"]["completion_tokens"] == 4
    # a raw completion prompt skips the chat template: fewer input tokens than templated
    assert cmpl["response"]["body"]["usage"]["prompt_tokens"] == 4


def test_per_request_error_isolated(tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str) -> None:
    rows = [{"custom_id": "ok-1", "prompt": "fine"}, {"custom_id": "bad", "prompt": "please [[sim:error]]"},
            {"custom_id": "long", "prompt": " ".join(["w"] * 100)}, {"custom_id": "ok-2", "prompt": "also fine"}]
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    bid = _submit(f, env, "--max-new-tokens", "4")["id"]
    start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "1", "--session-len", "64",
                 "--burst", env=env).wait(60)
    b = wait_batch(client, prefix, bid)
    assert b.status is BatchStatus.completed
    assert b.request_counts.completed == 2 and b.request_counts.failed == 2
    res = {r.custom_id: r for r in results_of(client, prefix, bid)}
    assert res["bad"].status is ResultStatus.failed and res["bad"].error.code == "internal_error"  # type: ignore[union-attr]
    assert res["long"].error.code == "context_length_exceeded"  # type: ignore[union-attr]
    assert res["long"].finish_reason.value == "error" and res["long"].generate_token_len == 0  # type: ignore[union-attr]
    assert res["ok-1"].status is ResultStatus.completed and res["ok-2"].status is ResultStatus.completed


def test_partial_text_visible_during_long_generation(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                                    prefix: str) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [{"custom_id": "long", "prompt": "tell me everything"}])
    bid = _submit(f, env, "--max-new-tokens", "400")["id"]
    env = {**env, "LMDQ_PARTIAL_INTERVAL_S": "0.2"}
    w = start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "10", "--burst", env=env)
    store = ResultStore(client, keys=Keys(prefix))
    seen: list[Result] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not store.batches.get(bid).status.terminal:
        for _, raw in store.iter_results(bid, 1):
            if raw:
                r = Result.model_validate_json(raw)
                if r.status is ResultStatus.in_progress:
                    seen.append(r)
        time.sleep(0.1)
    assert w.wait(30) == 0
    assert len(seen) >= 2, "partial text was never visible before the request finished"
    assert 0 < seen[0].generate_token_len < 400 and seen[0].text
    final = results_of(client, prefix, bid)[0]
    assert final.status is ResultStatus.completed and final.generate_token_len == 400
    assert final.text.startswith(seen[0].text)
    assert store.partial_count(bid) == 0  # partials are dropped once the final result lands
    # `results` shows the partial while running: covered by iter_results(partial=True) above


def test_burst_exits_when_queues_empty(env: dict[str, str]) -> None:
    w = start_worker("--engine", "sim", "--served-model-name", "sim", "--burst", env=env)
    assert w.wait(30) == 0


def _wait_in_progress(store: ResultStore, bid: str, timeout: float = 20) -> None:
    """Until a worker has started the batch (the tests' own assertions say what happens if none did)."""
    deadline = time.monotonic() + timeout
    while store.batches.get(bid).status is not BatchStatus.in_progress and time.monotonic() < deadline:
        time.sleep(0.05)


def test_sigterm_with_work_in_flight_requeues_and_exits_zero(tmp_path: Path, env: dict[str, str],
                                                             client: redis.Redis, prefix: str) -> None:
    rows = [{"custom_id": f"r{i}", "prompt": f"p{i}"} for i in range(8)]
    bid = _submit(write_jsonl(tmp_path / "p.jsonl", rows), env, "--max-new-tokens", "2000", "--batch-size", "4")["id"]
    w = start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "5", "--drain-timeout", "1",
                     env=env)
    store = ResultStore(client, keys=Keys(prefix))
    _wait_in_progress(store, bid)
    time.sleep(0.5)
    w.send_signal(signal.SIGTERM)
    assert w.wait(30) == 0
    b = store.batches.get(bid)
    assert b.request_counts.done == 0  # nothing could finish in 1 s of drain ...
    from lmdq.redis.keys import queue_name, rq_queue_key

    q = [x.decode() for x in client.lrange(rq_queue_key(queue_name("sim", "normal", prefix)), 0, -1)]
    assert sorted(q) == [f"{bid}-000000", f"{bid}-000001"]  # ... and both jobs are back on the queue
    assert client.zcard(Keys(prefix).leases()) == 0
    # a second worker finishes the batch; a drain charges no attempt (issue 13), so still attempt 1
    start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "0", "--burst", env=env).wait(60)
    b = wait_batch(client, prefix, bid)
    assert b.request_counts.completed == 8
    assert {r.attempt for r in results_of(client, prefix, bid)} == {1}


def test_priorities_high_before_low(tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str) -> None:
    low = _submit(write_jsonl(tmp_path / "low.jsonl", [{"prompt": f"l{i}"} for i in range(4)]), env,
                  "--priority", "low", "--batch-size", "1", "--max-new-tokens", "2")["id"]
    high = _submit(write_jsonl(tmp_path / "high.jsonl", [{"prompt": f"h{i}"} for i in range(4)]), env,
                   "--priority", "high", "--batch-size", "1", "--max-new-tokens", "2")["id"]
    start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "1", "--jobs-in-flight", "1",
                 "--burst", env=env).wait(60)
    lo = results_of(client, prefix, low)
    hi = results_of(client, prefix, high)
    assert max(r.timings.started_at for r in hi) <= min(r.timings.started_at for r in lo)  # type: ignore[type-var]


def test_cancel_removes_queued_and_aborts_in_flight(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                                   prefix: str) -> None:
    rows = [{"custom_id": f"r{i}", "prompt": f"p{i}"} for i in range(40)]
    bid = _submit(write_jsonl(tmp_path / "p.jsonl", rows), env, "--max-new-tokens", "5000", "--batch-size", "4")["id"]
    w = start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "5", "--jobs-in-flight", "2",
                     env=env)
    store = ResultStore(client, keys=Keys(prefix))
    _wait_in_progress(store, bid)
    time.sleep(0.3)
    p = run_cli("producer", "cancel", bid, "--json", env=env)
    assert p.returncode == 0, p.stderr.decode()
    b = wait_batch(client, prefix, bid, timeout=20)
    assert b.status is BatchStatus.cancelled
    assert b.request_counts.cancelled == 40 and b.request_counts.done == 40
    aborted = [r for r in results_of(client, prefix, bid) if r.finish_reason is not None]
    assert aborted and all(r.finish_reason.value == "abort" for r in aborted)  # type: ignore[union-attr]
    w.send_signal(signal.SIGTERM)
    assert w.wait(30) == 0
