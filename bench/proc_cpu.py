"""CPU seconds of a process tree from /proc: where a batch's CPU went (the worker's own threads against
LMDeploy's engine process). Shared by the e2e bench and its raw-pipe child, so neither imports the other."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cpu_delta", "tree_cpu"]


def _proc_cpu(pid: int) -> float:
    """User + system CPU seconds of one process (/proc; 0.0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (the engine process, its compile workers), from /proc's ppid."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of a process (``main``) and of its descendants together (``children``): where a
    batch's CPU went, the worker's own threads against LMDeploy's engine process."""
    return {"main": round(_proc_cpu(pid), 2), "children": round(sum(_proc_cpu(c) for c in _descendants(pid)), 2)}


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before[k], 2) for k in before}
