"""`docker compose --profile cpu up` for real: the README's command on the real docker-compose.yml
(+ the suite's override: host networking, local base images), then a batch end to end, a drain by
`docker compose stop`, a SIGKILLed worker brought back by its restart policy, and the exporter.

The tests run in file order and share one stack (module fixture): each leaves it as the next expects
(all services up). Waits poll a condition (container health, batch counts in Redis) with a generous
deadline as a backstop: none asserts on how long something took, except the drain, which must end
inside compose's own stop_grace_period (that is the property under test).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import redis
import yaml

from lmdq.results.store import ResultStore
from tests.containers import harness as h
from tests.containers.stack import Stack, http_get, parse_json_lines, seconds, wait_for

pytestmark = pytest.mark.containers

UID = 10001
EXAMPLES = h.ROOT / "examples" / "prompts.jsonl"
SERVED = "HuggingFaceTB/SmolLM2-135M-Instruct"  # docker-compose.yml's default served model name
#: services `docker compose --profile cpu up` starts (register-model runs once and exits 0)
CPU_SERVICES = {"redis", "register-model", "worker-cpu", "exporter"}
HEALTHY_WITHIN_S = 600  # backstop only: model load on a loaded 2-core machine


@pytest.fixture(scope="module")
def stack(engine: h.Engine, images: dict[str, str], base_images: dict[str, str], steps: h.StepLog,
          build_log: IO[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(engine, tmp_path_factory.mktemp("compose"), base_images["redis"], build_log)
    steps.line(f"[containers] compose project {s.project}: override {s.override}")
    try:
        with steps.step("docker compose --profile cpu up -d --no-build"):
            s.compose("--profile", "cpu", "up", "-d", "--no-build", timeout=900)
        yield s
    finally:
        with steps.step("docker compose down --volumes"):
            s.down()


def store_of(s: Stack) -> ResultStore:
    return ResultStore(redis.Redis.from_url(s.redis_url))


def counts(s: Stack, batch_id: str) -> Any:
    return store_of(s).batches.get(batch_id).request_counts


def out_dir(tmp_path: Path) -> Path:
    """A host folder the producer container (uid 10001) may write: as a user would chown it."""
    d = tmp_path / "out"
    d.mkdir()
    os.chown(d, UID, UID)
    return d


def producer(s: Stack, out: Path, *args: str, timeout: float = 900) -> str:
    return s.compose("run", "--rm", "--no-deps", "-v", f"{out}:/out", "producer", *args, timeout=timeout).stdout


def submit(s: Stack, out: Path, path: str, *extra: str) -> str:
    line = producer(s, out, "submit", path, "--json", *extra).strip().splitlines()[-1]
    batch_id = str(json.loads(line)["id"])
    assert batch_id
    return batch_id


def write_prompts(folder: Path, name: str, n: int, max_new_tokens: int) -> Path:
    """n distinct prompts (the examples' questions, numbered): a batch long enough to stop mid-way."""
    base = [json.loads(x) for x in EXAMPLES.read_text().splitlines() if x.strip()]
    rows = []
    for i in range(n):
        src = base[i % len(base)]
        row = {k: v for k, v in src.items() if k in ("prompt", "messages")}
        row["custom_id"] = f"{name}-{i:04d}"
        row["params"] = {"max_new_tokens": max_new_tokens}
        rows.append(row)
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path.chmod(0o644)
    return path


def results_exactly_once(s: Stack, out: Path, batch_id: str, expected_ids: list[str]) -> list[dict[str, Any]]:
    name = f"{batch_id}.jsonl"
    producer(s, out, "results", batch_id, "--wait", "--timeout", "1200", "-o", f"/out/{name}", timeout=1300)
    lines = parse_json_lines((out / name).read_text())
    ids = [r["custom_id"] for r in lines]
    assert sorted(ids) == sorted(expected_ids), "every request has exactly one result"
    assert len(set(ids)) == len(ids)
    bad = [r for r in lines if r["status"] != "completed"]
    assert not bad, bad[:3]
    c = counts(s, batch_id)
    assert (c.total, c.completed, c.failed) == (len(expected_ids), len(expected_ids), 0), c
    return lines


# ------------------------------------------------------------------------------------ up, healthy


def ready_body(s: Stack) -> str | None:
    try:
        status, body = http_get(f"http://127.0.0.1:{s.health_port}/readyz")
    except OSError:  # 503 while loading (HTTPError), or not listening yet
        return None
    return body if status == 200 else None


def test_cpu_profile_starts_the_gpu_profiles_services_and_every_healthcheck_turns_healthy(
        stack: Stack, steps: h.StepLog) -> None:
    t0 = time.monotonic()
    real = yaml.safe_load((h.ROOT / "docker-compose.yml").read_text())["services"]
    started = set(stack.compose("--profile", "cpu", "ps", "--all", "--services").stdout.split())
    assert started == CPU_SERVICES, started
    gpu_twin = {n for n, svc in real.items() if not svc.get("profiles") or "gpu" in svc["profiles"]}
    assert {n.replace("worker-cpu", "worker") for n in started} == gpu_twin, "same services as the gpu profile"

    def all_healthy() -> bool:
        return all(stack.health(svc) == "healthy" for svc in ("redis", "worker-cpu", "exporter"))

    wait_for("redis, worker-cpu and exporter healthy", all_healthy, HEALTHY_WITHIN_S, interval=2,
             on_timeout=lambda: "\n".join(f"{svc}: {stack.health(svc)}\n{stack.logs(svc)}"
                                          for svc in ("redis", "worker-cpu", "exporter")))
    steps.record("healthchecks: redis, worker-cpu, exporter healthy", "ok", time.monotonic() - t0)
    reg = stack.state("register-model")
    assert reg["Status"] == "exited" and reg["ExitCode"] == 0, reg
    # each container runs as the images' non-root user, Redis with the AOF the compose file asks for
    for svc in ("worker-cpu", "exporter"):
        assert stack.compose("exec", "-T", svc, "id", "-u").stdout.strip() == str(UID)
    r = redis.Redis.from_url(stack.redis_url)
    assert r.config_get("appendonly")["appendonly"] == "yes"
    assert r.config_get("appendfsync")["appendfsync"] == "everysec"
    assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    ls = stack.compose("exec", "-T", "redis", "ls", "/data/appendonlydir").stdout
    assert ".aof" in ls, ls
    # the worker turns ready on its own port (host networking) once its engine is loaded: healthy
    # (/healthz, the liveness the HEALTHCHECK probes) comes first, while the model still loads
    ready = wait_for("worker-cpu /readyz", lambda: ready_body(stack), HEALTHY_WITHIN_S, interval=1)
    assert json.loads(ready)["status"] == "ready", ready


# ------------------------------------------------------------------------------------ the demo batch


def test_producer_container_submits_the_examples_and_reads_back_every_answer(
        stack: Stack, tmp_path: Path, steps: h.StepLog) -> None:
    out = out_dir(tmp_path)
    t0 = time.monotonic()
    batch_id = submit(stack, out, "/data/prompts.jsonl")  # ./examples is mounted at /data
    ids = [json.loads(x)["custom_id"] for x in EXAMPLES.read_text().splitlines() if x.strip()]
    lines = results_exactly_once(stack, out, batch_id, ids)
    steps.record(f"demo batch: {len(lines)} results of examples/prompts.jsonl", "ok", time.monotonic() - t0)
    by_id = {r["custom_id"]: r for r in lines}
    assert "Paris" in by_id["capital-france"]["text"], by_id["capital-france"]
    assert all(r["text"].strip() for r in lines)
    assert {r["model"] for r in lines} == {SERVED}
    # written by the producer container's user into the mounted folder
    produced = out / f"{batch_id}.jsonl"
    assert produced.stat().st_uid == UID and produced.stat().st_gid == UID
    steps.line("[containers]   capital-france: " + json.dumps(by_id["capital-france"]["text"][:70]))


# ------------------------------------------------------------------------------------ drain


def test_compose_stop_drains_the_worker_mid_batch_within_the_grace_period(
        stack: Stack, tmp_path: Path, steps: h.StepLog) -> None:
    out = out_dir(tmp_path)
    prompts = write_prompts(out, "drain", 48, 48)
    shutil.chown(prompts, UID, UID)
    batch_id = submit(stack, out, f"/out/{prompts.name}", "--batch-size", "2")
    ids = [json.loads(x)["custom_id"] for x in prompts.read_text().splitlines()]
    wait_for("the first results of the drain batch", lambda: counts(stack, batch_id).completed >= 1, 900)
    before = counts(stack, batch_id)
    assert before.done < before.total, f"the batch ended before the stop: make it longer ({before})"
    grace = seconds(yaml.safe_load((h.ROOT / "docker-compose.yml").read_text())["services"]["worker-cpu"]
                    ["stop_grace_period"])
    t0 = time.monotonic()
    stack.compose("stop", "worker-cpu", timeout=grace + 60)
    took = time.monotonic() - t0
    st = stack.state("worker-cpu")
    after = counts(stack, batch_id)
    steps.record(f"compose stop worker-cpu mid-batch: exit {st['ExitCode']}, {before.done}->{after.done}"
                 f"/{after.total} done, failed {after.failed}", "ok", took)
    assert st["Status"] == "exited" and st["ExitCode"] == 0 and not st["OOMKilled"], (st, stack.logs("worker-cpu"))
    assert took < grace, f"stop took {took:.0f} s, beyond stop_grace_period {grace:.0f} s (SIGKILL)"
    assert after.failed == 0, after
    logs = stack.logs("worker-cpu", tail=400)
    assert "signal: draining" in logs, logs[-3000:]  # SIGTERM reached lmdq-worker (PID 1) and it drained
    # started again, it picks up what the drain handed back: every request once
    stack.compose("--profile", "cpu", "start", "worker-cpu")
    results_exactly_once(stack, out, batch_id, ids)


# ------------------------------------------------------------------------------------ SIGKILL + restart


def test_sigkilled_worker_is_restarted_by_compose_and_the_batch_completes_exactly_once(
        stack: Stack, tmp_path: Path, steps: h.StepLog) -> None:
    out = out_dir(tmp_path)
    prompts = write_prompts(out, "kill", 48, 48)
    shutil.chown(prompts, UID, UID)
    wait_for("worker-cpu healthy again", lambda: stack.health("worker-cpu") == "healthy", HEALTHY_WITHIN_S, 2)
    batch_id = submit(stack, out, f"/out/{prompts.name}", "--batch-size", "2")
    ids = [json.loads(x)["custom_id"] for x in prompts.read_text().splitlines()]
    wait_for("the first results of the kill batch", lambda: counts(stack, batch_id).completed >= 1, 900)
    before = counts(stack, batch_id)
    assert before.done < before.total, f"the batch ended before the kill: make it longer ({before})"
    cid = stack.container("worker-cpu")
    st0 = stack.engine.inspect(cid)
    restarts0, pid0 = int(st0["RestartCount"]), int(st0["State"]["Pid"])
    # SIGKILL to the container's main process (lmdq-worker, PID 1 inside), from the host, as the
    # kernel's OOM killer or a crash would end it. Not `docker kill -s KILL`: Docker counts that as
    # a manual stop and never restarts the container, whatever its policy (checked with dockerd
    # 20.10: evidence/containers/docker_kill_vs_restart_policy.txt).
    t0 = time.monotonic()
    os.kill(pid0, signal.SIGKILL)
    restarted = wait_for("compose's restart policy to start worker-cpu again",
                         lambda: (s := stack.engine.inspect(cid))["RestartCount"] > restarts0 and
                         s["State"]["Running"] and s, 120, on_timeout=lambda: json.dumps(stack.state("worker-cpu")))
    steps.record(f"SIGKILL worker-cpu's main process: restart count {restarts0}->{restarted['RestartCount']}",
                 "ok", time.monotonic() - t0)
    assert int(restarted["State"]["Pid"]) != pid0
    wait_for("worker-cpu healthy after the restart", lambda: stack.health("worker-cpu") == "healthy",
             HEALTHY_WITHIN_S, 2)
    t1 = time.monotonic()
    results_exactly_once(stack, out, batch_id, ids)
    after = counts(stack, batch_id)
    steps.record(f"kill batch completed after the restart: {after.completed}/{after.total}, failed {after.failed}",
                 "ok", time.monotonic() - t1)


# ------------------------------------------------------------------------------------ exporter


def test_exporter_metrics_answer_from_its_container(stack: Stack, steps: h.StepLog) -> None:
    code = (f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{stack.exporter_port}/metrics',"
            " timeout=10).read().decode())")
    inside = stack.compose("exec", "-T", "exporter", "python", "-c", code).stdout
    status, outside = http_get(f"http://127.0.0.1:{stack.exporter_port}/metrics")
    assert status == 200
    for text in (inside, outside):
        assert "lmdq_exporter_redis_up 1.0" in text, text[:2000]
        assert "lmdq_queue_depth" in text and "lmdq_workers" in text and "lmdq_batches" in text
    workers = [ln for ln in outside.splitlines() if ln.startswith("lmdq_workers{")]
    assert workers and any(float(ln.rsplit(" ", 1)[1]) >= 1 for ln in workers), workers
    steps.record("exporter /metrics from its container (lmdq_exporter_redis_up 1)", "ok")
