"""Per batch, how full a benchmark side kept its engine: the ``engine occupancy`` log events
(``--occupancy-log-s``, :meth:`lmdq.worker.engines.lmdeploy_engine.LMDeployEngine._log_occupancy`) that fall
inside the batch's wall-clock window.

Why: lmdq's TurboMind side slowed batch after batch while raw ``pipe()`` did not (session 16), and tokens/s
alone cannot say whether its engine decoded slower or was handed fewer requests. Both sides log the same
event from the same engine class, so their numbers compare directly.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["batch_occupancy", "occupancy_events"]


def occupancy_events(lines: list[str]) -> list[dict[str, Any]]:
    """The ``engine occupancy`` events of a JSON log, in order (other lines, JSON or not, skipped)."""
    out = []
    for ln in lines:
        try:
            d = json.loads(ln)
        except ValueError:
            continue
        if isinstance(d, dict) and d.get("event") == "engine occupancy" and isinstance(d.get("t"), (int, float)):
            out.append(d)
    return out


def batch_occupancy(events: list[dict[str, Any]], start: float, end: float) -> dict[str, Any] | None:
    """The windows that ended inside ``start..end``: their mean of means, the lowest and the 10th percentile of
    the window means (how short of work the engine ran at its emptiest), and the highest count seen."""
    inside = [e for e in events if start < float(e["t"]) <= end]
    if not inside:
        return None
    means = sorted(float(e["in_engine_mean"]) for e in inside)
    return {"windows": len(inside), "mean": round(sum(means) / len(means), 1), "min_window": means[0],
            "p10_window": means[len(means) // 10], "max": max(int(e["in_engine_max"]) for e in inside)}
