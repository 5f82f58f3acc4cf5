"""typer (and the click it wraps) lives only in the command lines: the CLI plumbing src/lmdq/cli/ and
each command's cli.py (producer/, worker/, bench/, src/lmdq/api/, src/lmdq/metrics/).

The core declares its flags as typer-free data (lmdq.flags.FlagSpec, from settings fields) and
the command lines render them: a library user, the worker's job code and the HTTP API never import typer.
Two checks, each shown able to fail: a source scan (an ``import typer`` anywhere else fails) and a
real import of the core modules in a fresh interpreter (typer pulled in indirectly fails).
"""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.conftest import ROOT

SOURCE_DIRS = ("src", "worker", "producer", "bench")
CLI_PACKAGE = "src/lmdq/cli/"
CLI_MODULES = (CLI_PACKAGE, "producer/cli.py", "worker/cli.py", "bench/cli.py", "src/lmdq/api/cli.py",
               "src/lmdq/metrics/cli.py")
CLI_LIBRARIES = ("typer", "click")


def _cli_imports(tree: ast.AST) -> list[int]:
    """Lines that import typer or click (``import typer``, ``from typer._click import ...``, ``import
    click.testing``), at any depth: a function-level import counts too."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(n.split(".")[0] in CLI_LIBRARIES for n in names):
            lines.append(node.lineno)
    return lines


def test_the_scan_finds_a_typer_import() -> None:
    planted = ast.parse("import os\nimport typer\n\ndef f():\n    from typer._click.exceptions import UsageError\n"
                        "    import click.testing\n    from lmdq.cli import options\n    import typing\n")
    assert _cli_imports(planted) == [2, 5, 6]


def test_typer_is_imported_only_in_the_cli_package() -> None:
    outside = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(CLI_MODULES):
                continue
            outside += [f"{rel}:{line}" for line in _cli_imports(ast.parse(path.read_text(), rel))]
    assert outside == [], "typer/click outside the command lines: declare flags with lmdq.flags, render them there"
    # ...and the command lines really are where the CLIs are
    assert {p.name for p in (ROOT / CLI_PACKAGE).glob("*.py")} >= {"options.py", "run.py"}
    assert all((ROOT / m).is_file() for m in CLI_MODULES[1:])


_CORE = ("lmdq", "lmdq.client", "lmdq.client.options", "lmdq.errors", "lmdq.flags", "lmdq.settings",
         "lmdq.testing", "lmdq.metrics.exporter", "lmdq.submission.submit", "lmdq.submission.settings",
         "lmdq.worker.runner", "lmdq.worker.settings", "lmdq.worker.engine_config", "lmdq.api.app")


def _loaded_cli_libraries(modules: tuple[str, ...]) -> list[str]:
    code = (f"import importlib, sys\nfor m in {list(modules)!r}:\n    importlib.import_module(m)\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(CLI_LIBRARIES)!r}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    return list(ast.literal_eval(p.stdout.strip().splitlines()[-1]))


def test_the_core_runs_without_typer() -> None:
    """Importing the library, the worker's job code, the exporter and the HTTP API loads no typer; a CLI
    module does (the check sees an indirect import)."""
    assert _loaded_cli_libraries(_CORE) == []
    assert "typer" in _loaded_cli_libraries(("lmdq.worker.cli",))
