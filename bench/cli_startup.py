"""How long ``lmdq-producer`` spends importing before it does anything (issue 49: ``--help`` and
``status`` under 150 ms of imports).

Each case runs ``python -X importtime -m lmdq.producer ARGS`` in a child, several times, and reads
importtime's report: the import milliseconds of a run are the sum of the cumulative times of its
top-level imports after the interpreter's own start-up (``site`` and what it pulls: the same for any
Python program, reported apart as ``interpreter_ms``). That sum is CPU-bound work, so on a loaded
machine it moves less than the wall clock; each case also gives the child's CPU seconds and wall
seconds (the whole command: imports, option building, the Redis round trips), medians of the runs.

``status`` reads a real batch from a real Redis (a throwaway redis-server unless ``--redis-url``);
``--python`` measures another checkout's interpreter (its editable install), e.g. main before a change.

Bytecode is cached, as in an install (pip compiles it): the children may write ``__pycache__`` (a
``PYTHONDONTWRITEBYTECODE`` in the environment is dropped for them) and each case first runs once
uncounted. Without that, every lmdq module is compiled from source on every run (~20 ms more).
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: The cases: name -> the command line after ``lmdq-producer`` ("{batch}": a batch id in Redis).
CASES: dict[str, list[str]] = {
    "help": ["--help"],
    "status_help": ["status", "--help"],
    "status": ["status", "{batch}"],
}

#: What any typer + pydantic-settings CLI imports before a line of lmdq runs (the floor under the cases):
#: measured the same way, beside them.
FLOOR_CODE = "import typer, pydantic, pydantic.fields, pydantic_settings"

BAR_MS = 150.0
"""Issue 49's bar for ``--help`` and ``status``: import milliseconds (median)."""


@dataclass(frozen=True)
class Import:
    """One line of ``-X importtime``'s report."""

    name: str
    depth: int
    self_us: int
    cumulative_us: int


def parse_importtime(stderr: str) -> list[Import]:
    """Every ``import time:`` line, in order (``depth`` 0: imported by the program itself, not by a module)."""
    out = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or line.count("|") != 2 or "imported package" in line:
            continue
        self_us, cumulative_us, name = line.removeprefix("import time:").split("|")
        depth = (len(name) - len(name.lstrip(" ")) - 1) // 2
        out.append(Import(name.strip(), depth, int(self_us), int(cumulative_us)))
    return out


def split_startup(imports: list[Import]) -> tuple[list[Import], list[Import]]:
    """(the interpreter's own start-up imports, the program's): the program's begin after the last top-level
    ``site`` (Python imports site, and what site imports, before any program runs)."""
    start = 0
    for i, imp in enumerate(imports):
        if imp.depth == 0 and imp.name == "site":
            start = i + 1
    return imports[:start], imports[start:]


def import_ms(imports: list[Import]) -> float:
    """Milliseconds of the top-level imports: each nested import is inside its parent's cumulative time."""
    return sum(i.cumulative_us for i in imports if i.depth == 0) / 1000


def run_once(python: str, args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """One child: its import milliseconds (program and interpreter), CPU and wall seconds, return code.
    ``args`` follow ``-m lmdq.producer``; ``["-c", CODE]`` runs CODE instead (the floor)."""
    t0 = time.perf_counter()
    program = args if args[:1] == ["-c"] else ["-m", "lmdq.producer", *args]
    p = subprocess.Popen([python, "-X", "importtime", *program], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=300)
    wall = time.perf_counter() - t0  # the child's CPU seconds: run_case's RUSAGE_CHILDREN delta
    startup, program = split_startup(parse_importtime(err))
    return {"rc": p.returncode, "wall_s": wall, "imports_ms": import_ms(program), "interpreter_ms": import_ms(startup),
            "modules": sum(1 for _ in program), "top": sorted(((i.cumulative_us / 1000, i.name) for i in program
                                                              if i.depth == 0), reverse=True)[:8],
            "stdout": out, "stderr_tail": "\n".join(line for line in err.splitlines()
                                                    if not line.startswith("import time:"))[-500:]}


def run_case(python: str, args: list[str], env: dict[str, str], runs: int) -> dict[str, Any]:
    """``runs`` children of one case: the medians (and the spread) of what :func:`run_once` measures."""
    import resource

    run_once(python, args, env)  # warm-up, not counted: writes the bytecode an install would hold
    done = []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        r = run_once(python, args, env)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        r["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if r["rc"] != 0:
            raise RuntimeError(f"{' '.join(args)} exited {r['rc']}: {r['stderr_tail']}")
        done.append(r)
    ms = [r["imports_ms"] for r in done]
    median_run = sorted(done, key=lambda r: r["imports_ms"])[len(done) // 2]
    return {
        "args": args,
        "imports_ms_median": round(statistics.median(ms), 1),
        "imports_ms_min": round(min(ms), 1),
        "imports_ms_max": round(max(ms), 1),
        "imports_ms_runs": [round(m, 1) for m in ms],
        "interpreter_ms_median": round(statistics.median(r["interpreter_ms"] for r in done), 1),
        "cpu_s_median": round(statistics.median(r["cpu_s"] for r in done), 3),
        "wall_s_median": round(statistics.median(r["wall_s"] for r in done), 3),
        "modules_imported": median_run["modules"],
        "top_imports_ms": [[name, round(t, 1)] for t, name in median_run["top"]],
    }


def run_cli_startup(*, redis_url: str, python: str | None = None, runs: int = 7,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every case of :data:`CASES` ``runs`` times; ``status`` reads a batch made in Redis for it."""
    import redis

    from lmdq.contract import Batch, BatchStatus, RequestCounts
    from lmdq.redis.keys import Keys
    from lmdq.results.store import ResultStore

    prefix = f"bench{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    batch = f"batch_{uuid.uuid4().hex[:24]}"
    ResultStore(client, keys=Keys(prefix)).batches.create(Batch(
        id=batch, model="sim", status=BatchStatus.in_progress, batch_size=8,
        request_counts=RequestCounts(total=3, completed=1), created_at=time.time()))
    env = {**os.environ, "LMDQ_REDIS_URL": redis_url, "LMDQ_KEY_PREFIX": prefix, "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    py = python or sys.executable
    cases = {}
    try:
        for name, args in {**CASES, "floor": ["-c", FLOOR_CODE]}.items():
            argv = [a.replace("{batch}", batch) for a in args]
            cases[name] = run_case(py, argv, env, runs)
            c = cases[name]
            what = f"python -c '{FLOOR_CODE}'" if name == "floor" else f"lmdq-producer {' '.join(args)}"
            log(f"{name:12s} {what:30s} imports {c['imports_ms_median']:6.1f} ms median "
                f"(min {c['imports_ms_min']}, max {c['imports_ms_max']}; interpreter {c['interpreter_ms_median']} ms) "
                f"cpu {c['cpu_s_median']:.3f} s wall {c['wall_s_median']:.3f} s")
    finally:
        from lmdq.client.client import Client
        from lmdq.submission.settings import ProducerSettings

        # a --redis-url keeps nothing of the bench
        Client(settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix)).purge(batch, force=True)
    try:
        load = list(os.getloadavg())
    except OSError:
        load = []
    return {
        "bench": "cli-startup",
        "python": py,
        "python_version": platform.python_version(),
        "runs": runs,
        "bar_ms": BAR_MS,
        "floor_code": FLOOR_CODE,
        "meets_bar": all(cases[c]["imports_ms_median"] < BAR_MS for c in ("help", "status")),
        "cpus": os.cpu_count(),
        "loadavg_1_5_15": [round(x, 2) for x in load],
        "measure": "sum of -X importtime's cumulative us of the program's top-level imports (after site), "
                   "median of runs, bytecode cached (one uncounted warm-up run per case); cpu_s/wall_s: the "
                   "whole child",
        "cases": cases,
    }
