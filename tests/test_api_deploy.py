"""lmdq-api's packaging: the `api` image stage, the compose `api` profile and the Kubernetes objects
(rendered with the real ``kubectl kustomize`` where tests/test_deploy.py finds it)."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.conftest import ROOT
from tests.test_deploy import render
from tests.test_packaging import dockerfile, exec_form, pyproject


def test_api_image_stage_runs_lmdq_api_as_the_lmdq_user() -> None:
    stage = dockerfile().stage("api")
    assert stage.base == "producer"  # no GPU stack: the producer image plus lmdq[api]
    assert exec_form(stage.all("ENTRYPOINT")[-1].args) == ["lmdq-api"]
    assert "lmdq-api" in pyproject()["project"]["scripts"]
    assert stage.all("USER")[-1].args == "10001:10001"
    assert "[blobs,api]" in " ".join(i.args for i in stage.all("RUN"))
    assert set(pyproject()["project"]["optional-dependencies"]["api"]) >= {"fastapi>=0.110", "uvicorn>=0.29"}
    extras = re.search(r'EXTRAS="([a-z,]+)"', (ROOT / "scripts/lock.sh").read_text())
    assert extras and "api" in extras.group(1).split(","), extras  # CI installs the extra


def test_compose_api_is_an_optional_profile_on_the_served_model() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    api = services["api"]
    assert api["profiles"] == ["api"] and api["build"]["target"] == "api" and "deploy" not in api  # no GPU
    env = api["environment"]
    assert env["LMDQ_REDIS_URL"] == services["worker"]["environment"]["LMDQ_REDIS_URL"]
    assert env["LMDQ_API_MODEL"] == services["worker"]["environment"]["LMDQ_SERVED_MODEL_NAME"]
    assert any(v.endswith(":/files") for v in api["volumes"])
    assert any(p.startswith("127.0.0.1:") and p.endswith(":8000") for p in api["ports"])


@pytest.mark.parametrize("overlay", ["cu12", "cu12-burst"])
def test_k8s_api_deployment_and_service(overlay: str) -> None:
    docs = render(overlay)
    (dep,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "lmdq-api"]
    (svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "lmdq-api"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert "nvidia.com/gpu" not in str(c["resources"]) and "nodeSelector" not in pod and "tolerations" not in pod
    assert c["image"].startswith("ghcr.io/") and "lmdq-api" in c["image"]
    env = {e["name"]: e for e in c["env"]}
    assert env["LMDQ_API_KEYS_FILE"]["value"].startswith("/etc/lmdq-api/")
    assert env["LMDQ_API_MODEL"]["valueFrom"]["configMapKeyRef"]["key"] == "LMDQ_SERVED_MODEL_NAME"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols[mounts[env["LMDQ_API_FILES_DIR"]["value"]]]["persistentVolumeClaim"]["claimName"] == "lmdq-api-files"
    assert vols[mounts["/etc/lmdq-api"]]["secret"]["secretName"] == "lmdq-api-keys"
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
