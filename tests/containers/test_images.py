"""The built images themselves: user, entrypoint, healthcheck and labels of every target built here,
and the CUDA worker's stages up to its torch install, on a stand-in base.

What the CUDA check cannot reach (docs/deploy.md, "What the container suite checks"): the
nvidia/cuda base images (no registry) and PyTorch's CUDA index (unreachable), so the `worker`
target's torch + lmdeploy + lmdq install, and anything on a GPU, are not built or run here.
"""

from __future__ import annotations

import json
from typing import IO, Any

import pytest

from tests.containers import harness as h

pytestmark = pytest.mark.containers

UID = "10001"
#: the CUDA variants and the base image each one's stage names (Dockerfile)
CUDA_BASES = {"cu12": "nvidia/cuda:12.6.3-base-ubuntu24.04", "cu128": "nvidia/cuda:12.8.1-base-ubuntu24.04"}
TORCH_INDEX = {"cu12": "https://download.pytorch.org/whl/cu126", "cu128": "https://download.pytorch.org/whl/cu128"}


def config(engine: h.Engine, image: str) -> dict[str, Any]:
    cfg: dict[str, Any] = engine.inspect(image)["Config"]
    return cfg


def run_in(engine: h.Engine, image: str, *cmd: str, entrypoint: str = "", env: dict[str, str] | None = None,
           check: bool = True) -> Any:
    args = ["run", "--rm", "--network", "host"]
    if entrypoint:
        args += ["--entrypoint", entrypoint]
    for k, v in (env or {}).items():
        args += ["-e", f"{k}={v}"]
    return engine.docker(*args, image, *cmd, check=check, timeout=300)


@pytest.mark.parametrize("target", ["producer", "dashboard", "worker-cpu"])
def test_built_image_runs_as_lmdq_with_its_entrypoint_and_labels(
        engine: h.Engine, images: dict[str, str], target: str) -> None:
    cfg = config(engine, images[target])
    assert cfg["User"] == f"{UID}:{UID}"
    assert cfg["Labels"]["lmdq.target"] == target
    assert cfg["Labels"]["org.opencontainers.image.licenses"] == "Apache-2.0"
    entry = {"producer": ["lmdq-producer"], "dashboard": ["rq-dashboard"], "worker-cpu": ["lmdq-worker"]}[target]
    assert cfg["Entrypoint"][: len(entry)] == entry
    if target == "producer":
        assert cfg["Healthcheck"]["Test"] == ["NONE"]
    else:
        assert cfg["Healthcheck"]["Test"][:2] == ["CMD", "python"]
    out = run_in(engine, images[target], "--help")
    assert "Usage" in out.stdout or "usage" in out.stdout.lower(), out.stdout[-2000:]


def test_worker_cpu_has_cpu_torch_the_converted_model_and_no_cuda(engine: h.Engine, images: dict[str, str]) -> None:
    code = ("import json, torch, transformers, importlib.metadata as m; "
            "from lmdq.worker.default_model import ensure_default_model, find_default_gguf; "
            "p = ensure_default_model(); "
            "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
            "'transformers': transformers.__version__, 'model': str(p), 'gguf': str(find_default_gguf()), "
            "'nvidia': sorted(d.metadata['Name'] for d in m.distributions() "
            "if d.metadata['Name'].startswith('nvidia'))}))")
    out = run_in(engine, images["worker-cpu"], "-c", code, entrypoint="python")
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["torch"].startswith(h.CPU_TORCH_VERSION) and facts["cuda"] is None, facts
    assert facts["nvidia"] == [], "no CUDA libraries in the CPU image"
    assert facts["model"].startswith("/opt/lmdq/cache/"), "converted at build time, read-only at run time"


@pytest.fixture(scope="module")
def cuda_worker_base(engine: h.Engine, base_images: dict[str, str], steps: h.StepLog,
                     build_log: IO[str]) -> dict[str, str]:
    """`--target worker-base` for each CUDA variant, its nvidia/cuda base replaced by the stand-in.

    The stand-in is tagged with the real base's name in the suite's private engine (BuildKit uses a
    local image before any registry), so the Dockerfile is built exactly as written.
    """
    h.cuda_standin_image(engine, steps, build_log)
    tags = {}
    for variant, base in CUDA_BASES.items():
        engine.docker("tag", h.CUDA_STANDIN_IMAGE, base)
        tag = f"lmdq-worker-base:{variant}-standin"
        with steps.step(f"docker build --target worker-base (CUDA_VARIANT={variant}, stand-in base)"):
            h.build_target(engine, "worker-base", tag, {"CUDA_VARIANT": variant,
                                                        "PYTHON_IMAGE": base_images["python"]}, build_log)
        tags[variant] = tag
    return tags


@pytest.mark.parametrize("variant", sorted(CUDA_BASES))
def test_cuda_worker_stages_before_torch_on_a_stand_in_base(
        engine: h.Engine, cuda_worker_base: dict[str, str], variant: str) -> None:
    image = cuda_worker_base[variant]
    cfg = config(engine, image)
    env = dict(e.split("=", 1) for e in cfg["Env"])
    # the variant stage's settings reach the worker: what its torch step would install, and from where
    assert env["LMDQ_CUDA_VARIANT"] == variant
    assert env["TORCH_INDEX_URL"] == TORCH_INDEX[variant]
    assert env["VIRTUAL_ENV"] == "/opt/venv" and env["PATH"].startswith("/opt/venv/bin:")
    assert env["HF_HOME"] == "/models/hf" and env["LMDQ_HEALTH_PORT"] == "8000"
    assert cfg["User"] == f"{UID}:{UID}" and cfg["Entrypoint"] == ["lmdq-worker"]
    assert cfg["Labels"]["lmdq.target"] == "worker"
    assert "/models" in (cfg.get("Volumes") or {}) and "8000/tcp" in cfg["ExposedPorts"]
    hc = cfg["Healthcheck"]
    assert hc["Test"][:3] == ["CMD", "python", "-c"] and hc["StartPeriod"] == 60 * 10**9
    # the venv is the worker's Python (3.12), usable by uid 10001, and the model cache is writable
    out = run_in(engine, image, "-c",
                 "import sys, os; open('/models/hf/.probe', 'w').write('x'); "
                 "print(sys.version_info[:2], sys.prefix, os.getuid(), os.access('/opt/venv/bin', os.X_OK))",
                 entrypoint="python")
    assert out.stdout.split() == ["(3,", "12)", "/opt/venv", UID, "True"], out.stdout
    gcc = run_in(engine, image, "--version", entrypoint="gcc")  # Triton's launcher build needs it at run time
    assert "gcc" in gcc.stdout
    # the image's own HEALTHCHECK command, run by its Python: passes with the endpoint off (port 0),
    # fails with nothing listening, passes against a server answering /healthz
    probe = hc["Test"][1:]
    assert run_in(engine, image, *probe[1:], entrypoint=probe[0], env={"LMDQ_HEALTH_PORT": "0"}).returncode == 0
    port = str(free_port())
    down = run_in(engine, image, *probe[1:], entrypoint=probe[0], env={"LMDQ_HEALTH_PORT": port}, check=False)
    assert down.returncode != 0
    serve_and_probe = (
        "import http.server, os, subprocess, sys, threading\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200 if self.path == '/healthz' else 404); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        f"srv = http.server.HTTPServer(('127.0.0.1', {port}), H)\n"
        "threading.Thread(target=srv.serve_forever, daemon=True).start()\n"
        f"sys.exit(subprocess.run({probe!r}, env={{**os.environ, 'LMDQ_HEALTH_PORT': '{port}'}}).returncode)\n")
    up = run_in(engine, image, "-c", serve_and_probe, entrypoint="python", check=False)
    assert up.returncode == 0, up.stdout + up.stderr


def free_port() -> int:
    from tests.containers.stack import free_port as fp

    return fp()
