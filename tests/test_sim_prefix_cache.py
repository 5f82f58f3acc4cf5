"""The sim engine's prefix cache, and what prefix-aware jobs buy with it, through the real CLIs.

Counters, not clocks: the sim counts the prompt tokens it prefilled (deterministic for an admission
order) and logs them when it closes; the test compares a grouped and an ungrouped run of one file.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import redis

from lmdq.contract import Endpoint, GenerationParams, Result
from lmdq.worker.engines.base import EngineRequest
from lmdq.worker.engines.sim import SimEngine
from tests.conftest import run_cli, start_worker
from tests.helpers import wait_batch, write_jsonl
from tests.test_prefix_groups import doc_qa_rows


def _req(i: int, prompt: str) -> EngineRequest:
    return EngineRequest(index=i, prompt=prompt, endpoint=Endpoint.completion,
                         params=GenerationParams(max_new_tokens=1))


def test_lru_counts_cached_and_prefilled_blocks() -> None:
    e = SimEngine(step_ms=0, prefix_cache_tokens=64, prefix_block=8)
    try:
        doc = " ".join(f"w{i}" for i in range(40))  # 5 blocks
        list(e.stream([_req(0, doc + " a"), _req(1, doc + " b")], threading.Event()))
        assert e.stats()["prefilled_tokens"] == 41 + 1 and e.stats()["cached_tokens"] == 40
        other = " ".join(f"x{i}" for i in range(64))  # 8 blocks: fills the cache, evicts the doc
        list(e.stream([_req(0, other)], threading.Event()))
        list(e.stream([_req(0, doc + " c")], threading.Event()))
        assert e.stats() | {"steps": 0} == {"prefilled_tokens": 42 + 64 + 41, "cached_tokens": 40, "steps": 0}
    finally:
        e.close()


def test_without_a_cache_every_token_is_prefilled() -> None:
    e = SimEngine(step_ms=0)
    try:
        list(e.stream([_req(0, "a b c d"), _req(1, "a b c d")], threading.Event()))
        assert e.stats()["prefilled_tokens"] == 8 and e.stats()["cached_tokens"] == 0
    finally:
        e.close()


def _run(f: Path, env: dict[str, str], client: redis.Redis, prefix: str, log: Path, *extra: str
         ) -> tuple[dict, list[Result]]:
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--json",
                "--batch-size", "16", "--max-new-tokens", "4", *extra, env=env)
    assert p.returncode == 0, p.stderr.decode()
    batch = json.loads(p.stdout)
    # the KV cache holds ~2 of the 20 documents (each ~400 tokens)
    w = start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "1", "--burst",
                     "--sim-prefix-cache-tokens", "800", env=env, log=log)
    assert w.wait(120) == 0, log.read_text()[-2000:]
    assert wait_batch(client, prefix, batch["id"]).request_counts.completed == 160
    closed = [json.loads(ln) for ln in log.read_text().splitlines() if "sim engine closed" in ln]
    assert len(closed) == 1, log.read_text()[-2000:]
    out = run_cli("producer", "results", batch["id"], env=env)
    assert out.returncode == 0
    return closed[0], [Result.model_validate_json(x) for x in out.stdout.splitlines()]


def test_grouped_jobs_prefill_far_fewer_tokens(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                               prefix: str) -> None:
    rows = doc_qa_rows(docs=20, questions=8, doc_words=400, seed=7)
    f = write_jsonl(tmp_path / "qa.jsonl", rows)
    plain, plain_results = _run(f, env, client, prefix, tmp_path / "plain.log", "--no-prefix-groups")
    grouped, grouped_results = _run(f, env, client, prefix, tmp_path / "grouped.log")
    total = plain["prefilled_tokens"] + plain["cached_tokens"]
    assert grouped["prefilled_tokens"] + grouped["cached_tokens"] == total  # the same prompts either way
    print(f"prefilled tokens: grouped {grouped['prefilled_tokens']}, input order {plain['prefilled_tokens']}")
    assert grouped["prefilled_tokens"] <= plain["prefilled_tokens"] / 3, (grouped, plain)
    # results (and the export) in input order with their custom_ids, grouped or not
    for results in (plain_results, grouped_results):
        assert [r.custom_id for r in results] == [row["custom_id"] for row in rows]
        assert [r.index for r in results] == list(range(len(rows)))
    assert [r.text for r in grouped_results] == [r.text for r in plain_results]


def test_retry_of_a_grouped_batch_resubmits_exactly_its_failures(tmp_path: Path, env: dict[str, str],
                                                                 client: redis.Redis, prefix: str) -> None:
    """A grouped batch's failed requests are found in whatever job holds them (not index // batch_size)."""
    rows = doc_qa_rows(docs=6, questions=5, doc_words=200, seed=11)
    bad = {3, 17, 22}
    for i in bad:
        rows[i]["messages"][0]["content"] += " [[sim:error]]"
    f = write_jsonl(tmp_path / "qa.jsonl", rows)
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--json",
                "--batch-size", "7", "--max-new-tokens", "2", env=env)
    batch = json.loads(p.stdout)
    assert batch["prefix_groups"] is True
    assert start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "1", "--burst",
                        env=env).wait(120) == 0
    assert wait_batch(client, prefix, batch["id"]).request_counts.failed == 3
    r = run_cli("producer", "retry", batch["id"], "--json", env=env)
    assert r.returncode == 0, r.stderr.decode()
    new = json.loads(r.stdout)
    assert new["request_counts"]["total"] == 3
    assert start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "1", "--burst",
                        env=env).wait(120) == 0
    assert wait_batch(client, prefix, new["id"]).request_counts.failed == 3
    out = run_cli("producer", "results", new["id"], env=env)
    got = [Result.model_validate_json(x) for x in out.stdout.splitlines()]
    assert sorted(x.custom_id for x in got) == sorted(rows[i]["custom_id"] for i in bad)
