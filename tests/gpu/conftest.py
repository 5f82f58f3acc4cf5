"""GPU suite: real LMDeploy pipelines (PyTorch and TurboMind backends). Skipped without CUDA and lmdeploy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _gpu_ready() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import lmdeploy  # noqa: F401
    except ImportError:
        return "lmdeploy is not installed"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why = _gpu_ready()
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.gpu)
            if why:
                item.add_marker(pytest.mark.skip(reason=f"gpu suite: {why}"))


@pytest.fixture(scope="session")
def model_path() -> Path:
    p = Path(os.environ.get("LMDQ_GPU_MODEL", "/root/models/smollm2-135m-instruct"))
    if not (p / "config.json").exists():
        pytest.skip(f"no model folder at {p} (set LMDQ_GPU_MODEL)")
    return p


@pytest.fixture(scope="session")
def gpu_dtype() -> str:
    """dtype the suite runs SmolLM2 in (see docs/gpu-validation.md for why float16)."""
    return os.environ.get("LMDQ_GPU_DTYPE", "float16")


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """A folder with SmolLM2's tokenizer files (vocab 49152) for random-weight models."""
    t = os.environ.get("LMDQ_GPU_TOKENIZER")
    if t:
        return Path(t)
    p = Path(os.environ.get("LMDQ_GPU_MODEL", "/root/models/smollm2-135m-instruct"))
    if not (p / "tokenizer.json").exists():
        pytest.skip("no tokenizer folder (set LMDQ_GPU_TOKENIZER)")
    return p


@pytest.fixture(scope="session")
def gpu_mp_engine() -> bool:
    """The suite follows the worker's LMDQ_MP_ENGINE (default on: the engine loop in its own process),
    read by the worker's own settings so both parse it the same way."""
    from lmdq.worker.settings import WorkerSettings

    return WorkerSettings(engine="lmdeploy").engine_config.mp_engine


def turbomind_missing() -> str | None:
    """Why TurboMind cannot load here (its binary or its CUDA 12 libraries), or None."""
    try:
        import lmdeploy.turbomind as tm
    except ImportError as e:
        return f"lmdeploy.turbomind: {e}"
    return None if tm.is_available() else f"TurboMind binary does not load: {tm._import_error}"


def gpu_backends() -> list[str]:
    """Backends the suite runs on: LMDQ_GPU_BACKENDS (default both)."""
    return [b.strip() for b in os.environ.get("LMDQ_GPU_BACKENDS", "pytorch,turbomind").split(",") if b.strip()]


@pytest.fixture(scope="module", params=gpu_backends())
def gpu_backend(request: pytest.FixtureRequest) -> str:
    """One LMDeploy backend; TurboMind is skipped (with the loader's own error) where it cannot load."""
    backend = str(request.param)
    if backend == "turbomind" and (why := turbomind_missing()):
        pytest.skip(why)
    return backend
