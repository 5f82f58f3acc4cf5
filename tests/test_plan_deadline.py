"""Issue 46, know before you run: the plan (and, below it, deadlines).

Plan: input tokens equal to the model's tokenizer count (the sim's word tokenizer, whose counts the sim
workers report back, and the embedded model's tokenizer against transformers'); nothing in Redis changes;
each figure says what it rests on; after a run the history recorded by the workers feeds the next plan.
Workers here are burst workers on the sim engine: tests wait on the batch's end, never on a clock."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

import lmdq
from lmdq.plan.store import PlanStore
from lmdq.plan.tokens import write_word_tokenizer
from lmdq.redis.keys import Keys
from lmdq.submission.settings import ProducerSettings
from tests.conftest import run_cli
from tests.helpers import write_jsonl

pytest.importorskip("tokenizers")

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "user:", "assistant:", "system:"]


@pytest.fixture()
def api(redis_url: str, prefix: str) -> lmdq.Client:
    return lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix))


@pytest.fixture()
def tok(tmp_path: Path) -> Path:
    return write_word_tokenizer(tmp_path / "tok", WORDS)


def _rows(n: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(n):
        words = " ".join(WORDS[(i + j) % 5] for j in range(3 + i % 7))
        if i % 3 == 0:
            rows.append({"custom_id": f"r{i}", "messages": [{"role": "system", "content": "be brief"},
                                                            {"role": "user", "content": words}]})
        else:
            rows.append({"custom_id": f"r{i}", "prompt": words, "params": {"max_new_tokens": 4 + i % 5}})
    return rows


def _snapshot(client: redis.Redis, prefix: str) -> dict[bytes, Any]:
    return {k: client.dump(k) for k in sorted(client.scan_iter(match=f"{prefix}*"))} | {
        k: client.dump(k) for k in client.scan_iter(match="rq:*")}


def _drain(redis_url: str, prefix: str) -> None:
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, health_port=0, burst=True)
    assert Worker(engine=SimEngine(model_name="sim", step_ms=0), client=redis.Redis.from_url(redis_url),
                  settings=s).run() == 0


def test_plan_counts_with_the_tokenizer_changes_nothing_and_says_it_has_no_history(
        api: lmdq.Client, client: redis.Redis, prefix: str, tmp_path: Path, tok: Path) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", _rows(40))
    before = _snapshot(client, prefix)
    p = api.plan(f, model="sim", tokenizer=tok, max_new_tokens=8, allow_unknown_model=True)
    assert _snapshot(client, prefix) == before  # plan makes no change in Redis
    assert p.requests == 40 and p.input_exact
    want = sum(len(f"system: be brief\nuser: {r['messages'][1]['content']}\nassistant:".split()) if "messages" in r
               else len(f"user: {r['prompt']}\nassistant:".split()) for r in _rows(40))
    assert p.input_tokens == want
    assert p.max_output_tokens == p.output_tokens == sum(
        r.get("params", {}).get("max_new_tokens", 8) for r in _rows(40))
    assert p.output_basis.startswith("no history for this model")
    assert p.gpu_seconds is None and "no worker has measured throughput" in p.rate_basis


def test_after_a_run_the_plan_rests_on_what_the_workers_recorded(
        api: lmdq.Client, client: redis.Redis, redis_url: str, prefix: str, tmp_path: Path, tok: Path) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", _rows(30))
    plan = api.plan(f, model="sim", tokenizer=tok, max_new_tokens=8, allow_unknown_model=True)
    batch = api.submit(f, model="sim", max_new_tokens=8, allow_unknown_model=True)
    _drain(redis_url, prefix)
    results = list(batch.results())
    assert len(results) == 30
    # the plan's count is the tokenizer's, and the sim's workers counted the same
    assert plan.input_tokens == sum(r.input_token_len or 0 for r in results)
    h = PlanStore(client, keys=Keys(prefix)).history("sim")
    assert h.requests == 30 and sum(h.cut.values()) == 30  # the sim generates exactly max_new_tokens
    assert sum(r.decode for r in h.rates) == sum(r.generate_token_len for r in results)
    again = api.plan(f, model="sim", tokenizer=tok, max_new_tokens=8, allow_unknown_model=True,
                     gpu_hour_price=2.0)
    assert "length history of 30 earlier requests of sim" in again.output_basis
    assert again.output_tokens == sum(r.generate_token_len for r in results)
    assert again.gpu_seconds is not None and again.gpu_seconds > 0 and again.cost is not None
    assert again.workers and again.workers[0]["decode_tokens"] == sum(r.generate_token_len for r in results)


def test_the_cli_prints_the_plan_as_text_and_json_and_refuses_a_bad_line(
        env: dict[str, str], tmp_path: Path, tok: Path, client: redis.Redis, prefix: str) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", _rows(5))
    out = run_cli("lmdq.producer", "plan", str(f), "--model", "sim", "--tokenizer", str(tok), "--json",
                  "--gpu-hour-price", "2.5", env=env)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["requests"] == 5 and d["gpu_hour_price"] == 2.5 and d["output_basis"].startswith("no history")
    text = run_cli("lmdq.producer", "plan", str(f), "--model", "sim", env=env)
    assert text.returncode == 0 and "input tokens" in text.stdout.decode()
    assert "estimated at 4 characters a token" in text.stdout.decode()  # no tokenizer for "sim": says so
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": ""}\n')
    refused = run_cli("lmdq.producer", "plan", str(bad), "--model", "sim", env=env)
    assert refused.returncode == 2 and f"{bad}:2" in refused.stderr.decode()
    sub = run_cli("lmdq.producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--plan",
                  "--tokenizer", str(tok), env=env)
    assert sub.returncode == 0, sub.stderr
    assert "plan for model sim: 5 requests" in sub.stderr.decode() and sub.stdout.decode().strip()


def test_the_embedded_models_tokenizer_counts_as_transformers_does(api: lmdq.Client, tmp_path: Path) -> None:
    from tests.helpers import need_default_model

    folder = need_default_model()
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(folder))
    rows = [{"prompt": "What is the capital of France?"},
            {"messages": [{"role": "system", "content": "You answer in one word."},
                          {"role": "user", "content": "Name a colour."}]}]
    f = write_jsonl(tmp_path / "in.jsonl", rows)
    p = api.plan(f, model="smollm2-135m-instruct", tokenizer=folder, allow_unknown_model=True)
    want = 0
    for r in rows:
        ids = t.apply_chat_template(r.get("messages") or [{"role": "user", "content": r["prompt"]}],
                                    add_generation_prompt=True, tokenize=True)
        want += len(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a dict
    assert p.input_exact and p.input_tokens == want
