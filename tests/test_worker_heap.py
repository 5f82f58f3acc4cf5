"""The worker freezes its heap once start-up is over (lmdq.worker.heap): a real ``lmdq-worker`` process (sim
engine, burst, real redis-server) says so in its log, with its engine in process and in a child of its own,
where the child freezes its own heap after its warm-up."""

from __future__ import annotations

import gc
import json

import pytest

from lmdq.worker.heap import freeze_heap
from tests.conftest import run_cli


def test_freezing_moves_the_live_heap_out_of_the_collectors_sight() -> None:
    try:
        kept = [[] for _ in range(1000)]  # lists: tracked by the collector (a bare object() is not)
        n = freeze_heap()
        assert n >= len(kept)
        # Not an equality with gc.get_freeze_count(): other threads of this process (pytest-xdist's) may free
        # frozen objects meanwhile, which lowers the count. What must hold: none of ours is in a generation.
        in_sight = {id(o) for g in (0, 1, 2) for o in gc.get_objects(generation=g)}
        assert not in_sight & {id(k) for k in kept}
    finally:
        gc.unfreeze()  # this test process goes on making and dropping objects


@pytest.mark.parametrize("where", [[], ["--engine-process"]])
def test_the_worker_freezes_its_heap_after_start_up(env: dict[str, str], where: list[str]) -> None:
    # an internal: logged at debug level (issue 45)
    p = run_cli("lmdq.worker", "--engine", "sim", "--burst", *where, env={**env, "LMDQ_LOG_LEVEL": "DEBUG"})
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    frozen = [json.loads(ln) for ln in p.stderr.decode().splitlines() if '"heap frozen"' in ln]
    assert len(frozen) == (2 if where else 1), p.stderr.decode()[-2000:]  # the child's own, with a child
    assert all(int(e["objects"]) > 10_000 for e in frozen)
