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


# ---------------------------------------------------------------- deadlines

def _future(seconds: float) -> str:
    import datetime as dt

    return (dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=seconds)).isoformat(timespec="seconds")


def _simple(n: int, tag: str) -> list[dict[str, Any]]:
    return [{"custom_id": f"{tag}{i}", "prompt": f"{tag} {i}"} for i in range(n)]


def test_the_near_deadline_batch_runs_first_with_one_worker(
        api: lmdq.Client, client: redis.Redis, redis_url: str, prefix: str, tmp_path: Path) -> None:
    from lmdq.redis.keys import queue_name, rq_queue_key
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    kw: dict[str, Any] = {"model": "sim", "allow_unknown_model": True, "max_new_tokens": 3, "batch_size": 2}
    plain = api.submit(write_jsonl(tmp_path / "plain.jsonl", _simple(6, "plain")), **kw)
    far = api.submit(write_jsonl(tmp_path / "far.jsonl", _simple(6, "far")), deadline=_future(7200), **kw)
    near = api.submit(write_jsonl(tmp_path / "near.jsonl", _simple(6, "near")), deadline=_future(3600), **kw)
    assert near.info().deadline is not None and plain.info().deadline is None
    # the queue is in deadline order, a batch without one last (as FIFO among themselves)
    queue = [j.decode() for j in client.lrange(rq_queue_key(queue_name("sim", "normal", prefix)), 0, -1)]
    owners = [j.rsplit("-", 1)[0] for j in queue]
    assert owners == [near.id] * 3 + [far.id] * 3 + [plain.id] * 3
    # one worker, one request at a time: every near request ends (in the engine's own steps) before any far
    # one, every far one before any plain one
    class Recording(SimEngine):
        ended: list[tuple[int, str]] = []

        def _finish(self, s: Any, reason: Any, code: Any = None, msg: Any = None) -> None:
            self.ended.append((self.steps, str(s.req.prompt).split()[0]))
            super()._finish(s, reason, code, msg)

    engine = Recording(model_name="sim", step_ms=0, max_batch=1)
    # one job held at a time: a prefetched job's thread could otherwise reach the engine before the last
    # request of the job claimed before it (thread start order, on a loaded machine)
    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, health_port=0, burst=True, jobs_in_flight=1)
    assert Worker(engine=engine, client=redis.Redis.from_url(redis_url), settings=s, capacity=1).run() == 0
    assert [tag for _step, tag in engine.ended] == ["near"] * 6 + ["far"] * 6 + ["plain"] * 6
    steps = [step for step, _tag in engine.ended]
    assert steps == sorted(steps)
    assert all(len(list(b.results())) == 6 for b in (near, far, plain))


def test_a_deadline_moved_closer_reorders_the_queue(api: lmdq.Client, client: redis.Redis, prefix: str,
                                                   tmp_path: Path) -> None:
    from lmdq.redis.keys import queue_name, rq_queue_key

    kw: dict[str, Any] = {"model": "sim", "allow_unknown_model": True, "batch_size": 2}
    a = api.submit(write_jsonl(tmp_path / "a.jsonl", _simple(4, "a")), deadline=_future(3600), **kw)
    b = api.submit(write_jsonl(tmp_path / "b.jsonl", _simple(4, "b")), deadline=_future(7200), **kw)
    q = rq_queue_key(queue_name("sim", "normal", prefix))
    assert [j.decode().rsplit("-", 1)[0] for j in client.lrange(q, 0, -1)] == [a.id] * 2 + [b.id] * 2
    b.set_deadline(_future(600))
    assert [j.decode().rsplit("-", 1)[0] for j in client.lrange(q, 0, -1)] == [b.id] * 2 + [a.id] * 2
    with pytest.raises(lmdq.SubmitRejected, match="deadline: expected a time in the future"):
        b.set_deadline("2020-01-01T00:00Z")


def test_a_bad_deadline_is_refused_in_one_line_and_nothing_is_enqueued(
        env: dict[str, str], tmp_path: Path, client: redis.Redis, prefix: str) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", _simple(2, "x"))
    for bad, says in [("tomorrow", "expected an ISO 8601 time with its zone"),
                      ("2030-01-01T07:00", "expected a time with its zone"),
                      ("2020-01-01T07:00Z", "expected a time in the future")]:
        out = run_cli("lmdq.producer", "submit", str(f), "--model", "sim", "--allow-unknown-model",
                      "--deadline", bad, env=env)
        assert out.returncode == 2, out.stderr
        line = out.stderr.decode().strip()
        assert "--deadline" in line and says in line and "\n" not in line
    assert not list(client.scan_iter(match=f"{prefix}:batch:*"))


def test_workers_needed_rises_as_a_deadline_tightens_and_status_warns_before_the_miss(
        api: lmdq.Client, client: redis.Redis, prefix: str, tmp_path: Path, env: dict[str, str]) -> None:
    from structlog.testing import capture_logs

    from lmdq.metrics.exporter import SnapshotCollector
    from lmdq.registry.store import WorkerRegistry

    keys = Keys(prefix)
    # history: 1 busy worker-second per request (what the sim fleet measured), one live worker
    PlanStore(client, keys=keys).record("sim", "w0", lengths={(16, True): 100}, busy_s=100.0, prefill=1000,
                                        decode=1600)
    WorkerRegistry(client, keys=keys, name="w1", model="sim", ttl_s=600).register(pid=1)
    batch = api.submit(write_jsonl(tmp_path / "in.jsonl", _simple(1000, "r")), model="sim", allow_unknown_model=True,
                       deadline=_future(7200))
    collector = SnapshotCollector(client, keys)
    with capture_logs() as logs:
        assert collector.collect_once()
    snap = collector.view().snapshot
    assert snap is not None and snap.workers_needed == {"sim": 1}  # 1,000 worker-s by a deadline 2 h away
    assert not [e for e in logs if e["event"] == "batch projected to miss its deadline"]
    loose = run_cli("lmdq.producer", "status", batch.id, env=env)
    assert loose.returncode == 0 and "warning" not in loose.stderr.decode() and "deadline=" in loose.stdout.decode()

    batch.set_deadline(_future(300))  # tightened: 1,000 worker-seconds in 5 minutes
    with capture_logs() as logs:
        assert collector.collect_once()
    snap = collector.view().snapshot
    assert snap is not None and snap.workers_needed == {"sim": 4}
    (line,) = [e for e in logs if e["event"] == "batch projected to miss its deadline"]
    assert line["batch_id"] == batch.id and line["projected_finish"] > line["deadline"]
    tight = run_cli("lmdq.producer", "status", batch.id, env=env)
    err = tight.stderr.decode()
    assert tight.returncode == 0 and f"warning: batch {batch.id} is projected to finish" in err
    assert "after its deadline" in err and "1 live worker(s)" in err
    o = batch.outlook()
    assert o is not None and o.misses and o.deadline > time_now(client)  # warned before the deadline, not after


def time_now(client: redis.Redis) -> float:
    sec, usec = client.time()
    return float(sec + usec / 1e6)


def test_the_deadline_scaling_component_scales_on_workers_needed(tmp_path: Path) -> None:
    import jsonschema
    import yaml

    from tests.test_deploy import DEPLOY, config, copy_deploy, find, kustomize

    deploy = copy_deploy(tmp_path)
    overlay = deploy / "overlays" / "deadlines"
    overlay.mkdir()
    overlay.joinpath("kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "lmdq",
        "resources": ["../../base"],
        "components": ["../../components/deadline-scaling", "../../components/cuda-cu12"],
    }))
    docs = kustomize(overlay)
    so = find(docs, "ScaledObject", "lmdq-worker")
    model = config(docs)["LMDQ_SERVED_MODEL_NAME"]
    (needed,) = [t for t in so["spec"]["triggers"] if t["name"] == "needed"]
    assert needed["type"] == "prometheus"
    assert needed["metadata"]["query"] == f'max(lmdq_workers_needed{{model="{model}"}}) or vector(0)'
    assert so["spec"]["advanced"]["scalingModifiers"]["formula"] == "max(high + normal + low + inflight, needed * 8)"
    assert {t["name"] for t in so["spec"]["triggers"]} == {"high", "normal", "low", "inflight", "needed"}
    schema = json.loads((DEPLOY / "schemas" / "keda-scaledobject-v1alpha1.json").read_text())
    jsonschema.validate(so, schema)


def test_the_plan_bench_prints_the_prediction_beside_the_measured_run(redis_url: str) -> None:
    """The bench's mechanics at a small size (its 10,000-line run is evidence/plan/): the workers' count of
    input tokens is the plan's, and both GPU-second figures are there (their agreement is reported, not
    asserted: it is a timing)."""
    from lmdq_bench.plan_bench import PlanBenchConfig, run_plan_bench, table

    res = run_plan_bench(PlanBenchConfig(requests=200, history=100, workers=1, capacity=32, step_ms=1.0),
                         redis_url=redis_url, log=lambda _m: None)
    assert res["input_tokens_equal"] and res["measured"]["requests"] == 200
    assert res["plan"]["output_tokens"] == res["measured"]["output_tokens"]  # lengths from history, exact here
    assert res["plan"]["gpu_seconds"] > 0 and res["measured"]["busy_gpu_seconds"] > 0
    assert "predicted (plan)" in table(res) and "GPU-seconds error" in table(res)


def test_the_http_api_takes_a_deadline_as_an_extension_field(redis_url: str, prefix: str, client: redis.Redis,
                                                              tmp_path: Path) -> None:
    import time

    import openai
    from openai import OpenAI

    from lmdq.results.store import ResultStore
    from lmdq_bench.api_bench import ApiProcess

    key = "alice-key-plan-deadline"
    srv = ApiProcess(redis_url=redis_url, prefix=prefix, keys={"alice": key}, files_dir=tmp_path / "files",
                     log=tmp_path / "api.log", env={"LMDQ_KNOWN_MODELS": '["sim"]'}).start()
    try:
        c = OpenAI(base_url=srv.url + "/v1", api_key=key)
        line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}
        f = c.files.create(file=("in.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
        with pytest.raises(openai.BadRequestError) as bad:
            c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                             extra_body={"deadline": "2020-01-01T00:00Z"})
        assert "deadline: expected a time in the future" in str(bad.value)
        when = _future(3600)
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                             extra_body={"deadline": when})
        for _ in range(600):  # the submit runs in the background: until the lmdq batch exists
            if b.status != "validating":
                break
            time.sleep(0.05)
            b = c.batches.retrieve(b.id)
        assert b.status not in ("validating", "failed"), b
        assert (b.model_extra or {}).get("deadline") is not None
        (info,) = ResultStore(client, keys=Keys(prefix)).batches.newest(1)
        assert info.deadline == (b.model_extra or {})["deadline"]
    finally:
        srv.stop()


def test_a_batch_over_several_models_is_placed_by_its_deadline_on_each_models_queue(
        api: lmdq.Client, client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    from lmdq.redis.keys import queue_name, rq_queue_key

    def rows(tag: str) -> list[dict[str, Any]]:
        return [{"custom_id": f"{tag}{i}", "prompt": f"{tag} {i}", "model": "ma" if i % 2 else "mb"} for i in range(4)]

    kw: dict[str, Any] = {"allow_unknown_model": True, "batch_size": 1}
    plain = api.submit(write_jsonl(tmp_path / "plain.jsonl", rows("plain")), **kw)
    dl = api.submit(write_jsonl(tmp_path / "dl.jsonl", rows("dl")), deadline=_future(3600), **kw)
    for m in ("ma", "mb"):
        q = rq_queue_key(queue_name(m, "normal", prefix))
        assert [j.decode().rsplit("-", 1)[0] for j in client.lrange(q, 0, -1)] == [dl.id] * 2 + [plain.id] * 2


def test_the_recorder_counts_busy_time_with_any_job_in_the_engine(client: redis.Redis, prefix: str) -> None:
    """The worker's recorder on a hand-driven clock: busy time is the union of the jobs' time in the
    engine (overlap counted once, idle gaps not at all), flushed when the engine empties."""
    from lmdq.contract import GenerationParams, JobPayload, Request
    from lmdq.worker.plan_recorder import PlanRecorder

    t = [0.0]
    rec = PlanRecorder(PlanStore(client, keys=Keys(prefix)), worker="w", clock=lambda: t[0])
    payload = JobPayload(batch_id="batch_" + "0" * 24, job_no=0, model="m",
                         params=GenerationParams(max_new_tokens=8, n=2),
                         requests=[Request(index=0, custom_id="a", prompt="x")])
    own = Request(index=1, custom_id="b", prompt="y", params=GenerationParams(max_new_tokens=4))
    rec.enter(payload)            # t=0: one job in
    t[0] = 1.0
    rec.enter(payload)            # t=1: two
    rec.request(payload, payload.requests[0], generated=16, prefilled=5, completed=True)  # 8 x n=2: cut
    rec.request(payload, own, generated=3, prefilled=7, completed=True)                   # stopped (cap 4 x 2)
    rec.request(payload, own, generated=1, prefilled=2, completed=False)                  # failed: no length
    t[0] = 3.0
    rec.leave()                   # one still in: nothing flushed yet
    assert PlanStore(client, keys=Keys(prefix)).history("m").rates == []
    t[0] = 4.0
    rec.leave()                   # empty at t=4: busy 4 s
    t[0] = 10.0                   # idle: not busy
    h = PlanStore(client, keys=Keys(prefix)).history("m")
    (r,) = h.rates
    assert (r.busy_s, r.prefill, r.decode) == (4.0, 14, 20)
    assert h.cut == {16: 1} and h.stopped == {3: 1}
