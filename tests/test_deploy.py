"""The Kubernetes manifests as a cluster would receive them: every overlay rendered with
`kubectl kustomize`, parsed, and its exact fields checked against what lmdq needs (issue #19).

Why rendered and not the raw files: the served model name reaches the KEDA triggers through kustomize
`replacements`, and components patch resources, ephemeral storage and node selection; only the
rendered output says what a pod gets. Skips without kubectl (.ci/static-checks.sh needs it anyway).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from lmdq.contract import Priority
from lmdq.redis.keys import Keys, model_slug, queue_name, rq_queue_key

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
GPU = "nvidia.com/gpu"
GFD_LABEL = "nvidia.com/gpu.present"
PLACEHOLDER = "SERVED-MODEL-NAME"
# SIGKILL must not land in the middle of the shutdown path's slowest case
GRACE_MARGIN_S = 15.0

Doc = dict[str, Any]


def kustomize(path: Path) -> list[Doc]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not on PATH")
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@cache
def render(overlay: str) -> list[Doc]:
    return kustomize(DEPLOY / "overlays" / overlay)


def overlays() -> list[str]:
    return sorted(p.name for p in (DEPLOY / "overlays").iterdir() if p.is_dir())


def find(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def worker_templates(docs: list[Doc]) -> list[Doc]:
    """The pod templates of the Deployment and/or the burst ScaledJob (metadata + spec)."""
    out = []
    for d in docs:
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "lmdq-worker":
            out.append(d["spec"]["template"])
        elif d["kind"] == "ScaledJob":
            out.append(d["spec"]["jobTargetRef"]["template"])
    assert out, "no worker pod in the rendered overlay"
    return out


def config(docs: list[Doc]) -> dict[str, str]:
    data: dict[str, str] = find(docs, "ConfigMap", "lmdq-config")["data"]
    return data


def quantity(q: str | int) -> int:
    """Kubernetes binary quantities as used here ('200Gi', '512Mi') -> bytes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    s = str(q)
    for suffix, factor in units.items():
        if s.endswith(suffix):
            return int(s[: -len(suffix)]) * factor
    return int(s)


def copy_deploy(tmp_path: Path) -> Path:
    dst = tmp_path / "deploy"
    shutil.copytree(DEPLOY, dst)
    return dst


# ------------------------------------------------------------------------ 1. worker pod placement


@pytest.mark.parametrize("overlay", overlays())
def test_worker_pods_are_placed_by_the_gpu_request_alone(overlay: str) -> None:
    """No GFD label in any shipped overlay: on stock GKE/EKS pools it keeps pods Pending."""
    for tpl in worker_templates(render(overlay)):
        pod = tpl["spec"]
        assert "nodeSelector" not in pod, pod.get("nodeSelector")
        assert "affinity" not in pod
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        res = pod["containers"][0]["resources"]
        assert res["requests"][GPU] == res["limits"][GPU] >= 1


@pytest.mark.parametrize("burst", [False, True])
def test_gfd_component_adds_the_label_selector(tmp_path: Path, burst: bool) -> None:
    deploy = copy_deploy(tmp_path)
    overlay = deploy / "overlays" / "gfd"
    overlay.mkdir()
    components = ["../../components/gpu-feature-discovery", "../../components/cuda-cu12"]
    if burst:
        components.insert(0, "../../components/burst-scaledjob")
    overlay.joinpath("kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": "lmdq",
        "resources": ["../../base"],
        "components": components,
    }))
    docs = kustomize(overlay)
    templates = worker_templates(docs)
    assert len(templates) == 1
    assert templates[0]["spec"]["nodeSelector"] == {GFD_LABEL: "true"}
    assert any(d["kind"] == ("ScaledJob" if burst else "Deployment") for d in docs)


# ------------------------------------------------------------------------ 1. ephemeral storage


@pytest.mark.parametrize("overlay", overlays())
def test_ephemeral_storage_covers_the_disk_backed_volumes(overlay: str) -> None:
    """The scheduler only counts an emptyDir's disk if the pod requests it: without the request a
    200Gi model cache lands on a node with a 100Gi disk and the pod is evicted mid-download."""
    for tpl in worker_templates(render(overlay)):
        pod = tpl["spec"]
        disk = [v for v in pod["volumes"] if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"]
        for v in disk:
            assert "sizeLimit" in v["emptyDir"], f"unbounded emptyDir {v['name']}"
        needed = sum(quantity(v["emptyDir"]["sizeLimit"]) for v in disk)
        res = pod["containers"][0]["resources"]
        request = quantity(res["requests"]["ephemeral-storage"])
        limit = quantity(res["limits"]["ephemeral-storage"])
        assert request >= needed, (overlay, request, needed)
        assert limit > request, "the limit leaves room for container logs"
        cache_vol = next(v for v in pod["volumes"] if v["name"] == "model-cache")
        if "emptyDir" in cache_vol:
            assert quantity(cache_vol["emptyDir"]["sizeLimit"]) == quantity("200Gi")
            assert request >= quantity("200Gi")
        else:  # components/model-cache-pvc: the model is on the PVC, the request shrinks to the rest
            assert cache_vol["persistentVolumeClaim"]["claimName"] == "lmdq-models"
            assert request < quantity("200Gi")


# ------------------------------------------------------------------------ 1. grace period


def shutdown_bound_s(drain_s: float) -> float:
    """Worst case from SIGTERM to exit, from the worker's own constants: drain, the abort wait for
    job threads, the give-up wait for stuck Redis writes, LMDeploy's bounded close."""
    from lmdq.worker.engines.lmdeploy_engine import DEAD_CLOSE_TIMEOUT_S
    from lmdq.worker.runner import _AFTER_DEATH_S, GIVE_UP_WAIT_S

    return float(drain_s + _AFTER_DEATH_S + GIVE_UP_WAIT_S + DEAD_CLOSE_TIMEOUT_S)


@pytest.mark.parametrize("overlay", overlays())
def test_grace_period_exceeds_drain_abort_and_close(overlay: str) -> None:
    docs = render(overlay)
    drain = float(config(docs)["LMDQ_DRAIN_TIMEOUT"])
    for tpl in worker_templates(docs):
        pod = tpl["spec"]
        # the pod's env, not only the ConfigMap: an env entry would override it
        env = {e["name"]: e.get("value") for e in pod["containers"][0].get("env", [])}
        assert "LMDQ_DRAIN_TIMEOUT" not in env
        assert pod["terminationGracePeriodSeconds"] >= shutdown_bound_s(drain) + GRACE_MARGIN_S, (
            pod["terminationGracePeriodSeconds"], shutdown_bound_s(drain))


def test_compose_stop_grace_period_exceeds_drain_abort_and_close() -> None:
    worker = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["worker"]
    drain = float(worker["environment"]["LMDQ_DRAIN_TIMEOUT"])
    grace = worker["stop_grace_period"]
    assert grace.endswith("s") and grace[:-1].isdigit(), grace
    assert int(grace[:-1]) >= shutdown_bound_s(drain) + GRACE_MARGIN_S


def test_shutdown_bound_uses_the_worker_defaults() -> None:
    """The ConfigMap pins the drain the worker would default to, and the bound is drain + 30 + 10 + 15."""
    from lmdq.worker.settings import WorkerSettings

    drain = float(config(render("cu12"))["LMDQ_DRAIN_TIMEOUT"])
    assert drain == WorkerSettings.model_fields["drain_timeout_s"].default == 30.0
    assert shutdown_bound_s(drain) == 85.0


# ------------------------------------------------------------------------ 2. Redis startup probe


def test_redis_startup_probe_covers_a_long_aof_replay() -> None:
    sts = find(render("cu12"), "StatefulSet", "lmdq-redis")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    startup, live, ready = (container[p] for p in ("startupProbe", "livenessProbe", "readinessProbe"))
    ping = ["sh", "-c", "redis-cli ping | grep -q PONG"]  # LOADING (replaying the AOF) is not PONG
    assert startup["exec"]["command"] == live["exec"]["command"] == ready["exec"]["command"] == ping
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60, "30 min of replay"
    assert startup["timeoutSeconds"] >= 5
    # the startup probe holds liveness off; a fixed initial delay would only guess the replay time
    assert "initialDelaySeconds" not in live
    assert live["periodSeconds"] * live["failureThreshold"] >= 60
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env["REDISCLI_AUTH"] == {"name": "lmdq-redis", "key": "redis-password"}
    assert not [d for d in render("cu12-external-redis") if d["kind"] == "StatefulSet"]


# ------------------------------------------------------------------------ 3. served model name


def expected_lists(model: str) -> dict[str, str]:
    lists = {p.value: rq_queue_key(queue_name(model, p)) for p in Priority}
    lists["inflight"] = Keys().inflight(model)
    return lists


def trigger_lists(docs: list[Doc]) -> dict[str, dict[str, str]]:
    return {
        d["kind"]: {t["name"]: t["metadata"]["listName"] for t in d["spec"]["triggers"]}
        for d in docs
        if d["kind"] in ("ScaledObject", "ScaledJob")
    }


@pytest.mark.parametrize("overlay", overlays())
def test_every_consumer_resolves_the_one_served_model_name(overlay: str) -> None:
    docs = render(overlay)
    model = config(docs)["LMDQ_SERVED_MODEL_NAME"]
    assert model_slug(model) == model, "list names hold the name verbatim: it must be key-safe"
    want = expected_lists(model)
    lists = trigger_lists(docs)
    assert lists
    for kind, got in lists.items():
        if kind == "ScaledObject":
            assert got == want
        else:  # ScaledJob: queues only (base/keda.yaml, components/burst-scaledjob say why)
            assert got == {p.value: want[p.value] for p in Priority}
    assert PLACEHOLDER not in yaml.safe_dump_all(docs)
    for tpl in worker_templates(docs):  # the workers read it from that ConfigMap
        assert {"configMapRef": {"name": "lmdq-config"}} in tpl["spec"]["containers"][0]["envFrom"]


def test_served_model_name_is_written_in_one_file() -> None:
    model = config(render("cu12"))["LMDQ_SERVED_MODEL_NAME"]
    holders = sorted(
        str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*.yaml") if model in p.read_text()
    )
    assert holders == ["base/config.yaml"], holders


@pytest.mark.parametrize("overlay", ["cu12", "cu12-burst"])
def test_changing_the_served_model_name_once_moves_every_trigger(tmp_path: Path, overlay: str) -> None:
    deploy = copy_deploy(tmp_path)
    cfg = deploy / "base" / "config.yaml"
    old = config(render(overlay))["LMDQ_SERVED_MODEL_NAME"]
    new = "llama-3.1-8b.instruct_v2"
    text = cfg.read_text()
    assert text.count(f"LMDQ_SERVED_MODEL_NAME: {old}\n") == 1
    cfg.write_text(text.replace(f"LMDQ_SERVED_MODEL_NAME: {old}\n", f"LMDQ_SERVED_MODEL_NAME: {new}\n"))
    docs = kustomize(deploy / "overlays" / overlay)
    assert config(docs)["LMDQ_SERVED_MODEL_NAME"] == new
    lists = trigger_lists(docs)
    assert lists
    want = expected_lists(new)
    for kind, got in lists.items():
        assert got == (want if kind == "ScaledObject" else {p.value: want[p.value] for p in Priority})
        assert not any(old in v for v in got.values())


# ------------------------------------------------------------------------ 4. PodMonitor


@cache
def podmonitor_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((DEPLOY / "schemas" / "prometheus-podmonitor-v1.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return schema


def test_pod_monitor_scrapes_every_worker_metrics_port() -> None:
    docs = render("cu12-monitoring")
    pm = find(docs, "PodMonitor", "lmdq-worker")
    jsonschema.validate(pm, podmonitor_schema())
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["namespace"] == "lmdq"
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint == {"port": "http", "path": "/metrics", "interval": "30s", "scrapeTimeout": "10s"}
    health_port = int(config(docs)["LMDQ_HEALTH_PORT"])
    burst_pod = worker_templates(render("cu12-burst"))[0]
    for tpl in worker_templates(docs) + [burst_pod]:
        labels = tpl["metadata"]["labels"]
        assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
        (port,) = [p for p in tpl["spec"]["containers"][0]["ports"] if p["name"] == endpoint["port"]]
        assert port["containerPort"] == health_port
        # the annotations for a plain Prometheus name the same endpoint
        ann = tpl["metadata"]["annotations"]
        assert ann["prometheus.io/path"] == endpoint["path"] and int(ann["prometheus.io/port"]) == health_port


def test_pod_monitor_is_optional() -> None:
    for overlay in overlays():
        if overlay != "cu12-monitoring":
            assert not [d for d in render(overlay) if d["kind"] == "PodMonitor"], overlay


@pytest.mark.parametrize(
    "path, value",
    [
        (("spec", "podMetricsEndpoints", 0, "prot"), "http"),  # typo: closed objects reject it
        (("spec", "podMetricsEndpoints", 0, "interval"), "30 seconds"),
        (("spec", "podMetricEndpoints"), []),
        (("apiVersion",), "monitoring.coreos.com/v1alpha1"),
    ],
)
def test_pod_monitor_schema_rejects_mistakes(path: tuple[str | int, ...], value: Any) -> None:
    pm = json.loads(json.dumps(find(render("cu12-monitoring"), "PodMonitor", "lmdq-worker")))
    node = pm
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pm, podmonitor_schema())


# ------------------------------------------------------------------------ queue exporter


@pytest.mark.parametrize("overlay", overlays())
def test_one_gpu_less_exporter_runs_in_every_overlay(overlay: str) -> None:
    """Queue depth is exported once per Redis, by a pod that exists also at zero workers."""
    from lmdq.metrics.exporter import ExporterSettings

    docs = render(overlay)
    dep = find(docs, "Deployment", "lmdq-exporter")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    assert not [d for d in docs if d["kind"] in ("ScaledObject", "ScaledJob")
                and d["spec"].get("scaleTargetRef", {}).get("name") == "lmdq-exporter"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert "lmdq-producer" in c["image"] and c["args"] == ["exporter"]  # the producer image's entrypoint
    for section in ("requests", "limits"):
        assert GPU not in c["resources"].get(section, {})
    assert "nodeSelector" not in pod
    env = {e["name"]: e for e in c["env"]}
    assert env["LMDQ_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "lmdq-redis", "key": "redis-url"}
    port_env = "LMDQ_" + "exporter_port".upper()
    assert "exporter_port" in ExporterSettings.model_fields
    (port,) = [p for p in c["ports"] if p["name"] == "http"]
    assert int(env[port_env]["value"]) == port["containerPort"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/metrics"


def test_pod_monitor_scrapes_the_exporter() -> None:
    docs = render("cu12-monitoring")
    pm = find(docs, "PodMonitor", "lmdq-exporter")
    jsonschema.validate(pm, podmonitor_schema())
    assert pm["metadata"]["namespace"] == "lmdq"
    tpl = find(docs, "Deployment", "lmdq-exporter")["spec"]["template"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= tpl["metadata"]["labels"].items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    assert [p for p in tpl["spec"]["containers"][0]["ports"] if p["name"] == endpoint["port"]]
    # the worker PodMonitor must not select the exporter (its series would carry worker labels)
    worker_pm = find(docs, "PodMonitor", "lmdq-worker")
    assert not worker_pm["spec"]["selector"]["matchLabels"].items() <= tpl["metadata"]["labels"].items()
