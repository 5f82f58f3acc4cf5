"""Write the images' lock files, constraints/worker.txt, producer.txt and worker-cpu.txt.

    python scripts/lock_images.py [--python python3.12] [--cpu-python python3.11] [--only worker-cpu.txt]

Why: the images resolved lmdeploy's and transformers' 100+ dependencies afresh at every build, so
two builds of one commit could differ. This resolves them ONCE, here, with pip's own resolver
(``pip install --dry-run --report``, nothing installed) in a fresh venv of the images' Python
(3.12, as in the Dockerfile), machine pip config ignored, and writes every resolved package as
``name==version``; the Dockerfile installs with ``--constraint`` on these files. Re-run it to
move the pins (e.g. after a pyproject change); tests/test_packaging.py (the lock tests) fails
when a pin no longer satisfies pyproject or a dependency is missing from the lock.

Left out on purpose: lmdq itself, and torch, torchvision, triton and the ``cuda-*``/``nvidia-*``
libraries torch brings: those come from PyTorch's index of the image's CUDA variant (cu126 /
cu128, pinned by TORCH_VERSION in the Dockerfile), whose torch wheels pin their own CUDA libraries
exactly. torch's pure-Python dependencies (sympy, networkx, jinja2, ...) are pinned. The
resolution uses PyPI's torch (a CUDA 13 build) only to see what the rest needs. lmdeploy's own
CUDA 12 libraries (nvidia-*-cu12) are lmdeploy's requirements and stay pinned.

The CPU worker image (worker-cpu.txt) is Python 3.11 (PyTorch's CPU wheels that lmdq's CPU setup
uses, torch 2.13.0, are cp311 builds): only torch itself is left out there (it comes from PyTorch's
CPU index); triton, which xgrammar needs and a CPU torch does not bring, comes from PyPI and is pinned.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "constraints"
#: torch for the resolution only (PyPI's build); the images install it from PyTorch's CUDA index
TORCH_FOR_RESOLVING = ("torch==2.12.1", "torchvision==0.27.1")
#: never pinned here: the CUDA variant's index provides them (see the module docstring)
TORCH_FAMILY = frozenset({"torch", "torchvision", "triton"})
#: what torch's own wheel brings for its CUDA build (PyPI's: CUDA 13): never pinned from here
_TORCH_CUDA = ("nvidia-", "cuda-", "triton")
#: lock file -> lmdq extras installed in that image (Dockerfile)
IMAGES = {"worker.txt": ("worker", "blobs"), "producer.txt": ("blobs",)}
#: the CPU worker's lock: its own Python (--cpu-python), torch for the resolution, what stays unpinned
CPU_IMAGES = {"worker-cpu.txt": ("cpu", "blobs")}
CPU_TORCH_FOR_RESOLVING = ("torch==2.13.0",)
CPU_TORCH_FAMILY = frozenset({"torch"})


def resolve(python: str, extras: tuple[str, ...], workdir: Path,
            torch_pins: tuple[str, ...] = TORCH_FOR_RESOLVING) -> list[dict]:
    """pip's resolution of lmdq[extras] for a Linux image with ``python``: the report's installs."""
    venv = workdir / f"venv-{Path(python).name}"
    if not venv.exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
                       check=True, env=_env())
    pins = workdir / "torch.txt"
    pins.write_text("".join(p + "\n" for p in torch_pins))
    report = workdir / f"report-{'-'.join(extras)}.json"
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--dry-run", "--ignore-installed",
                    "--quiet", "--report", str(report), "--constraint", str(pins),
                    f"{ROOT}[{','.join(extras)}]"], check=True, env=_env())
    return list(json.loads(report.read_text())["install"])


def _env() -> dict[str, str]:
    # the machine's pip config (extra indexes, caps) must not shape the project's lock
    return {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def pinned(installs: list[dict], extras: tuple[str, ...], python_version: str,
           family: frozenset[str] = TORCH_FAMILY) -> dict[str, str]:
    """name -> version of every package lmdq[extras] needs, reached without going through torch."""
    meta = {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in installs}
    env = {**default_environment(), "python_version": python_version, "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64"}
    seen: set[str] = set()
    todo: list[tuple[str, tuple[str, ...]]] = [("lmdq", extras)]
    while todo:
        name, wanted = todo.pop()
        for raw in meta[name].get("requires_dist") or []:
            req = Requirement(raw)
            dep = canonicalize_name(req.name)
            if dep not in meta or (name in family and dep.startswith(_TORCH_CUDA)):
                continue
            if req.marker is not None and not any(req.marker.evaluate({**env, "extra": e})
                                                  for e in (wanted or ("",))):
                continue
            key = dep + "[" + ",".join(sorted(req.extras)) + "]"
            if key in seen:
                continue
            seen.add(key)
            todo.append((dep, tuple(sorted(req.extras))))
    names = {re.sub(r"\[.*", "", k) for k in seen} - {"lmdq"} - family
    return {n: meta[n]["version"] for n in sorted(names)}


def _version(python: str) -> str:
    return subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                          check=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default="python3.12", help="the images' Python (Dockerfile: 3.12)")
    ap.add_argument("--cpu-python", default="python3.11", help="the CPU worker image's Python (Dockerfile: 3.11)")
    ap.add_argument("--only", action="append", help="write only this lock file (repeatable)")
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    gpu_note = ("# torch, torchvision, triton and torch's CUDA libraries come from the CUDA variant's\n"
                "# PyTorch index (Dockerfile TORCH_VERSION), not from here.\n")
    cpu_note = "# torch comes from PyTorch's CPU index (Dockerfile worker-cpu TORCH_INDEX_URL), not from here.\n"
    jobs = [(f, e, args.python, TORCH_FOR_RESOLVING, TORCH_FAMILY, gpu_note) for f, e in IMAGES.items()]
    jobs += [(f, e, args.cpu_python, CPU_TORCH_FOR_RESOLVING, CPU_TORCH_FAMILY, cpu_note)
             for f, e in CPU_IMAGES.items()]
    with tempfile.TemporaryDirectory(prefix="lmdq-lock-") as tmp:
        for fname, extras, python, torch_pins, family, note in jobs:
            if args.only and fname not in args.only:
                continue
            version = _version(python)
            installs = resolve(python, extras, Path(tmp), torch_pins)
            pins = pinned(installs, extras, version, family)
            head = (f"# lmdq[{','.join(extras)}] for the {fname.removesuffix('.txt')} image, Python {version}, "
                    "linux x86_64.\n# Generated by scripts/lock_images.py (pip's resolver); do not edit by hand.\n"
                    + note)
            (OUT / fname).write_text(head + "".join(f"{n}=={v}\n" for n, v in pins.items()))
            print(f"{OUT / fname}: {len(pins)} pins", file=sys.stderr)


if __name__ == "__main__":
    main()
