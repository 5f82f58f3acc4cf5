"""How full an engine is kept (issue 27): the LMDeploy engine's ``engine occupancy`` events
(``occupancy_log_s``) and the e2e bench's per-batch reading of them, on CPU.

LMDeploy needs a GPU, so the pipeline is a stand-in with the one part the sampler reads: AsyncEngine's
``session_mgr.request_handle_pool.num_dispatched`` (a request holds one handle for its life in the engine).
"""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
import structlog

from lmdq_bench.occupancy import batch_occupancy, occupancy_events

WAIT_S = 30.0  # a bound on waiting for an event, never a measured duration


def _event(t: float, mean: float, lo: int = 0, hi: int = 0) -> str:
    return json.dumps({"event": "engine occupancy", "t": t, "in_engine_mean": mean, "in_engine_min": lo,
                       "in_engine_max": hi or int(mean)})


def test_a_batch_reads_the_windows_that_ended_inside_it() -> None:
    lines = ["not json", json.dumps({"event": "other", "t": 5.0}), _event(0.5, 99.0),
             *(_event(1.0 + i, m, hi=m + 2) for i, m in enumerate([100, 80, 100, 100, 100, 100, 100, 100, 100, 40]))]
    events = occupancy_events(lines)
    assert len(events) == 11
    occ = batch_occupancy(events, 1.0, 10.0)  # t in (1, 10]: the windows ending at 2..10, not 0.5 or 1.0
    assert occ == {"windows": 9, "mean": round((80 + 7 * 100 + 40) / 9, 1), "min_window": 40.0,
                   "p10_window": 40.0, "max": 102}
    assert batch_occupancy(events, 20.0, 30.0) is None


def test_the_engine_logs_the_requests_it_holds() -> None:
    pytest.importorskip("lmdeploy")
    from lmdeploy.messages import PytorchEngineConfig

    from lmdq.worker.engine_config import LMDeployConfig
    from lmdq.worker.engines.lmdeploy_engine import LMDeployEngine

    pool = SimpleNamespace(num_dispatched=0)
    pipe = SimpleNamespace(backend_config=PytorchEngineConfig(max_batch_size=64), async_engine=SimpleNamespace(),
                           session_mgr=SimpleNamespace(request_handle_pool=pool))
    with structlog.testing.capture_logs() as logs:
        eng = LMDeployEngine(pipe, LMDeployConfig(backend="pytorch", occupancy_log_s=0.2), model_name="m")
        try:
            pool.num_dispatched = 7
            seen = threading.Event()
            for _ in range(int(WAIT_S / 0.05)):
                if any(e["event"] == "engine occupancy" for e in list(logs)):
                    seen.set()
                    break
                seen.wait(0.05)
            assert seen.is_set()
        finally:
            eng._closed = True  # the sampler's loop ends with the engine (close() would close the stand-in)
    ev = next(e for e in logs if e["event"] == "engine occupancy")
    assert ev["in_engine_max"] == 7 and ev["capacity"] == 64 and ev["window_s"] == 0.2 and ev["samples"] >= 1
    assert 0 <= ev["in_engine_min"] <= ev["in_engine_mean"] <= 7 and isinstance(ev["t"], float)
