"""A normal (non-editable) ``pip install .`` works from any folder, the repository root included
(issue: ``./lmdq`` shadowed the installed package there, and ``lmdq-bench fleet`` started its workers
inside ``site-packages/lmdq/``, where ``lmdq/redis/`` hid the redis library). The lab, lmdq-bench
(bench/, a distribution of its own), is installed beside it as ``pip install '.[bench]' ./bench`` would.

The new venv takes its dependencies from this environment (the lock's versions, through a ``.pth``
line, which Python does not scan for further ``.pth`` files, so the editable lmdq stays out) and gets
lmdq itself from a real wheel build. Every check then runs with the repository root as its working
directory, where a stray ``lmdq`` folder or a module named like a library would win."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_packaging import pyproject


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("plain") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "lmdq-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # from a copy of the tree: setuptools leaves build/ and *.egg-info in the folder it builds
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for folder in ("src", "worker", "producer", "bench"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                        "--no-build-isolation", "--no-cache-dir", str(src), str(src / "bench")],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not list(site.glob("__editable__*")), "expected a real install, not an editable one"
    return venv


def test_the_core_and_the_services_import_from_the_repository_root(installed: Path) -> None:
    code = ("import lmdq, lmdq.worker, lmdq.worker.runner, lmdq.producer.cli, lmdq.submission.submit, redis\n"
            "print(lmdq.Client.__module__, lmdq.__file__, lmdq.worker.__file__, redis.__file__)")
    p = subprocess.run([str(installed / "bin" / "python"), "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    module, *files = p.stdout.split()
    assert module == "lmdq.client.client"
    assert all(str(installed) in f for f in files[:2]), files  # the installed copy, not ./src or ./worker
    assert "site-packages/redis/" in files[2]


@pytest.mark.parametrize("script", sorted([*pyproject()["project"]["scripts"], "lmdq-bench"]))
def test_every_console_script_answers_help_from_the_repository_root(installed: Path, script: str) -> None:
    p = subprocess.run([str(installed / "bin" / script), "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "Usage" in p.stdout, p.stderr[-3000:]


def test_fleet_bench_with_two_workers_from_the_repository_root(installed: Path) -> None:
    """The bench starts its workers as ``python -m lmdq.worker``: they must not start inside the package."""
    p = subprocess.run([str(installed / "bin" / "lmdq-bench"), "fleet", "--workers", "2", "--capacity", "8",
                        "--batch-size", "4", "--rounds", "1", "--output-len", "2", "--decode-step-ms", "1",
                        "--idle-workers", "0", "--poll-workers", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = json.loads(p.stdout.strip().splitlines()[-1])["runs"]
    assert [r["workers"] for r in runs] == [1, 2] and all(r["requests"] > 0 for r in runs)
