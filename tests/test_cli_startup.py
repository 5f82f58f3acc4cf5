"""``lmdq-producer`` starts with only what the command needs (issue 49): ``--help`` and a command's
``--help`` import no Redis client, no rich, no structlog, no data or HTTP library and nothing of the
worker; ``status BATCH`` imports redis-py (it reads Redis) and still none of the rest, structlog included.

Deterministic: it reads the names ``python -X importtime`` lists (every module the process imported,
in order), never a clock. The milliseconds are ``lmdq-bench cli-startup``'s (evidence/issue49)."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
from conftest import ROOT

from lmdq.contract import Batch, BatchStatus, RequestCounts
from lmdq.redis.keys import Keys
from lmdq.results.store import ResultStore

#: Never imported by ``--help`` (a module or any of its submodules).
HEAVY = ("redis", "rq", "rich", "structlog", "prometheus_client", "orjson", "pyarrow", "pandas", "polars",
         "numpy", "httpx", "fastapi", "uvicorn", "starlette", "torch", "transformers", "lmdeploy", "fsspec",
         "lmdq.worker", "lmdq.client.client", "lmdq.redis", "lmdq.results", "lmdq.jobs", "lmdq.logs.config",
         "lmdq.metrics.exporter", "lmdq.registry.store", "lmdq.submission.submit", "lmdq.submission.formats")
#: Not imported by ``status BATCH`` either: it needs the client and Redis, not a data, HTTP or GPU stack, and
#: it logs nothing (structlog comes with the first log line: lmdq.logs.config's deferred set-up).
NEVER = ("structlog", "pyarrow", "pandas", "polars", "numpy", "httpx", "fastapi", "uvicorn", "starlette", "torch",
         "transformers", "lmdeploy", "fsspec", "lmdq.worker", "lmdq.metrics.exporter", "prometheus_client")


def imported(stderr: str) -> list[str]:
    """Every module name in ``-X importtime``'s report, in import order."""
    return [line.split("|")[2].strip() for line in stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2 and "imported package" not in line]


def hits(modules: list[str], banned: tuple[str, ...]) -> list[str]:
    return sorted({b for b in banned for m in modules if m == b or m.startswith(b + ".")})


def run_importtime(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    p = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    return p, imported(p.stderr)


def test_the_scan_sees_a_heavy_import() -> None:
    """The check below can fail: the client module (the CLI's old start-up import) is seen pulling redis."""
    p, modules = run_importtime("-c", "import lmdq.client.client")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "lmdq.client.client" in modules and {"redis", "rq"} <= set(hits(modules, HEAVY)), modules


@pytest.mark.parametrize("args", [["--help"], ["status", "--help"], ["submit", "--help"], ["results", "--help"],
                                  ["models", "add", "--help"], ["exporter", "--help"]],
                         ids=" ".join)
def test_help_imports_nothing_heavy(args: list[str]) -> None:
    p, modules = run_importtime("-m", "lmdq.producer", *args)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Usage:" in p.stdout and "lmdq.producer.cli" in modules
    assert hits(modules, HEAVY) == [], f"{' '.join(args)} imported {hits(modules, HEAVY)}"


def test_status_imports_the_client_and_nothing_else_heavy(redis_url: str, prefix: str, env: dict[str, str]) -> None:
    store = ResultStore(redis.Redis.from_url(redis_url), keys=Keys(prefix))
    bid = f"batch_{uuid.uuid4().hex[:24]}"
    store.batches.create(Batch(id=bid, model="sim", status=BatchStatus.queued, batch_size=8,
                               request_counts=RequestCounts(total=3), created_at=time.time()))
    p, modules = run_importtime("-m", "lmdq.producer", "status", bid, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith(f"{bid}  queued  model=sim  total=3"), p.stdout
    assert "redis" in modules and "lmdq.client.client" in modules  # it did talk to Redis, through the client
    assert hits(modules, NEVER) == [], f"status imported {hits(modules, NEVER)}"


def test_a_piped_submit_imports_no_rich(env: dict[str, str], tmp_path: Path) -> None:
    """A scripted submit (stderr not a terminal: no bar to draw) never imports rich: its start is the time
    before the first job is visible (issue 48's image e2e, issue 49); on a terminal the bars still draw
    (tests/test_cli_terminal.py::test_submit_on_a_terminal_draws_its_bars_and_a_pipe_gets_none)."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"custom_id": "a", "prompt": "x"}\n{"custom_id": "b", "prompt": "y"}\n')
    p, modules = run_importtime("-m", "lmdq.producer", "submit", str(f), "--model", "sim", "--allow-unknown-model",
                                env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().startswith("batch_") and "lmdq.client.client" in modules
    assert hits(modules, ("rich",)) == [], f"submit imported {hits(modules, ('rich',))}"
