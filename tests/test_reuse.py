"""Issue 47, never pay twice: a request whose identity has a completed answer is answered from it.

Real redis-server, real in-process workers on the sim engine (the engine's step counter says whether
anything reached it), the embedded CPU model on the transformers engine, and a SIGKILLed worker process
for exactly-once."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import redis

from lmdq.contract import BatchStatus, Result
from lmdq.redis.keys import Keys
from lmdq.results.reader import ResultReader
from lmdq.results.store import ResultStore
from lmdq.reuse.store import ReuseStore
from lmdq.testing import enqueue_requests
from lmdq.worker.engines.sim import SimEngine
from lmdq.worker.runner import Worker
from lmdq.worker.settings import WorkerSettings
from tests.helpers import wait_batch

TTL = 3600


class SimWorker:
    """A real worker on a sim engine in a thread; ``model`` is what it serves, ``weights`` its --model folder."""

    def __init__(self, url: str, prefix: str, *, weights: Path | None = None, sink: str | None = None,
                 **sim: Any) -> None:
        s = WorkerSettings(redis_url=url, key_prefix=prefix, health_port=0, partial_interval_s=3600,
                           engine="sim", served_model_name="sim", model=str(weights) if weights else None,
                           allowed_output_urls=sink or "")
        self.engine = SimEngine(model_name="sim", step_ms=sim.pop("step_ms", 0.2), max_batch=256, **sim)
        self.worker = Worker(engine=self.engine, client=redis.Redis.from_url(url), settings=s)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.worker.stop()
        self.thread.join(60)
        assert not self.thread.is_alive()


def run_batch(client: redis.Redis, url: str, prefix: str, rows: list[dict[str, Any]], *, reuse: bool = True,
              weights: Path | None = None, batch_size: int = 500, **fields: Any) -> tuple[list[Result], int]:
    """Enqueue ``rows`` (custom_ids r0..), drain them with a fresh sim worker; (results in order, engine steps)."""
    bid = enqueue_requests(client, Keys(prefix), "sim", rows, batch_size=batch_size,
                           reuse_ttl_s=TTL if reuse else None, **fields)
    w = SimWorker(url, prefix, weights=weights, sink=fields.get("results_url"))
    try:
        assert wait_batch(client, prefix, bid, timeout=600).status is BatchStatus.completed
    finally:
        w.stop()
    store = ResultStore(client, keys=Keys(prefix))
    reader = ResultReader.of(store, store.batches.get(bid))
    got = [Result.model_validate_json(raw) for _, raw in reader.records(partial=False) if raw]
    assert [r.custom_id for r in got] == [f"r{i}" for i in range(len(rows))]  # every custom_id exactly once
    return got, w.engine.steps


def rows_of(n: int, **params: Any) -> list[dict[str, Any]]:
    return [{"prompt": f"question {i}: name {i % 97} colours", "params": {"max_new_tokens": 8, **params}}
            for i in range(n)]


def test_a_greedy_batch_run_twice_is_answered_from_reuse_the_second_time(
        client: redis.Redis, redis_url: str, prefix: str) -> None:
    rows = rows_of(10_000)
    first, steps1 = run_batch(client, redis_url, prefix, rows)
    assert steps1 > 0 and all(r.reused_from is None for r in first)
    second, steps2 = run_batch(client, redis_url, prefix, rows)
    assert steps2 == 0  # nothing reached the engine
    for a, b in zip(first, second, strict=True):
        assert (b.text, b.input_token_len, b.generate_token_len, b.finish_reason) == \
            (a.text, a.input_token_len, a.generate_token_len, a.finish_reason)
        assert b.reused_from is not None
        assert (b.reused_from.batch, b.reused_from.custom_id) == (a.batch_id, a.custom_id)
        assert b.custom_id == a.custom_id and b.batch_id != a.batch_id
    stats = ReuseStore(client, keys=Keys(prefix)).counters("sim")
    assert stats["entries"] == 10_000 and stats["hits"] == 10_000


def _weights(folder: Path, data: bytes) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "sim"}')
    (folder / "model.safetensors").write_bytes(data)
    return folder


def _reused(results: list[Result]) -> int:
    return sum(r.reused_from is not None for r in results)


def test_a_changed_parameter_seed_or_weights_and_unseeded_sampling_reuse_nothing(
        client: redis.Redis, redis_url: str, prefix: str, tmp_path: Path) -> None:
    n = 10_000
    base, _ = run_batch(client, redis_url, prefix, rows_of(n))
    # one parameter changed: every request reaches the engine
    other, steps = run_batch(client, redis_url, prefix, rows_of(n, max_new_tokens=9))
    assert steps > 0 and _reused(other) == 0
    # seeded sampling is reused with the same seed only
    run_batch(client, redis_url, prefix, rows_of(n, do_sample=True, random_seed=1))
    seed2, steps = run_batch(client, redis_url, prefix, rows_of(n, do_sample=True, random_seed=2))
    assert steps > 0 and _reused(seed2) == 0
    seed1, steps = run_batch(client, redis_url, prefix, rows_of(n, do_sample=True, random_seed=1))
    assert steps == 0 and _reused(seed1) == n
    # unseeded sampling: never recorded, never reused
    entries = ReuseStore(client, keys=Keys(prefix)).counters("sim")["entries"]
    for _ in range(2):
        unseeded, steps = run_batch(client, redis_url, prefix, rows_of(n, do_sample=True))
        assert steps > 0 and _reused(unseeded) == 0
    assert ReuseStore(client, keys=Keys(prefix)).counters("sim")["entries"] == entries
    # other weights under the same name: nothing; the first weights again: everything
    a = _weights(tmp_path / "a", b"\x00" * 4096)
    b = _weights(tmp_path / "b", b"\x00" * 2048 + b"\x01" + b"\x00" * 2047)  # same names and sizes
    run_batch(client, redis_url, prefix, rows_of(n), weights=a)
    on_b, steps = run_batch(client, redis_url, prefix, rows_of(n), weights=b)
    assert steps > 0 and _reused(on_b) == 0
    on_a, steps = run_batch(client, redis_url, prefix, rows_of(n), weights=a)
    assert steps == 0 and _reused(on_a) == n
    # and a batch that does not ask for reuse runs everything, though its answers are indexed
    off, steps = run_batch(client, redis_url, prefix, rows_of(n), reuse=False)
    assert steps > 0 and _reused(off) == 0
    assert [r.text for r in off] == [r.text for r in base]


def test_sink_batches_index_pointers_into_their_shards(client: redis.Redis, redis_url: str, prefix: str,
                                                       tmp_path: Path) -> None:
    url = (tmp_path / "sink").as_uri()
    first, _ = run_batch(client, redis_url, prefix, rows_of(2_000), results_url=url)
    store = ReuseStore(client, keys=Keys(prefix))
    assert store.counters("sim")["entries"] == 2_000
    assert client.exists(Keys(prefix).reuse_bucket("sim", "c", 0)) == 0  # pointers only: no copies
    second, steps = run_batch(client, redis_url, prefix, rows_of(2_000), results_url=url)
    assert steps == 0 and [r.text for r in second] == [r.text for r in first] and _reused(second) == 2_000
    # the pointers outlive the first batch's Redis records (sealed into the shard) and its record itself
    client.delete(Keys(prefix).batch(first[0].batch_id))
    third, steps = run_batch(client, redis_url, prefix, rows_of(2_000))
    assert steps == 0 and _reused(third) == 2_000
    assert {r.reused_from.batch for r in third if r.reused_from} == {first[0].batch_id}


def test_one_stored_answer_serves_the_same_prompt_twice_in_a_job(client: redis.Redis, redis_url: str, prefix: str,
                                                                  tmp_path: Path) -> None:
    """The reused path fills each hit in place (no copy per result); a prompt that appears twice in one job
    is one stored answer for two requests: each keeps its own custom_id, index and batch."""
    url = (tmp_path / "sink").as_uri()
    rows = [{"prompt": f"q {i % 50}", "params": {"max_new_tokens": 8}} for i in range(200)]  # each prompt 4x
    first, _ = run_batch(client, redis_url, prefix, rows, results_url=url, batch_size=100)
    second, steps = run_batch(client, redis_url, prefix, rows, results_url=url, batch_size=100)
    assert steps == 0 and _reused(second) == 200
    assert [r.index for r in second] == list(range(200))
    assert {r.batch_id for r in second} == {second[0].batch_id} != {first[0].batch_id}
    assert [r.text for r in second] == [r.text for r in first]
    assert all(r.reused_from is not None and r.reused_from.batch == first[0].batch_id for r in second)


def test_worker_sigkill_in_a_half_reused_batch_answers_every_custom_id_once(
        client: redis.Redis, redis_url: str, prefix: str, env: dict[str, str], tmp_path: Path) -> None:
    import os
    import signal
    import time

    from tests.conftest import start_worker
    from tests.faultkit import SIM, assert_exactly_once

    old = [{"prompt": f"old {i}", "params": {"max_new_tokens": 40}} for i in range(1_000)]
    run_batch(client, redis_url, prefix, old)
    # every job half reusable, half new
    rows = [old[i // 2] if i % 2 == 0 else {"prompt": f"new {i}", "params": {"max_new_tokens": 40}}
            for i in range(2_000)]
    bid = enqueue_requests(client, Keys(prefix), "sim", rows, batch_size=100, reuse_ttl_s=TTL)
    store = ResultStore(client, keys=Keys(prefix))
    # a short lease: the killed worker's jobs go back to the queue seconds after its last heartbeat
    proc = start_worker(*SIM, "--sim-step-ms", "20", env={**env, "LMDQ_HEARTBEAT_TTL": "3"}, log=tmp_path / "w1.log")
    try:
        deadline = time.monotonic() + 120
        while store.batches.get(bid).request_counts.done < 100:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert store.batches.get(bid).request_counts.done < 2_000  # killed half-way
    # its leases lapse (heartbeat TTL), then a fresh worker finishes the batch
    w = SimWorker(redis_url, prefix, step_ms=0.2)
    try:
        assert wait_batch(client, prefix, bid, timeout=300).status is BatchStatus.completed
    finally:
        w.stop()
    res = sorted(assert_exactly_once(client, prefix, bid, [f"r{i}" for i in range(2_000)]), key=lambda r: r.index)
    assert all((r.reused_from is not None) == (r.index % 2 == 0) for r in res)


def test_the_embedded_cpu_model_reuses_a_greedy_rerun_but_not_a_one_character_change(
        client: redis.Redis, redis_url: str, prefix: str, tf_engine: Any) -> None:
    from lmdq.worker.default_model import DEFAULT_MODEL_NAME

    store = ResultStore(client, keys=Keys(prefix))

    def run(prompts: list[str]) -> list[Result]:
        rows = [{"prompt": p, "params": {"max_new_tokens": 6}} for p in prompts]
        bid = enqueue_requests(client, Keys(prefix), DEFAULT_MODEL_NAME, rows, batch_size=2, reuse_ttl_s=TTL)
        assert wait_batch(client, prefix, bid, timeout=120).status is BatchStatus.completed
        got = [Result.model_validate_json(raw)
               for _, raw in ResultReader.of(store, store.batches.get(bid)).records(partial=False) if raw]
        assert [r.status.value for r in got] == ["completed"] * len(prompts)
        return got

    # one worker for the three batches (a worker closes its engine when it stops)
    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, health_port=0, partial_interval_s=3600,
                       engine="transformers")
    w = Worker(engine=tf_engine, client=client, settings=s)
    th = threading.Thread(target=w.run, daemon=True)
    th.start()
    try:
        prompts = ["What is the capital of France?", "Name a colour.", "Count to three.", "Say hello."]
        first = run(prompts)
        assert _reused(first) == 0
        again = run(prompts)
        assert _reused(again) == len(prompts)
        assert [(r.text, r.generate_token_len, r.input_token_len) for r in again] == \
            [(r.text, r.generate_token_len, r.input_token_len) for r in first]
        changed = run(["What is the capital of France!", *prompts[1:]])  # one character differs
        assert changed[0].reused_from is None and _reused(changed[1:]) == 3
    finally:
        w.stop()
        th.join(60)


def test_the_cli_submits_with_reuse_and_shows_and_purges_the_index(
        client: redis.Redis, redis_url: str, prefix: str, env: dict[str, str], tmp_path: Path) -> None:
    import json

    import lmdq
    from lmdq.submission.settings import ProducerSettings
    from tests.conftest import run_cli
    from tests.faultkit import submit
    from tests.helpers import write_jsonl

    f = write_jsonl(tmp_path / "p.jsonl", [{"custom_id": f"c{i}", "prompt": f"p {i}"} for i in range(200)])
    w = SimWorker(redis_url, prefix)
    try:
        ids = []
        for _ in range(2):
            b = submit(f, env, "--reuse", "--reuse-ttl", "2d", "--max-new-tokens", "4")
            assert b["reuse_ttl_s"] == 2 * 86400
            assert wait_batch(client, prefix, b["id"]).status is BatchStatus.completed
            ids.append(b["id"])
        # before anything runs: plan and the submitted batch's status count what the index answers
        p = run_cli("producer", "plan", str(f), "--model", "sim", "--reuse", "--max-new-tokens", "4", "--json",
                    env=env)
        assert p.returncode == 0, p.stderr.decode()
        assert json.loads(p.stdout)["reused_requests"] == 200
        for bid, n in zip(ids, (0, 200), strict=True):  # as counted when each was submitted
            p = run_cli("producer", "status", bid, env=env)
            assert f" reusable={n}".encode() in p.stdout, p.stdout
        off = submit(f, env, "--max-new-tokens", "4")  # reuse is off by default
        assert "reuse_ttl_s" not in off or off["reuse_ttl_s"] is None
        wait_batch(client, prefix, off["id"])
    finally:
        w.stop()
    store = ResultStore(client, keys=Keys(prefix))
    second = [Result.model_validate_json(raw)
              for _, raw in ResultReader.of(store, store.batches.get(ids[1])).records(partial=False) if raw]
    assert {r.reused_from.batch for r in second if r.reused_from} == {ids[0]} and _reused(second) == 200
    p = run_cli("producer", "reuse", "stats", "--json", env=env)
    assert p.returncode == 0, p.stderr.decode()
    st = json.loads(p.stdout)
    assert (st["model"], st["entries"], st["lookups"], st["hits"]) == ("sim", 200, 400, 200)
    assert st["hit_rate"] == 0.5 and st["bytes"] > 0
    py = lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix))
    assert [s.entries for s in py.reuse_stats()] == [200]
    p = run_cli("producer", "reuse", "purge", "--model", "sim", env=env)
    assert p.returncode == 0 and b"200 entries" in p.stdout
    assert py.reuse_stats("sim")[0].entries == 0


def test_a_retried_reuse_batch_keeps_its_reuse_ttl(client: redis.Redis, redis_url: str, prefix: str) -> None:
    """``lmdq-producer retry`` / ``client.retry``: the new batch answers from, and records into, the index."""
    from lmdq.submission.ledger import BatchLedger
    from lmdq.submission.retry import retry_batch

    keys = Keys(prefix)
    rows = rows_of(40)
    bid = enqueue_requests(client, keys, "sim", rows, batch_size=10, reuse_ttl_s=1234)
    BatchLedger(client, keys=keys, ttl_s=TTL).cancel(bid)  # nothing ran: every request is cancelled
    retried, created = retry_batch(client, keys, bid, ttl_s=TTL, include_cancelled=True)
    assert created and retried.reuse_ttl_s == 1234
    w = SimWorker(redis_url, prefix)
    try:
        assert wait_batch(client, prefix, retried.id, timeout=600).status is BatchStatus.completed
    finally:
        w.stop()
    assert w.engine.steps > 0
    assert ReuseStore(client, keys=keys).counters("sim")["entries"] == 40  # its answers were recorded
    second, steps = run_batch(client, redis_url, prefix, rows_of(40))
    assert steps == 0 and _reused(second) == 40
