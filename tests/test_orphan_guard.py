"""No orphans (issue 13): a worker SIGKILLed takes its engine process tree with it.

tests/orphan_tree.py stands in for the worker: guard installed, then an "engine" spawn child, a "tp worker"
spawn grandchild and two plain ``sleep`` helpers below them (the torch compile workers' place). The real
thing on the GPU: tests/gpu/test_faults_gpu.py.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lmdq.worker.engines import orphan_guard

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "tests" / "orphan_tree.py"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc are Linux's")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _kill_leftovers(pids: dict[str, int]) -> None:
    """A failed test must not leave its tree running on the CI machine."""
    for pid in pids.values():
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def _start_tree(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    pids_file = tmp_path / "pids"
    p = subprocess.Popen([sys.executable, str(TREE), str(pids_file), *flags], cwd=ROOT)
    deadline = time.monotonic() + 180  # four interpreters start on two loaded cores
    while not pids_file.exists():
        assert p.poll() is None, f"the stand-in worker exited with {p.returncode}"
        assert time.monotonic() < deadline, "the process tree did not come up"
        time.sleep(0.05)
    pids = {name: int(pid) for name, pid in (line.split() for line in pids_file.read_text().splitlines())}
    return p, pids


def _kill_and_wait_all_gone(p: subprocess.Popen[bytes], pids: dict[str, int]) -> tuple[float, list[int]]:
    below = {c.pid for c in psutil.Process(p.pid).children(recursive=True)}
    assert set(pids.values()) <= below, (pids, below)
    assert not any(_gone(pid) for pid in below)
    t0 = time.monotonic()
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    deadline = t0 + 10  # the bound: every process of the worker's tree gone within 10 s
    while time.monotonic() < deadline and not all(_gone(pid) for pid in below):
        time.sleep(0.05)
    return time.monotonic() - t0, sorted(pid for pid in below if not _gone(pid))


def test_sigkilled_worker_leaves_no_process_behind(tmp_path: Path) -> None:
    p, pids = _start_tree(tmp_path)
    try:
        took, left = _kill_and_wait_all_gone(p, pids)
        assert left == [], f"left behind after {took:.1f} s: {left} of {pids}"
        print(f"\nall descendants gone {took:.2f} s after SIGKILL")
    finally:
        _kill_leftovers(pids)


def test_watchdog_alone_clears_the_tree_when_no_death_signal_was_set(tmp_path: Path) -> None:
    """Started from a helper thread (no PR_SET_PDEATHSIG: it fires when that THREAD ends) and no reaper:
    the engine's watchdog thread sees its parent gone and kills its group (the tp worker, the helpers)."""
    p, pids = _start_tree(tmp_path, "--no-reaper", "--from-thread")
    try:
        engine = psutil.Process(pids["engine"])
        assert engine.ppid() == p.pid  # the helper thread has ended; the engine still serves its parent
        assert os.getpgid(pids["engine"]) == pids["engine"] != os.getpgrp()  # its own group, not ours
        assert os.getpgid(pids["tp_helper"]) == pids["engine"]
        took, left = _kill_and_wait_all_gone(p, pids)
        assert left == [], f"left behind after {took:.1f} s: {left} of {pids}"
        print(f"\nall descendants gone {took:.2f} s after SIGKILL")
    finally:
        _kill_leftovers(pids)


@pytest.mark.parametrize("method", ["forkserver", "fork"])
def test_other_start_methods_are_guarded_too(tmp_path: Path, method: str) -> None:
    """A forkserver child's parent is the fork server, not the process that started it (Python 3.14's
    default start method): the guard must neither kill it at once nor leave it behind. A fork child
    inherits the worker's hook: it must set its own (its children stay in its group)."""
    p, pids = _start_tree(tmp_path, f"--{method}")
    try:
        assert (psutil.Process(pids["engine"]).ppid() == p.pid) is (method == "fork")
        assert os.getpgid(pids["tp_worker"]) == os.getpgid(pids["engine"]) == pids["engine"]
        took, left = _kill_and_wait_all_gone(p, pids)
        assert left == [], f"left behind after {took:.1f} s: {left} of {pids}"
        print(f"\nall descendants gone {took:.2f} s after SIGKILL")
    finally:
        _kill_leftovers(pids)


def test_reaper_kills_what_the_death_signal_cannot_reach(tmp_path: Path) -> None:
    """The engine dies at once by its parent-death signal (its watchdog with it); the plain `sleep` it
    started has no guard of its own: the reaper's group kill is what takes it down."""
    p, pids = _start_tree(tmp_path)
    try:
        reapers = [c for c in psutil.Process(p.pid).children() if c.pid not in pids.values()
                   and "reap_main" in " ".join(c.cmdline())]
        assert len(reapers) == 1 and os.getsid(reapers[0].pid) == reapers[0].pid  # its own session
        took, left = _kill_and_wait_all_gone(p, pids)
        assert left == [], f"left behind after {took:.1f} s: {left} of {pids}"
        print(f"\nall descendants gone {took:.2f} s after SIGKILL")
        assert _gone(reapers[0].pid)
    finally:
        _kill_leftovers(pids)


def test_teardown_kills_the_engine_groups_and_spares_the_worker(tmp_path: Path) -> None:
    """kill_groups (LMDeployEngine.close) takes down every process in the engine's group, the unguarded
    helpers included, and nothing in the worker's own group: the worker lives on."""
    p, pids = _start_tree(tmp_path, "--teardown")
    try:
        torn = tmp_path / "pids.torn"
        deadline = time.monotonic() + 60
        while not torn.exists():
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        assert pids["engine"] in {int(x) for x in torn.read_text().split()}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(_gone(pid) for pid in pids.values()):
            time.sleep(0.05)
        assert [name for name, pid in pids.items() if not _gone(pid)] == []
        assert p.poll() is None  # the stand-in worker itself is untouched
    finally:
        p.kill()
        p.wait(30)
        _kill_leftovers(pids)


def _noop() -> None:
    """A picklable target."""


def test_a_guarded_target_copied_in_the_parent_stays_inert() -> None:
    """Unpickling arms the guard, but only in a child: a copy made in the parent itself (its pid is the
    recorded parent pid) must not arm a watchdog that would kill the worker."""
    g = orphan_guard.GuardedTarget(_noop, os.getpid(), True, True, os.getpgrp())
    copy = pickle.loads(pickle.dumps(g))
    assert copy.target is _noop and copy.spec == g.spec
    assert orphan_guard._armed is False
    assert g.spec[0] == os.getpid() and g.spec[4] == os.getpgrp()


def test_descendants_walks_the_whole_tree() -> None:
    outer = subprocess.Popen(["sh", "-c", "sleep 1000 & wait"])
    try:
        deadline = time.monotonic() + 60
        while len(orphan_guard.descendants(outer.pid)) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        found = orphan_guard.descendants(os.getpid())
        assert outer.pid in found and set(orphan_guard.descendants(outer.pid)) <= set(found)
    finally:
        for pid in orphan_guard.descendants(outer.pid):
            os.kill(pid, signal.SIGKILL)
        outer.kill()
        outer.wait()
