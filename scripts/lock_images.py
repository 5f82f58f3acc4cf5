"""Write the images' lock files, constraints/worker.txt and constraints/producer.txt.

    python scripts/lock_images.py [--python python3.12]

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


def resolve(python: str, extras: tuple[str, ...], workdir: Path) -> list[dict]:
    """pip's resolution of lmdq[extras] for a Linux image with ``python``: the report's installs."""
    venv = workdir / "venv"
    if not venv.exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
                       check=True, env=_env())
    pins = workdir / "torch.txt"
    pins.write_text("".join(p + "\n" for p in TORCH_FOR_RESOLVING))
    report = workdir / f"report-{'-'.join(extras)}.json"
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--dry-run", "--ignore-installed",
                    "--quiet", "--report", str(report), "--constraint", str(pins),
                    f"{ROOT}[{','.join(extras)}]"], check=True, env=_env())
    return list(json.loads(report.read_text())["install"])


def _env() -> dict[str, str]:
    # the machine's pip config (extra indexes, caps) must not shape the project's lock
    return {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def pinned(installs: list[dict], extras: tuple[str, ...], python_version: str) -> dict[str, str]:
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
            if dep not in meta or (name in TORCH_FAMILY and dep.startswith(_TORCH_CUDA)):
                continue
            if req.marker is not None and not any(req.marker.evaluate({**env, "extra": e})
                                                  for e in (wanted or ("",))):
                continue
            key = dep + "[" + ",".join(sorted(req.extras)) + "]"
            if key in seen:
                continue
            seen.add(key)
            todo.append((dep, tuple(sorted(req.extras))))
    names = {re.sub(r"\[.*", "", k) for k in seen} - {"lmdq"} - TORCH_FAMILY
    return {n: meta[n]["version"] for n in sorted(names)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default="python3.12", help="the images' Python (Dockerfile: 3.12)")
    args = ap.parse_args()
    version = subprocess.run([args.python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lmdq-lock-") as tmp:
        for fname, extras in IMAGES.items():
            pins = pinned(resolve(args.python, extras, Path(tmp)), extras, version)
            head = (f"# lmdq[{','.join(extras)}] for the {fname.removesuffix('.txt')} image, Python {version}, "
                    "linux x86_64.\n# Generated by scripts/lock_images.py (pip's resolver); do not edit by hand.\n"
                    "# torch, torchvision, triton and torch's CUDA libraries come from the CUDA variant's\n"
                    "# PyTorch index (Dockerfile TORCH_VERSION), not from here.\n")
            (OUT / fname).write_text(head + "".join(f"{n}=={v}\n" for n, v in pins.items()))
            print(f"{OUT / fname}: {len(pins)} pins", file=sys.stderr)


if __name__ == "__main__":
    main()
