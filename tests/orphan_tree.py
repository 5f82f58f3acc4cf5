"""A stand-in worker for tests/test_orphan_guard.py: installs the orphan guard, then starts an "engine"
child (multiprocessing spawn, as LMDeploy does), which starts a "tp worker" grandchild (spawn) and a plain
``sleep`` subprocess; the grandchild starts one more ``sleep``. Writes every pid, one per line, to the file
named by argv[1] once all are running, then waits to be killed.

usage: python tests/orphan_tree.py PIDS_FILE [--no-reaper] [--from-thread] [--forkserver|--fork] [--teardown]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time


def tp_worker(q: mp.Queue) -> None:  # type: ignore[type-arg]
    helper = subprocess.Popen(["sleep", "1000"])
    q.put(("tp_worker", os.getpid()))
    q.put(("tp_helper", helper.pid))
    time.sleep(1000)


def engine(q: mp.Queue, method: str) -> None:  # type: ignore[type-arg]
    ctx = mp.get_context(method)  # (a queue of one context cannot go to a process of another)
    p = ctx.Process(target=tp_worker, args=(q,), name="tp-worker")
    p.start()
    helper = subprocess.Popen(["sleep", "1000"])
    q.put(("engine", os.getpid()))
    q.put(("engine_helper", helper.pid))
    time.sleep(1000)


def main() -> None:
    from lmdq.worker.engines import orphan_guard

    out = sys.argv[1]
    orphan_guard.install(reaper="--no-reaper" not in sys.argv)
    method = next((m for m in ("forkserver", "fork") if f"--{m}" in sys.argv), "spawn")
    ctx = mp.get_context(method)
    q = ctx.Queue()
    proc = ctx.Process(target=engine, args=(q, method), name="engine")
    if "--from-thread" in sys.argv:  # no parent-death signal then: the watchdog alone must do it
        t = threading.Thread(target=proc.start)
        t.start()
        t.join()
    else:
        proc.start()
    pids = dict(q.get(timeout=120) for _ in range(4))
    with open(out + ".tmp", "w") as f:
        f.write("".join(f"{name} {pid}\n" for name, pid in sorted(pids.items())))
    os.replace(out + ".tmp", out)
    if "--teardown" in sys.argv:  # what LMDeployEngine.close() does after LMDeploy's own close
        orphan_guard.kill_groups(orphan_guard.tracked_groups())
        with open(out + ".torn", "w") as f:
            f.write("".join(f"{pgid}\n" for pgid in sorted(orphan_guard.tracked_groups())))
    time.sleep(1000)


if __name__ == "__main__":
    main()
