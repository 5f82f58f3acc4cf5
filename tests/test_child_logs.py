"""LMDeploy's engine process (``enable_mp_engine``: a ``spawn`` child) logs JSON like the worker.

The real engine needs a GPU; the stand-in (tests/mp_child.py) is started the same way LMDeploy 0.18
starts it (``torch.multiprocessing.get_context('spawn').Process``) and logs through LMDeploy's own
``get_logger``. Without :func:`lmdq.logs.config.route_child_logs` its lines are LMDeploy's colour text on
stdout (the control case below), with it every line of both processes is one JSON object."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT

_SCRIPT = """
import logging, sys
import torch.multiprocessing as mp
from lmdq.logs.config import configure_logging, get_logger, route_child_logs
from tests.mp_child import engine_like

if __name__ == "__main__":
    configure_logging("json", "INFO")
    if sys.argv[1] == "route":
        route_child_logs("json", "INFO")
    p = mp.get_context("spawn").Process(target=engine_like, args=(logging.INFO,), name="mp_engine_proc")
    p.start()
    p.join(120)
    get_logger("lmdq.worker").info("parent done", child_exit=p.exitcode)
"""


def _run(mode: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMDQ_CHILD_")}
    p = subprocess.run([sys.executable, "-c", _SCRIPT, mode], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    return [x for x in (p.stdout + p.stderr).splitlines() if x.strip()]


def test_spawned_engine_process_logs_json_lines() -> None:
    lines = _run("route")
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"a line that is not JSON: {line!r}\nall: {lines}") from None
    assert all({"level", "event", "logger", "timestamp"} <= r.keys() for r in records), records
    by_event = {r["event"]: r for r in records}
    parent = by_event["parent done"]
    assert parent["child_exit"] == 0
    for event, level, logger in (("child: engine info", "info", "lmdeploy"),
                                 ("child: engine warning", "warning", "lmdeploy"),
                                 ("child: lmdq module warning", "warning", "lmdq.worker.engines.stub")):
        r = by_event.get(event)
        assert r is not None, f"{event!r} missing (INFO dropped?): {records}"
        assert (r["level"], r["logger"]) == (level, logger)
        assert isinstance(r.get("pid"), int) and r["pid"] != os.getpid()  # the child's lines say whose they are


def test_without_routing_the_child_prints_lmdeploys_text() -> None:
    """The control: the same child without the hook writes non-JSON lines (what issue #19 saw)."""
    lines = _run("plain")
    plain = [x for x in lines if not x.lstrip().startswith("{")]
    assert any("child: engine warning" in x for x in plain), lines
