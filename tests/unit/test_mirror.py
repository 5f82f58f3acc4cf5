"""The unit-test mirror (issue 30): every module under lmdq/ has tests/unit/<same path>/test_<module>.py,
or is named in NO_UNIT_TEST_YET. The set is exact both ways: a new module without a unit test fails
here, and so does a module that gained one but is still listed (take it off the set)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SKIPPED_NAMES = {"__init__.py", "__main__.py"}
SKIPPED_DIRS = {"_child_logging"}  # the children's start-up hook (sitecustomize), not an importable module

NO_UNIT_TEST_YET = {
    "src/lmdq/api/app.py",
    "src/lmdq/api/backend.py",
    "src/lmdq/api/batches.py",
    "src/lmdq/api/cli.py",
    "src/lmdq/api/settings.py",
    "src/lmdq/api/uploads.py",
    "src/lmdq/batches/staging.py",
    "src/lmdq/cli/options.py",
    "src/lmdq/cli/run.py",
    "src/lmdq/client/client.py",
    "src/lmdq/client/options.py",
    "src/lmdq/client/planning.py",
    "src/lmdq/client/sources.py",
    "src/lmdq/client/submit_kwargs.py",
    "src/lmdq/jobs/queue.py",
    "src/lmdq/logs/relay.py",
    "src/lmdq/metrics/cli.py",
    "src/lmdq/metrics/exporter.py",
    "src/lmdq/metrics/queue_stats.py",
    "src/lmdq/redis/connection.py",
    "src/lmdq/redis/scripts.py",
    "src/lmdq/registry/store.py",
    "src/lmdq/results/blobs.py",
    "src/lmdq/results/reader.py",
    "src/lmdq/results/worker_sink.py",
    "src/lmdq/results/writer.py",
    "src/lmdq/settings.py",
    "src/lmdq/submission/cancel.py",
    "src/lmdq/submission/follow.py",
    "src/lmdq/submission/foreign.py",
    "src/lmdq/submission/formats/jsonl.py",
    "src/lmdq/submission/formats/openai_batch.py",
    "src/lmdq/submission/formats/records.py",
    "src/lmdq/submission/formats/tabular.py",
    "src/lmdq/submission/formats/validation.py",
    "src/lmdq/submission/ledger.py",
    "src/lmdq/submission/models.py",
    "src/lmdq/submission/prefix_groups.py",
    "src/lmdq/submission/progress.py",
    "src/lmdq/submission/retry.py",
    "src/lmdq/submission/settings.py",
    "src/lmdq/submission/spill.py",
    "src/lmdq/submission/stdin_input.py",
    "src/lmdq/submission/submit.py",
    "src/lmdq/testing.py",
}
"""Modules with no unit test of their own yet (most have scenario tests under tests/test_*.py)."""


def modules(root: Path) -> set[str]:
    """Every module under ``root``/src/lmdq (the core), as a path relative to ``root``."""
    return {p.relative_to(root).as_posix() for p in (root / "src" / "lmdq").rglob("*.py")
            if p.name not in SKIPPED_NAMES and not SKIPPED_DIRS & set(p.relative_to(root).parts)}


def unit_test_of(module: str) -> str:
    """``src/lmdq/a/b.py`` -> ``tests/unit/a/test_b.py`` (``src/lmdq/c.py`` -> ``tests/unit/test_c.py``)."""
    parts = Path(module).parts[2:]
    return Path("tests", "unit", *parts[:-1], f"test_{parts[-1]}").as_posix()


def without_unit_test(root: Path) -> set[str]:
    return {m for m in modules(root) if not (root / unit_test_of(m)).is_file()}


def test_every_module_has_a_unit_test_or_is_exempt() -> None:
    missing = without_unit_test(ROOT)
    new = sorted(missing - NO_UNIT_TEST_YET)
    assert not new, f"modules without a unit test: add {[unit_test_of(m) for m in new]}"
    stale = sorted(NO_UNIT_TEST_YET - missing)
    assert not stale, f"take these off NO_UNIT_TEST_YET (they have a unit test now, or are gone): {stale}"


def test_the_scan_sees_the_real_tree() -> None:
    found = modules(ROOT)
    assert {"src/lmdq/contract.py", "src/lmdq/redis/keys.py", "src/lmdq/results/shards.py"} <= found
    assert len(found) > 40
    assert not any("__init__" in m or "_child_logging" in m for m in found)


def test_every_unit_test_folder_is_a_package() -> None:
    """tests/ is rootdir-imported (no __init__.py): an __init__.py in each tests/unit folder makes a module
    ``unit.redis.test_keys``, so its basename cannot clash with tests/test_keys.py or another folder's."""
    for d in [ROOT / "tests" / "unit", *(p for p in (ROOT / "tests" / "unit").rglob("*") if p.is_dir())]:
        if d.name == "__pycache__":
            continue
        assert (d / "__init__.py").is_file(), f"{d.relative_to(ROOT)} has no __init__.py"


def test_a_planted_violation_is_found(tmp_path: Path) -> None:
    for rel in ["src/lmdq/__init__.py", "src/lmdq/top.py", "src/lmdq/pkg/__init__.py", "src/lmdq/pkg/__main__.py",
                "src/lmdq/pkg/tested.py", "src/lmdq/pkg/untested.py", "src/lmdq/logs/_child_logging/sitecustomize.py",
                "tests/unit/test_top.py", "tests/unit/pkg/test_tested.py", "tests/unit/test_untested.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert modules(tmp_path) == {"src/lmdq/top.py", "src/lmdq/pkg/tested.py", "src/lmdq/pkg/untested.py"}
    # a test in the wrong folder (tests/unit/test_untested.py) does not count
    assert without_unit_test(tmp_path) == {"src/lmdq/pkg/untested.py"}
    assert unit_test_of("src/lmdq/redis/keys.py") == "tests/unit/redis/test_keys.py"
