"""Sim-engine worker processes for the benches that run a fleet (``lmdq-bench fleet``, ``lmdq-bench plan``):
one place that starts them, notices one that died (with its log's tail) and stops them all."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["SimWorkers"]

#: where child processes start: never inside the installed package, whose lmdq/redis/ would hide the
#: redis library from `python -m` (sys.path[0] is the working directory)
CHILD_CWD = tempfile.gettempdir()


class SimWorkers:
    """Worker processes (``python -m lmdq.worker --engine sim``), one log each in a temp folder.

    ``bench`` names the bench in errors; ``keep_logs`` leaves the folder behind on :meth:`stop`."""

    def __init__(self, bench: str, env: dict[str, str], *, prefix: str, keep_logs: bool = False) -> None:
        self.bench = bench
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        self.env = env
        self.keep_logs = keep_logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], name: str) -> None:
        """One more worker: ``args`` after ``--engine sim``; ``name`` + its number is its worker name."""
        i = len(self.procs)
        out = open(self.dir / f"worker{i}.log", "wb")  # noqa: SIM115 - closed with the process
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "lmdq.worker", "--engine", "sim", *args, "--health-port", "0",
             "--worker-name", f"{name}-{i}"],
            env=self.env, cwd=CHILD_CWD, stdout=out, stderr=out))

    def check(self) -> None:
        """RuntimeError with the log's tail when a worker has exited."""
        for i, p in enumerate(self.procs):
            if p.poll() is not None:
                tail = (self.dir / f"worker{i}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.bench} bench: worker {i} exited with {p.returncode}:\n{tail}")

    def stop(self) -> None:
        """SIGTERM each, then wait (a kill after 60 s)."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        if not self.keep_logs:
            shutil.rmtree(self.dir, ignore_errors=True)
