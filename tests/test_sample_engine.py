"""docs/architecture.md "Adding an engine", followed literally by a test-only engine (tests/sample_engine.py).

Steps 1-3 are that module. Step 4 (register) is done here the two ways the doc names: an entry point in
group ``lmdq.engines`` (a ``*.dist-info`` folder on the path, what ``pip install`` writes from the
package's ``[project.entry-points."lmdq.engines"]``), and ``register_engine(SPEC)`` from Python. Then,
with no lmdq file naming it: its settings are ``lmdq-worker`` (and ``lmdq-bench``) flags and ``LMDQ_*``
env vars, the contract checks pass on it, and ``lmdq-worker --engine echo`` serves a batch end to end
against a real redis-server.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmdq.contract import Result, ResultStatus
from lmdq.errors import BadSetting
from lmdq.worker.engines.registry import (
    ENTRY_POINT_GROUP,
    check_engine_class,
    engine_spec,
    register_engine,
    unregister_engine,
)
from tests.conftest import ROOT, run_cli, start_worker
from tests.sample_engine import SPEC, EchoConfig, EchoEngine

DOC = ROOT / "docs" / "architecture.md"


def _installed(tmp_path: Path) -> Path:
    """Step 4 for a package: its entry point, as the metadata ``pip install`` writes for it."""
    dist = tmp_path / "site" / "lmdq_sample_echo-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lmdq-sample-echo\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\necho = tests.sample_engine:SPEC\n")
    return dist.parent


@pytest.fixture()
def plugin_env(tmp_path: Path, env: dict[str, str]) -> dict[str, str]:
    site = _installed(tmp_path)
    return {**env, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


@pytest.fixture()
def registered() -> Iterator[None]:
    """Step 4 from Python, for this test only (other tests' scans of the engine settings see the built-ins)."""
    register_engine(SPEC)
    try:
        yield
    finally:
        unregister_engine(SPEC.name)


def test_the_doc_names_the_steps_this_engine_follows() -> None:
    doc = DOC.read_text()
    section = doc.split("## Adding an engine", 1)[1].split("\n## ", 1)[0]
    for needle in ("EngineConfig", "flag_prefix", "Engine", "capacity", "FinishReason", "ErrorCode",
                   "EngineSpec", 'entry-points."lmdq.engines"', "register_engine", "BUILTIN",
                   "tests/sample_engine.py"):
        assert needle in section, needle
    steps = re.findall(r"^(\d+)\. ", section, flags=re.M)
    assert steps == [str(i) for i in range(1, len(steps) + 1)] and len(steps) >= 4, steps
    # ...and no lmdq file names the sample engine: it is known through the registry alone
    for folder in ("src", "worker", "producer", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            assert "sample_engine" not in path.read_text(), path


def test_registered_from_python_it_meets_the_contract_and_takes_its_settings(registered: None) -> None:
    from lmdq.worker.engine_factory import build_engine
    from lmdq.worker.settings import WorkerSettings, load_worker_settings

    assert engine_spec("echo") is SPEC
    check_engine_class(EchoEngine, "echo")
    s = WorkerSettings(engine="echo", echo_slots=3, echo_upper=True)
    assert s.engine_config == EchoConfig(slots=3, upper=True)
    eng = build_engine(s)
    assert (eng.name, eng.model_name, eng.capacity) == ("echo", "echo", 3)
    with pytest.raises(BadSetting, match="--echo-slots / LMDQ_ECHO_SLOTS: .*greater than or equal to 1"):
        load_worker_settings(engine="echo", echo_slots=0)
    with pytest.raises(BadSetting, match="--echo-upper is a setting of the echo engine, not of --engine sim"):
        load_worker_settings(engine="sim", echo_upper=True)


def test_installed_as_a_plugin_its_settings_are_flags(plugin_env: dict[str, str]) -> None:
    out = run_cli("lmdq.worker", "--help", env={**plugin_env, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr.decode()
    text = out.stdout.decode()
    for flag in ("--echo-slots", "--echo-upper", "--echo-max-words"):
        assert flag in text, flag
    bench = run_cli("lmdq_bench", "efficiency", "--help", env={**plugin_env, "COLUMNS": "200"})
    assert bench.returncode == 0 and b"--echo-slots" in bench.stdout, bench.stderr.decode()
    # --engine's choices are the registry's
    nope = run_cli("lmdq.worker", "--engine", "nope", env=plugin_env)
    choices = b"expected 'lmdeploy', 'transformers', 'sim' or 'echo', got 'nope'"
    assert nope.returncode == 2 and choices in nope.stderr, nope.stderr.decode()
    # without the entry point, the same flag is unknown: it came from the plug-in, nowhere else
    bare = run_cli("lmdq.worker", "--engine", "echo", "--echo-slots", "2", env={**plugin_env, "PYTHONPATH": ""})
    assert bare.returncode == 2 and b"--echo-slots" in bare.stderr, bare.stderr.decode()


def test_installed_as_a_plugin_it_serves_a_batch(tmp_path: Path, plugin_env: dict[str, str]) -> None:
    rows = [{"custom_id": f"r{i}", "prompt": f"say {i} back to me please"} for i in range(12)]
    rows[3] = {"custom_id": "r3", "messages": [{"role": "user", "content": "hello there"}]}
    rows[5] = {"custom_id": "r5", "prompt": "one two three four five six", "params": {"max_new_tokens": 2}}
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sub = run_cli("lmdq.producer", "submit", str(src), "--model", "echo", "--allow-unknown-model",
                  "--batch-size", "4", "--json", env=plugin_env)
    assert sub.returncode == 0, sub.stderr.decode()
    batch = json.loads(sub.stdout)
    log = tmp_path / "worker.log"
    w = start_worker("--engine", "echo", "--echo-slots", "5", "--echo-upper", "--burst",
                     env={**plugin_env, "LMDQ_ECHO_MAX_WORDS": "4"}, log=log)
    assert w.wait(120) == 0, log.read_text()
    started = [json.loads(x) for x in log.read_text().splitlines() if '"worker started"' in x]
    assert started and started[0]["capacity"] == 5  # the contract's capacity, from --echo-slots
    out = run_cli("lmdq.producer", "results", batch["id"], env=plugin_env)
    assert out.returncode == 0, out.stderr.decode()
    results = [Result.model_validate_json(x) for x in out.stdout.splitlines()]
    assert [r.custom_id for r in results] == [f"r{i}" for i in range(12)]
    assert all(r.status is ResultStatus.completed and r.backend == "echo" and r.model == "echo" for r in results)
    assert results[0].text == "SAY 0 BACK TO" and results[0].finish_reason.value == "length"  # env: 4 words
    assert results[3].text == "HELLO THERE" and results[3].finish_reason.value == "stop"
    assert results[5].text == "ONE TWO" and results[5].generate_token_len == 2  # the request's own limit
