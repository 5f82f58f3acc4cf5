"""The layers of docs/architecture.md, checked by import-linter (.importlinter) on the package as it
installs: the core from src/lmdq/ with worker/, producer/ and bench/ inside it as lmdq.worker,
lmdq.producer and lmdq_bench. grimp (import-linter's graph) walks a package's folder, so the
editable install's package-dir mapping is rebuilt here as a tree of links."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_packaging import pyproject

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def installed_shape(into: Path) -> Path:
    """``into``/lmdq laid out as the wheel lays it out (package-dir), out of links to the checkout."""
    mapping = pyproject()["tool"]["setuptools"]["package-dir"]
    pkg = into / "lmdq"
    pkg.mkdir()
    for entry in (ROOT / mapping["lmdq"]).iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name, folder in mapping.items():
        if name != "lmdq":
            (into / name.replace(".", "/")).symlink_to(ROOT / folder)
    (into / "lmdq_bench").symlink_to(ROOT / "bench")  # the lab, a distribution of its own (bench/pyproject.toml)
    return into


def lint(tree: Path, config: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", str(config)], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)


def test_every_import_contract_is_kept(tmp_path: Path) -> None:
    p = lint(installed_shape(tmp_path), ROOT / ".importlinter")
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
    assert "0 broken" in p.stdout and "4 kept" in p.stdout, p.stdout


@pytest.mark.parametrize("planted", [
    ("src/lmdq/results/planted_up.py", "import lmdq.client.client\n"),     # a lower layer importing a client
    ("worker/planted_cross.py", "import lmdq.producer.cli\n"),            # a service importing the other
])
def test_a_planted_violation_breaks_a_contract(tmp_path: Path, planted: tuple[str, str]) -> None:
    rel, text = planted
    tree = tmp_path / "tree"
    tree.mkdir()
    installed_shape(tree)
    inside = Path(rel).relative_to("src/lmdq") if rel.startswith("src/") else Path(rel)
    folder = tree / "lmdq" / inside.parent
    # the plant goes into a copy of its folder (not through a link), so the checkout is never written
    real = folder.resolve()
    folder.unlink()
    shutil.copytree(real, folder, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / inside.name).write_text(text)
    p = lint(tree, ROOT / ".importlinter")
    assert p.returncode != 0 and "BROKEN" in p.stdout.upper(), p.stdout[-3000:]
