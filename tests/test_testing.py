"""src/lmdq/testing.py, the public helpers for tests: jobs put in Redis as submit stages them are run by a
real worker, every request answered once; and no production module imports the helpers."""

from __future__ import annotations

import ast

import redis

from lmdq.contract import BatchStatus, ResultStatus
from lmdq.redis.keys import Keys
from lmdq.results.store import ResultStore
from lmdq.testing import enqueue_requests
from tests.conftest import ROOT, run_cli
from tests.helpers import results_of


def test_enqueued_requests_are_served_by_a_real_worker(client: redis.Redis, prefix: str,
                                                       env: dict[str, str]) -> None:
    bid = enqueue_requests(client, Keys(prefix), "sim", [{"prompt": f"q{i}"} for i in range(5)], batch_size=2)
    batch = ResultStore(client, keys=Keys(prefix)).batches.get(bid)  # queued at once: the ledger's one commit
    assert (batch.status, batch.num_jobs, batch.request_counts.total) == (BatchStatus.queued, 3, 5)
    p = run_cli("lmdq.worker", "--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "0", "--burst",
                env=env, timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    assert ResultStore(client, keys=Keys(prefix)).batches.get(bid).status is BatchStatus.completed
    results = results_of(client, prefix, bid)
    assert sorted(r.custom_id for r in results) == [f"r{i}" for i in range(5)]
    assert {r.status for r in results} == {ResultStatus.completed}


def _testing_imports(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
                 if isinstance(node, ast.ImportFrom) else [])
        if any(n == "lmdq.testing" or n.startswith("lmdq.testing.") for n in names):
            lines.append(node.lineno)
    return lines


def test_the_scan_finds_an_import_of_the_helpers() -> None:
    planted = ast.parse("import lmdq.testing\nfrom lmdq.testing import enqueue_batch\nfrom lmdq import contract\n"
                        "from lmdq import testing\n")
    assert _testing_imports(planted) == [1, 2, 4]


def test_production_code_never_imports_the_testing_helpers() -> None:
    importers = []
    for folder in ("src", "worker", "producer", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            importers += [f"{rel}:{line}" for line in _testing_imports(ast.parse(path.read_text(), rel))]
    assert importers == []
