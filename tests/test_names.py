"""Issue 29, model names: one rule, checked at ``models add``, worker start and submit; queue keys that
two names can never share; a worker that hands a job of another model to that model's queue.

Real redis-server (tests/conftest.py), real sim workers in this process (burst mode), real CLIs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from lmdq.contract import ResultStatus
from lmdq.jobs.queue import job_id_for
from lmdq.redis.keys import InvalidModelName, Keys, check_model_name, model_slug, queue_name, queue_names, rq_queue_key
from lmdq.results.store import ResultStore
from lmdq.submission.submit import SubmitOptions, submit_file
from tests.conftest import run_cli
from tests.helpers import results_of, write_jsonl

GOOD = ["sim", "HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen2.5-7B", "org/model-x", "org_model-x", "a" * 128]
BAD = ["", "llama3:8b", "m{a}", "m*", "rq:queue:lmdq:sim:normal", "通义千问", "org/my model", " x", "x\n",
       "-x", "/models/x", "a" * 129]


@pytest.mark.parametrize("name", GOOD)
def test_the_rule_keeps_names_verbatim(name: str) -> None:
    assert check_model_name(name) == name and model_slug(name) == name  # the name IS the key (KEDA lists)


@pytest.mark.parametrize("name", BAD)
def test_the_rule_refuses_in_one_line(name: str) -> None:
    with pytest.raises(InvalidModelName) as e:
        check_model_name(name)
    msg = str(e.value)
    assert "expected 1-128 of A-Z a-z 0-9 . _ / -" in msg and "\n" not in msg.replace(repr("x\n"), ""), msg


def test_queue_keys_are_injective() -> None:
    """The issue's collisions: 'org/model-x' vs 'org_model-x', and two non-ASCII names that both became
    '____' — even names that bypassed the rule (a record an older lmdq wrote) keep apart."""
    names = [*GOOD, *BAD, "文心一言", "org%2Fmodel-x", "a%3Ab", "a:b", "a_b"]
    slugs = [model_slug(n) for n in names]
    assert len(set(slugs)) == len(names), sorted(zip(slugs, names))
    assert all(":" not in s and "*" not in s for s in slugs)  # never a separator or a SCAN pattern in a key
    queues = {q for n in names for q in queue_names(n)}
    assert len(queues) == 3 * len(names)
    k = Keys("p")
    assert len({k.inflight(n) for n in names}) == len({k.wake(n) for n in names}) == len(names)


def test_submit_and_models_add_refuse_bad_names(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                                prefix: str) -> None:
    jobs_before = set(client.scan_iter("rq:job:*"))  # other tests' leftovers in the shared server are not ours
    f = write_jsonl(tmp_path / "p.jsonl", [{"custom_id": "a", "prompt": "hi"}])
    for bad in ("llama3:8b", "通义千问", "rq:queue:lmdq:sim:normal"):
        p = run_cli("lmdq.producer", "submit", str(f), "--model", bad, "--allow-unknown-model", env=env)
        err = p.stderr.decode()
        assert p.returncode == 2 and err.startswith("error: --model: model name") and err.count("\n") == 1, err
        p = run_cli("lmdq.producer", "models", "add", bad, env=env)
        assert p.returncode == 2 and "expected 1-128" in p.stderr.decode() and "Traceback" not in p.stderr.decode()
    body = write_jsonl(tmp_path / "o.jsonl", [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                               "body": {"model": "m*", "messages": [{"role": "user",
                                                                                     "content": "hi"}]}}])
    p = run_cli("lmdq.producer", "submit", str(body), "--allow-unknown-model", env=env)
    assert p.returncode == 2 and "field 'body.model': model name 'm*'" in p.stderr.decode(), p.stderr.decode()
    assert not list(client.scan_iter(f"{prefix}:*")) and set(client.scan_iter("rq:job:*")) == jobs_before


def test_worker_start_refuses_a_bad_served_name(env: dict[str, str]) -> None:
    p = run_cli("lmdq.worker", "--engine", "sim", "--served-model-name", "llama3:8b", "--burst", env=env)
    err = p.stderr.decode()
    assert p.returncode == 2 and "model name 'llama3:8b': expected 1-128" in err and "Traceback" not in err, err


def _worker(client: redis.Redis, url: str, prefix: str, model: str) -> dict[str, int]:
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    s = WorkerSettings(redis_url=url, key_prefix=prefix, burst=True, health_port=0, heartbeat_ttl_s=10,
                       idle_wait_s=0)
    w = Worker(engine=SimEngine(model_name=model, step_ms=0), client=client, settings=s)
    assert w.run() == 0
    return w.stats


def _submit(client: redis.Redis, prefix: str, path: Path, model: str, **opts: Any) -> Any:
    batch, created = submit_file(path, SubmitOptions(model=model, allow_unknown_model=True, **opts), client=client,
                                 keys=Keys(prefix), ttl_s=3600)
    assert created
    return batch


def test_names_differing_in_dropped_characters_never_share_a_queue(tmp_path: Path, redis_url: str,
                                                                   client: redis.Redis, prefix: str) -> None:
    """bd9ca4b: a batch for 'org/model-x' was answered by a worker serving 'org_model-x'."""
    f = write_jsonl(tmp_path / "p.jsonl", [{"custom_id": f"r{i}", "prompt": f"q{i}"} for i in range(8)])
    batch = _submit(client, prefix, f, "org/model-x", batch_size=4)
    other = _worker(client, redis_url, prefix, "org_model-x")  # burst: its queues are empty, it exits
    assert other["jobs"] == 0
    assert ResultStore(client, keys=Keys(prefix)).batches.get(batch.id).status.value == "queued"
    _worker(client, redis_url, prefix, "org/model-x")
    got = results_of(client, prefix, batch.id)
    assert len(got) == 8 and {r.model for r in got} == {"org/model-x"}
    assert {r.status for r in got} == {ResultStatus.completed}


def test_a_worker_moves_another_models_job_to_that_models_queue(tmp_path: Path, redis_url: str,
                                                                client: redis.Redis, prefix: str) -> None:
    """A genuine job on the wrong queue (pushed by hand, or left on a queue an older lmdq shared between
    two names) is not answered by the wrong model: it goes to its own model's queue, uncharged."""
    f = write_jsonl(tmp_path / "p.jsonl", [{"custom_id": f"r{i}", "prompt": f"q{i}"} for i in range(4)])
    batch = _submit(client, prefix, f, "model-a", batch_size=4, priority="high")
    a_high = rq_queue_key(queue_name("model-a", "high", prefix))
    b_normal = rq_queue_key(queue_name("model-b", "normal", prefix))
    client.lmove(a_high, b_normal, "LEFT", "RIGHT")
    assert client.llen(a_high) == 0
    stats = _worker(client, redis_url, prefix, "model-b")
    assert stats["jobs"] == 0 and stats["results"] == 0
    assert client.lrange(a_high, 0, -1) == [job_id_for(batch.id, 0).encode()]  # back at its own priority
    assert ResultStore(client, keys=Keys(prefix)).batches.get(batch.id).request_counts.done == 0
    assert not client.hget(Keys(prefix).attempts(), job_id_for(batch.id, 0))  # no attempt charged
    _worker(client, redis_url, prefix, "model-a")
    got = results_of(client, prefix, batch.id)
    assert {r.model for r in got} == {"model-a"} and len(got) == 4
    assert client.hget(f"rq:job:{job_id_for(batch.id, 0)}", "status") == b"finished"
