"""lmdq.logs.tqdm_events: a tqdm bar becomes progress events and draws nothing on the terminal.

Run in a child process: :func:`install` patches tqdm for the whole process, which must not leak into
the other tests of this run."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, sys
import structlog
from structlog.testing import capture_logs
import tqdm, tqdm.auto
from lmdq.logs import tqdm_events

assert tqdm_events.install() is True
assert tqdm_events.install() is True  # idempotent: patched once
with capture_logs() as logs:
    for _ in tqdm.tqdm(range(7), desc="Loading weights", unit="shard"):
        pass
    bar = tqdm.auto.tqdm(total=3, desc="Warm up", disable=None)
    bar.update(3)
    bar.close()
    bar.close()  # a second close emits nothing more
    off = tqdm.tqdm(range(2), disable=True)
    list(off)
    off.close()
print(json.dumps([{k: v for k, v in e.items() if k in ("event", "done", "desc", "n", "total", "unit")}
                  for e in logs]))
"""


def test_bars_become_events_and_print_nothing() -> None:
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""  # no bar text, no carriage returns
    events = json.loads(p.stdout)
    assert all(e["event"] == "progress" for e in events)
    loading = [e for e in events if e["desc"] == "Loading weights"]
    warm = [e for e in events if e["desc"] == "Warm up"]
    assert len(loading) + len(warm) == len(events)  # the disabled bar emitted nothing
    assert loading[0]["done"] is False  # the first draw
    assert loading[-1] == {"event": "progress", "done": True, "desc": "Loading weights", "n": 7, "total": 7,
                           "unit": "shard"}
    assert [e["done"] for e in warm].count(True) == 1 and warm[-1]["n"] == 3
