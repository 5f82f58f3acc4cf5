"""The canary and the quality gates (issue 46), end to end: real redis-server, a real lmdq worker (sim
engine, in this process, burst mode: it stops when nothing is queued), no wall clock.

* a batch whose outputs fail its JSON schema pauses after the canary, with no request beyond the canary
  run, and a report naming the gate and example lines; ``resume`` completes it with exactly one result per
  request; ``cancel`` instead ends it, again one result per request;
* a good batch runs through;
* a rolling window (``gate_window``) pauses a batch that goes bad part-way.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

import lmdq
from lmdq.contract import BatchStatus, ResultStatus
from lmdq.submission.settings import ProducerSettings

N = 40
BATCH_SIZE = 2
#: the sim engine answers a json_schema request with a minimal instance, which ignores ``pattern``: every
#: output is {"id": ""}, failing this schema (as a broken template's outputs would fail a real one)
BAD_SCHEMA = {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[0-9]+$"}}, "required": ["id"]}
GOOD_SCHEMA = {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}


@pytest.fixture()
def api(redis_url: str, prefix: str) -> lmdq.Client:
    return lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix))


def drain(redis_url: str, prefix: str, **settings: Any) -> Any:
    """Run a burst worker until nothing is queued; returns its sim engine (its counters)."""
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    engine = SimEngine(model_name="sim", step_ms=0)
    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, health_port=0, burst=True, **settings)
    assert Worker(engine=engine, client=redis.Redis.from_url(redis_url), settings=s).run() == 0
    return engine


def _file(tmp_path: Path, n: int = N, bad_from: int | None = None) -> Path:
    p = tmp_path / "in.jsonl"
    lines = []
    for i in range(n):
        prompt = f"item {i}: describe it" + (" [[sim:error]]" if bad_from is not None and i >= bad_from else "")
        lines.append(json.dumps({"custom_id": f"c{i:03d}", "prompt": prompt}))
    p.write_text("\n".join(lines) + "\n")
    return p


def _one_each(batch: lmdq.Batch) -> Counter[str]:
    results = list(batch.results())
    ids = Counter(r.custom_id for r in results)
    assert sorted(ids) == [f"c{i:03d}" for i in range(N)] and set(ids.values()) == {1}
    return Counter(r.status.value for r in results)


def test_bad_schema_pauses_after_the_canary_and_resume_completes(api: lmdq.Client, redis_url: str, prefix: str,
                                                                 tmp_path: Path) -> None:
    b = api.submit(_file(tmp_path), model="sim", allow_unknown_model=True, batch_size=BATCH_SIZE,
                   json_schema=BAD_SCHEMA, max_new_tokens=8, canary="10%")
    gates = b.gates()
    assert gates is not None and gates["verdict"] is None and gates["canary_jobs_left"] == 2
    assert gates["held_jobs"] == N // BATCH_SIZE - 2
    engine = drain(redis_url, prefix)
    info = b.wait(timeout=30, progress=False)  # returns at paused
    assert info.status is BatchStatus.paused
    # no request beyond the canary ran: 2 jobs of 2, spread over the file (jobs 5 and 15)
    results = list(b.results())
    assert sorted(r.custom_id for r in results) == ["c010", "c011", "c030", "c031"]
    assert engine.prefilled_tokens == sum(r.input_token_len for r in results)  # the engine saw these 4 only
    assert info.request_counts.done == 4
    gates = b.gates()
    assert gates is not None and gates["verdict"] == "failed" and gates["held_jobs"] == N // BATCH_SIZE - 2
    report = gates["report"]
    assert report["phase"] == "canary" and report["judged"] == 4
    failed = {f["gate"]: f for f in report["failures"]}
    assert set(failed) == {"json"} and failed["json"]["observed"] == 1.0
    ex = failed["json"]["examples"][0]
    assert ex["id"] == "c010" and ex["x"] == '{"id": ""}' and "does not match" in ex["why"]
    # a second worker finds nothing to do: the rest is held
    drain(redis_url, prefix)
    assert b.status() is BatchStatus.paused and b.counts().done == 4

    b.resume()
    assert b.status() in (BatchStatus.in_progress, BatchStatus.queued)
    drain(redis_url, prefix)
    info = b.wait(timeout=30, progress=False)
    assert info.status is BatchStatus.completed
    assert _one_each(b) == {"completed": N}
    with pytest.raises(lmdq.SubmitRejected, match="not paused"):
        b.resume()


def test_good_batch_runs_through(api: lmdq.Client, redis_url: str, prefix: str, tmp_path: Path) -> None:
    b = api.submit(_file(tmp_path), model="sim", allow_unknown_model=True, batch_size=BATCH_SIZE,
                   json_schema=GOOD_SCHEMA, max_new_tokens=8, canary=4)
    drain(redis_url, prefix)
    info = b.wait(timeout=30, progress=False)
    assert info.status is BatchStatus.completed
    assert _one_each(b) == {"completed": N}
    gates = b.gates()
    assert gates is not None and gates["verdict"] == "passed" and gates["held_jobs"] == 0
    assert gates["report"] is None


def test_cancel_a_paused_batch_answers_every_request_once(api: lmdq.Client, redis_url: str, prefix: str,
                                                          tmp_path: Path) -> None:
    b = api.submit(_file(tmp_path), model="sim", allow_unknown_model=True, batch_size=BATCH_SIZE,
                   json_schema=BAD_SCHEMA, max_new_tokens=8, canary="5%")
    drain(redis_url, prefix)
    assert b.status() is BatchStatus.paused
    info = b.cancel()
    assert info.status is BatchStatus.cancelled
    assert _one_each(b) == {"completed": 2, "cancelled": N - 2}


def test_rolling_window_pauses_a_batch_that_goes_bad(api: lmdq.Client, redis_url: str, prefix: str,
                                                     tmp_path: Path) -> None:
    # the second half fails: a 4-result window with at most 25 % failed passes the first half, then pauses
    b = api.submit(_file(tmp_path, bad_from=N // 2), model="sim", allow_unknown_model=True, batch_size=BATCH_SIZE,
                   max_new_tokens=4, gate_window=4, gate=["failed=0.25", "length=1"])
    drain(redis_url, prefix, jobs_in_flight=1)  # one job at a time: judged in job order
    info = b.wait(timeout=30, progress=False)
    assert info.status is BatchStatus.paused
    gates = b.gates()
    assert gates is not None and gates["verdict"] == "paused" and gates["report"]["phase"] == "window"
    assert [f["gate"] for f in gates["report"]["failures"]] == ["failed"]
    assert gates["held_jobs"] > 0 and info.request_counts.done < N
    assert info.request_counts.completed == N // 2
    b.cancel()
    counts = _one_each(b)
    assert counts["completed"] == N // 2 and counts["failed"] + counts["cancelled"] == N // 2


def test_gate_options_are_checked(api: lmdq.Client, tmp_path: Path) -> None:
    path = _file(tmp_path)
    with pytest.raises(lmdq.SubmitRejected, match="canary"):
        api.submit(path, model="sim", allow_unknown_model=True, canary="200%")
    with pytest.raises(lmdq.SubmitRejected, match="gate"):
        api.submit(path, model="sim", allow_unknown_model=True, gate=["json=0"])
    with pytest.raises(lmdq.SubmitRejected, match="KEY=VALUE"):
        api.submit(path, model="sim", allow_unknown_model=True, canary=2, gate=["bogus=1"])
    assert ResultStatus.completed  # the module's imports are used


def test_cli_submit_status_list_resume(env: dict[str, str], redis_url: str, prefix: str, tmp_path: Path) -> None:
    """The CLI's surfaces: ``submit --canary --gate``, ``status`` (the report, and ``--json``), ``list``,
    ``results --wait`` (stops at paused, exit 1, one line), ``resume``."""
    from tests.conftest import run_cli

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(BAD_SCHEMA))
    p = run_cli("lmdq.producer", "submit", str(_file(tmp_path)), "--model", "sim", "--allow-unknown-model",
                "--batch-size", str(BATCH_SIZE), "--json-schema", str(schema), "--max-new-tokens", "8",
                "--canary", "10%", "--gate", "failed=0", "--gate", "json=0.5", "--json", env=env)
    assert p.returncode == 0, p.stderr.decode()
    bid = json.loads(p.stdout)["id"]
    drain(redis_url, prefix)
    st = run_cli("lmdq.producer", "status", bid, env=env)
    out = st.stdout.decode()
    assert st.returncode == 0 and f"{bid}  paused" in out, out + st.stderr.decode()
    assert "FAILED json: outputs not valid for their response_format: 100.0% of results (limit 50.0%)" in out
    assert "line 11 c010: '{\"id\": \"\"}'" in out and f"lmdq-producer resume {bid}" in out
    js = json.loads(run_cli("lmdq.producer", "status", bid, "--json", env=env).stdout)
    assert js["status"] == "paused" and js["gates"]["verdict"] == "failed"
    assert js["gates"]["config"] == {"canary": 0.1, "max_failed": 0.0, "max_empty": 0.1, "max_length": 0.5,
                                     "max_invalid_json": 0.5, "max_regex": 0.0}
    lst = run_cli("lmdq.producer", "list", "--json", env=env)
    assert [json.loads(x)["status"] for x in lst.stdout.decode().splitlines()] == ["paused"]
    lst = run_cli("lmdq.producer", "list", env=env)
    assert "paused" in lst.stdout.decode()
    w = run_cli("lmdq.producer", "results", bid, "--wait", env=env)
    assert w.returncode == 1 and f"batch {bid} is paused" in w.stderr.decode()
    r = run_cli("lmdq.producer", "resume", bid, env=env)
    assert r.returncode == 0 and (f"{bid}  queued" in r.stdout.decode() or f"{bid}  in_progress" in r.stdout.decode())
    again = run_cli("lmdq.producer", "resume", bid, env=env)
    assert again.returncode != 0 and "not paused" in again.stderr.decode()
    drain(redis_url, prefix)
    done = run_cli("lmdq.producer", "results", bid, "--wait", env=env)
    assert done.returncode == 0 and len(done.stdout.decode().splitlines()) == N
