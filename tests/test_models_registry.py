"""Models known without a worker (issue #17, scale from zero): the registry operators fill, the
``lmdq-producer models`` commands, submit's model check, and the deployments registering their model.

The deployment tests run what a cluster or compose would run, taken from the rendered objects: the
registration command and its environment, a submit at zero workers, then a sim worker started from
the rendered worker environment after the submit. Each must be able to fail: the same submit before
the registration is refused.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis

from lmdq.contract import BatchStatus, ResultStatus
from lmdq.redis.keys import Keys, queue_name, rq_queue_key
from lmdq.registry.store import MAX_MODEL_NAME, MAX_NOTE, ModelRegistry, WorkerRegistry
from tests.conftest import ROOT, RedisServer, run_cli
from tests.helpers import results_of, wait_batch, write_jsonl

yaml = pytest.importorskip("yaml")

Doc = dict[str, Any]


def _registry(client: redis.Redis, prefix: str) -> ModelRegistry:
    return ModelRegistry(client, keys=Keys(prefix))


# ------------------------------------------------------------------------------- the registry


def test_registered_and_served_models_are_both_known(client: redis.Redis, prefix: str) -> None:
    reg = _registry(client, prefix)
    assert reg.known() == set() and reg.models() == []
    assert reg.add("llama-8b", note="eval fleet") is True
    assert reg.add("llama-8b", note="eval fleet, moved") is False  # idempotent: the note is replaced
    WorkerRegistry(client, keys=Keys(prefix), name="w1", model="sim", ttl_s=30).register(pid=1)
    assert reg.known() == {"llama-8b", "sim"}
    by_name = {m.name: m for m in reg.models()}
    llama, sim = by_name["llama-8b"], by_name["sim"]
    now = reg.now()
    assert llama.registered and llama.note == "eval fleet, moved" and llama.last_seen is None
    assert llama.registered_at is not None and now - 60 < llama.registered_at <= now  # the server's clock
    assert llama.live_workers == 0
    assert not sim.registered and sim.registered_at is None and sim.note is None
    assert sim.last_seen is not None and sim.live_workers == 1


def test_live_workers_are_only_those_whose_record_is_alive(client: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    for name in ("a", "b", "c"):
        WorkerRegistry(client, keys=keys, name=name, model="sim", ttl_s=30).register(pid=1)
    WorkerRegistry(client, keys=keys, name="d", model="other", ttl_s=30).register(pid=1)
    client.delete(keys.worker("b"))  # a killed worker: still in the set, its record expired
    WorkerRegistry(client, keys=keys, name="c", model="sim", ttl_s=30).deregister()
    assert {m.name: m.live_workers for m in _registry(client, prefix).models()} == {"sim": 1, "other": 1}


def test_remove_forgets_registration_and_last_seen(client: redis.Redis, prefix: str) -> None:
    reg = _registry(client, prefix)
    reg.add("gone")
    WorkerRegistry(client, keys=Keys(prefix), name="w", model="gone", ttl_s=30).register(pid=1)
    removed = reg.remove("gone")
    assert removed.registered and removed.seen and removed.live_workers == 1
    assert reg.known() == set()
    again = reg.remove("gone")
    assert not again.registered and not again.seen


def test_records_read_back_are_untrusted(client: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    client.hset(keys.registered_models(), mapping={"a": b"\xff{not json", "b": json.dumps([1]),
                                                   "c": json.dumps({"added_at": "nan", "note": 7}),
                                                   "d": json.dumps({"added_at": 5, "note": "x" * 5000})})
    client.hset(keys.models(), mapping={b"\xffe": b"yesterday", "f": "-3"})
    models = {m.name: m for m in _registry(client, prefix).models()}
    assert set(models) == {"a", "b", "c", "d", "\ufffde", "f"}
    for name in "abc":
        assert models[name].registered and models[name].registered_at is None and models[name].note is None
    assert models["d"].registered_at == 5 and models["d"].note == "x" * MAX_NOTE
    assert models["\ufffde"].last_seen is None and models["f"].last_seen is None


@pytest.mark.parametrize("bad", ["", " x", "x\n", "a\tb", "x" * (MAX_MODEL_NAME + 1)])
def test_add_refuses_names_no_submit_could_use(client: redis.Redis, prefix: str, bad: str) -> None:
    with pytest.raises(ValueError, match="expected"):
        _registry(client, prefix).add(bad)
    assert not client.exists(Keys(prefix).registered_models())


# ------------------------------------------------------------------------------- the CLI


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[bytes]:
    return run_cli("producer", *args, env=env)


def test_models_commands(env: dict[str, str], client: redis.Redis, prefix: str) -> None:
    p = _cli(env, "models", "add", "llama-8b", "mistral", "--note", "nightly evals")
    assert p.returncode == 0, p.stderr.decode()
    assert p.stdout.decode().splitlines() == ["registered: llama-8b", "registered: mistral"]
    WorkerRegistry(client, keys=Keys(prefix), name="w", model="sim", ttl_s=30).register(pid=1)

    rows = [json.loads(x) for x in _cli(env, "models", "list", "--json").stdout.splitlines()]
    assert [r["model"] for r in rows] == ["llama-8b", "mistral", "sim"]
    assert rows[0]["registered"] and rows[0]["note"] == "nightly evals" and rows[0]["live_workers"] == 0
    assert not rows[2]["registered"] and rows[2]["live_workers"] == 1 and rows[2]["last_seen"] > 0

    table = _cli({**env, "COLUMNS": "80"}, "models", "list")
    assert table.returncode == 0
    lines = table.stdout.decode().splitlines()
    assert all(len(x) <= 80 for x in lines), lines
    assert any(x.startswith("llama-8b ") and "nightly evals" in x for x in lines), lines
    sim = [x.split() for x in lines if x.startswith("sim ")]
    assert len(sim) == 1 and sim[0][:2] == ["sim", "no"] and sim[0][3:] == ["ago", "1"], lines  # never registered
    assert re.fullmatch(r"\d+s", sim[0][2]), lines  # seen seconds ago (server clock)

    p = _cli(env, "models", "remove", "sim")
    assert p.returncode == 0 and p.stdout.decode().strip() == "removed: sim (last-seen record)"
    assert "1 live worker(s) serve 'sim'" in p.stderr.decode()
    p = _cli(env, "models", "remove", "nope")
    assert p.returncode == 1 and "unknown model 'nope'" in p.stderr.decode()
    assert _registry(client, prefix).known() == {"llama-8b", "mistral"}


def test_models_list_never_cuts_a_name(env: dict[str, str], client: redis.Redis, prefix: str) -> None:
    long = "organisation-with-a-long-name/" + "a-model-name-that-does-not-fit-in-a-column-" * 2
    _registry(client, prefix).add(long, note="n")
    _registry(client, prefix).add("tagged", note="[red]data, not markup")
    # a name no longer accepted (the name rule), as an older worker may have recorded it: shown as data
    client.hset(Keys(prefix).models(), "[bold]tagged[/bold]", 1.0)
    table = _cli({**env, "COLUMNS": "400"}, "models", "list").stdout.decode()
    assert "[bold]tagged[/bold]" in table and "[red]data, not markup" in table, table
    for columns in ("80", "40"):
        out = _cli({**env, "COLUMNS": columns}, "models", "list").stdout.decode()
        assert long in out.splitlines(), out  # whole, on a line of its own when the table cannot fit


@pytest.mark.parametrize("args, says", [
    (["add", " padded"], "NAME: model name ' padded': expected 1-128 of A-Z a-z 0-9 . _ / -"),
    (["add", "llama3:8b"], "got ':'"),
    (["add", "通义千问"], "got '通'"),
    (["add", "m", "--note", "x" * (MAX_NOTE + 1)], "--note: expected at most"),
])
def test_models_add_refuses_bad_input(env: dict[str, str], client: redis.Redis, prefix: str,
                                      args: list[str], says: str) -> None:
    p = _cli(env, "models", *args)
    assert p.returncode == 2 and says in p.stderr.decode() and "Traceback" not in p.stderr.decode()
    assert _registry(client, prefix).known() == set()


# ------------------------------------------------------------------------------- submit's check


def test_submit_accepts_a_registered_model_at_zero_workers(tmp_path: Path, env: dict[str, str],
                                                           client: redis.Redis, prefix: str) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    refused = _cli(env, "submit", str(f), "--model", "org/my-model")
    assert refused.returncode == 2
    msg = refused.stderr.decode()
    assert "unknown model 'org/my-model'" in msg
    assert "lmdq-producer models add org/my-model" in msg and "--allow-unknown-model" in msg
    assert not client.exists(Keys(prefix).batches())

    assert _cli(env, "models", "add", "org/my-model").returncode == 0
    ok = _cli(env, "submit", str(f), "--model", "org/my-model", "--json")
    assert ok.returncode == 0, ok.stderr.decode()
    assert json.loads(ok.stdout)["status"] == "queued"
    assert not client.smembers(Keys(prefix).workers())

    assert _cli(env, "models", "remove", "org/my-model").returncode == 0
    assert _cli(env, "submit", str(f), "--model", "org/my-model").returncode == 2


# ------------------------------------------------------------------------------- deployments

K8S_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
TEST_PASSWORD = "change-me"  # the rendered Secret's placeholder: the test Redis takes it as is


def _k8s_expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command/args (a name not in the container's env stays as is)."""
    return K8S_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), arg)


def _local_url(rendered_url: str, srv: RedisServer) -> str:
    """The rendered Secret's redis-url with its host:port pointed at the test's server (password kept)."""
    parts = urlsplit(rendered_url)
    auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return urlunsplit(parts._replace(netloc=f"{auth}127.0.0.1:{srv.port}"))


def _container_env(container: Doc, docs: list[Doc], srv: RedisServer, fields: dict[str, str]) -> dict[str, str]:
    """A container's environment as the kubelet builds it from the rendered objects: envFrom
    ConfigMaps, then env (values, Secret and ConfigMap keys, the downward API from ``fields``)."""
    from tests.test_deploy import find

    out: dict[str, str] = {}
    for src in container.get("envFrom", []):
        out.update(find(docs, "ConfigMap", src["configMapRef"]["name"])["data"])
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = _k8s_expand(str(e["value"]), out)
            continue
        ref = e["valueFrom"]
        if "secretKeyRef" in ref:
            sref = ref["secretKeyRef"]
            secrets = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == sref["name"]]
            if not secrets or sref["key"] not in secrets[0]["stringData"]:
                assert sref.get("optional"), e  # the kubelet skips only an optional one (HF_TOKEN)
                continue
            value = secrets[0]["stringData"][sref["key"]]
            out[e["name"]] = _local_url(value, srv) if e["name"] == "LMDQ_REDIS_URL" else value
        elif "configMapKeyRef" in ref:
            key_ref = ref["configMapKeyRef"]
            out[e["name"]] = find(docs, "ConfigMap", key_ref["name"])["data"][key_ref["key"]]
        elif "fieldRef" in ref:
            out[e["name"]] = fields[ref["fieldRef"]["fieldPath"]]
    return out


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This process' environment without any LMDQ_* / REDIS_URL of its own, plus ``extra``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("LMDQ_") and k != "REDIS_URL"}
    return {**base, "PYTHONUNBUFFERED": "1", "LMDQ_LOG_FORMAT": "json", **extra}


def _console_script(name: str) -> list[str]:
    """An image's entrypoint (``lmdq-producer``, ``lmdq-worker``) as installed beside this Python."""
    script = Path(sys.executable).with_name(name)
    module = {"lmdq-producer": "lmdq.producer", "lmdq-worker": "lmdq.worker"}[name]
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, env=env, capture_output=True, timeout=120, cwd=ROOT)


@pytest.fixture()
def deploy_redis() -> Iterator[RedisServer]:
    """A Redis of its own, with the rendered Secret's password: the rendered objects use the default
    key prefix and the KEDA triggers' list names, which the shared test server's tests would share."""
    srv = RedisServer(password=TEST_PASSWORD).start()
    try:
        yield srv
    finally:
        srv.cleanup()


def _register_job(docs: list[Doc]) -> Doc:
    from tests.test_deploy import find

    job = find(docs, "Job", "lmdq-register-model")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _submit_env(srv: RedisServer, docs: list[Doc]) -> dict[str, str]:
    """A producer outside the cluster: only the Redis URL (the workers', from the Secret)."""
    from tests.test_deploy import find

    return _clean_env({"LMDQ_REDIS_URL": _local_url(find(docs, "Secret", "lmdq-redis")["stringData"]["redis-url"],
                                                    srv)})


def _keda_sees(client: redis.Redis, docs: list[Doc]) -> int:
    """What KEDA's redis scaler would read: the sum of LLEN over the rendered triggers' lists."""
    from tests.test_deploy import trigger_lists

    lists = {name for triggers in trigger_lists(docs).values() for name in triggers.values()}
    assert lists
    return sum(int(client.llen(name)) for name in lists)


@pytest.mark.parametrize("overlay", ["cu12", "cu12-burst"])
def test_keda_overlay_at_zero_replicas_accepts_a_submit(tmp_path: Path, deploy_redis: RedisServer,
                                                        procs: list[subprocess.Popen[bytes]], overlay: str) -> None:
    """Must show (issue #17): the rendered overlay's registration Job, run against a real Redis,
    makes a submit at zero workers succeed; KEDA's triggers then see the queued jobs; a sim worker
    started afterwards from the rendered worker environment completes the batch."""
    from tests.test_deploy import config, render, worker_templates

    docs = render(overlay)
    model = config(docs)["LMDQ_SERVED_MODEL_NAME"]
    client = redis.Redis.from_url(deploy_redis.url)
    f = write_jsonl(tmp_path / "p.jsonl", [{"custom_id": f"r{i}", "prompt": f"question {i}"} for i in range(20)])
    submit = [*_console_script("lmdq-producer"), "submit", str(f), "--model", model, "--batch-size", "4", "--json"]

    # Fresh deployment, no worker, nothing registered: refused, and KEDA would see nothing to scale on.
    refused = _run(submit, _submit_env(deploy_redis, docs))
    assert refused.returncode == 2 and "models add" in refused.stderr.decode()
    assert _keda_sees(client, docs) == 0

    # The Job, as the kubelet would run it.
    job = _register_job(docs)
    job_env = _container_env(job, docs, deploy_redis, fields={})
    argv = [_k8s_expand(a, job_env) for a in [*job["command"], *job.get("args", [])]]
    assert argv[0] == "lmdq-producer" and model in argv
    done = _run([*_console_script(argv[0]), *argv[1:]], _clean_env(job_env))
    assert done.returncode == 0, done.stderr.decode()

    accepted = _run(submit, _submit_env(deploy_redis, docs))
    assert accepted.returncode == 0, accepted.stderr.decode()
    batch_id = json.loads(accepted.stdout)["id"]
    keys = Keys()  # the rendered config sets no LMDQ_KEY_PREFIX
    assert not client.smembers(keys.workers()) and not client.hkeys(keys.models()), "still zero workers"
    assert _keda_sees(client, docs) == 5  # 20 requests / 4 per job: KEDA's activation (> 0) fires
    assert client.llen(rq_queue_key(queue_name(model))) == 5

    # A worker started after the submit, from the rendered pod template (the sim engine instead of
    # LMDeploy, no health port: several test runs share the machine).
    (tpl,) = worker_templates(docs)
    container = tpl["spec"]["containers"][0]
    worker_env = _container_env(container, docs, deploy_redis, fields={"metadata.name": f"{overlay}-worker-0"})
    assert worker_env["LMDQ_SERVED_MODEL_NAME"] == model
    worker_env.update({"LMDQ_ENGINE": "sim", "LMDQ_SIM_STEP_MS": "1", "LMDQ_HEALTH_PORT": "0",
                       "HF_HOME": str(tmp_path / "hf")})
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        w = subprocess.Popen([*_console_script("lmdq-worker"), *container.get("args", [])], env=_clean_env(worker_env),
                             stdout=out, stderr=out, cwd=ROOT)
    procs.append(w)
    b = wait_batch(client, "lmdq", batch_id, timeout=120)
    assert b.status is BatchStatus.completed and b.request_counts.completed == 20, log.read_text()[-3000:]
    results = results_of(client, "lmdq", batch_id)
    assert [r.custom_id for r in results] == [f"r{i}" for i in range(20)]
    assert all(r.status is ResultStatus.completed and r.model == model and r.backend == "sim" for r in results)
    if "--burst" not in container.get("args", []):
        w.send_signal(signal.SIGTERM)  # a Deployment's worker runs until told to stop
    assert w.wait(60) == 0, log.read_text()[-3000:]


# --------------------------------------------------------------------------- docker compose


def _compose_interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` (nested) and ``${VAR:?message}``, as `docker compose`
    resolves them (enough for this file; $$ escapes are not used in it)."""
    out, i = [], 0
    while (start := value.find("${", i)) >= 0:
        out.append(value[i:start])
        depth, j = 1, start + 2
        while depth:
            if value.startswith("${", j):
                depth, j = depth + 1, j + 2
                continue
            depth -= value[j] == "}"
            j += 1
        body = value[start + 2 : j - 1]
        name, op, rest = re.match(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:-|:\?)(.*))?$", body, re.S).groups()  # type: ignore[union-attr]
        if env.get(name):
            out.append(env[name])
        elif op == ":-":
            out.append(_compose_interpolate(rest, env))
        elif op == ":?":
            raise AssertionError(f"compose would stop: {name}: {rest}")
        i = j
    out.append(value[i:])
    return "".join(out)


def _compose_service(name: str, env: dict[str, str]) -> Doc:
    services: Doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    svc = services[name]

    def walk(v: Any) -> Any:
        if isinstance(v, str):
            return _compose_interpolate(v, env)
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        return v

    return dict(walk(svc))


@pytest.mark.parametrize("host_env", [{}, {"LMDQ_MODEL": "Qwen/Qwen2.5-7B-Instruct"},
                                      {"LMDQ_MODEL": "/models/x", "LMDQ_SERVED_MODEL_NAME": "x-chat"}])
def test_compose_registers_the_model_the_worker_serves(tmp_path: Path, deploy_redis: RedisServer,
                                                       host_env: dict[str, str]) -> None:
    """`register-model` registers exactly the worker's served name and the producer's default model,
    whatever the operator sets; after it a submit with no worker running is accepted."""
    host_env = {"LMDQ_REDIS_PASSWORD": TEST_PASSWORD, **host_env}
    register, worker, producer = (_compose_service(s, host_env) for s in ("register-model", "worker", "producer"))
    model = worker["environment"]["LMDQ_SERVED_MODEL_NAME"]
    assert producer["environment"]["LMDQ_MODEL"] == model
    assert register["command"][:2] == ["models", "add"] and register["command"][2] == model
    assert producer["depends_on"]["register-model"] == {"condition": "service_completed_successfully"}
    assert register["build"]["target"] == "producer" and register["restart"] == "no"

    url = _local_url(register["environment"]["LMDQ_REDIS_URL"], deploy_redis)
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    submit_env = _clean_env({**{k: str(v) for k, v in producer["environment"].items()}, "LMDQ_REDIS_URL": url})
    submit = [*_console_script("lmdq-producer"), "submit", str(f)]  # --model from the producer's LMDQ_MODEL
    assert _run(submit, submit_env).returncode == 2
    done = _run([*_console_script(register["entrypoint"][0]), *register["command"]],
                _clean_env({"LMDQ_REDIS_URL": url}))
    assert done.returncode == 0, done.stderr.decode()
    ok = _run(submit, submit_env)
    assert ok.returncode == 0, ok.stderr.decode()
    assert ModelRegistry(redis.Redis.from_url(deploy_redis.url), keys=Keys()).known() == {model}


def test_every_overlay_registers_its_model_with_the_workers_redis_and_prefix() -> None:
    """The Job reads the name from the workers' ConfigMap (no copy of it), and its Redis URL and
    every other setting (key prefix included) from the same ConfigMap and Secret key as the workers."""
    from tests.test_deploy import overlays, render, worker_templates

    for overlay in overlays():
        docs = render(overlay)
        job = _register_job(docs)
        assert "$(LMDQ_SERVED_MODEL_NAME)" in job["args"], overlay
        worker = worker_templates(docs)[0]["spec"]["containers"][0]
        assert job["envFrom"] == worker["envFrom"]
        url = {e["name"]: e for e in job["env"]}["LMDQ_REDIS_URL"]
        assert url == {e["name"]: e for e in worker["env"]}["LMDQ_REDIS_URL"]
        assert "nvidia.com/gpu" not in json.dumps(job["resources"]), "a one-shot CLI needs no GPU"
        assert job["image"].rsplit(":", 1)[0].endswith("lmdq-producer"), job["image"]


def test_worker_restart_keeps_the_registration(client: redis.Redis, prefix: str) -> None:
    """A worker deregistering (scale to zero again) never removes the operator's registration."""
    reg = _registry(client, prefix)
    reg.add("m")
    w = WorkerRegistry(client, keys=Keys(prefix), name="w", model="m", ttl_s=30)
    w.register(pid=1)
    w.beat()
    w.deregister()
    assert reg.known() == {"m"} and [m.live_workers for m in reg.models()] == [0]


@pytest.mark.parametrize("command", [(), ("add",), ("list",), ("remove",)])
def test_models_help_fits_80_columns(env: dict[str, str], command: tuple[str, ...]) -> None:
    p = run_cli("lmdq.producer", "models", *command, "--help", env={**env, "COLUMNS": "80"})
    assert p.returncode == 0, p.stderr.decode()
    text = p.stdout.decode()
    assert "…" not in text, text
    if "Commands:" in text:  # click cuts a summary that does not fit with "..."
        assert "..." not in text.split("Commands:")[1], text
    assert max(len(line) for line in text.splitlines()) <= 80, text
