"""What the GPU itself did during each timed batch: SM clock, utilization, power, temperature.

Why: on the H200 the raw ``pipe()`` side of ``lmdq-bench e2e`` ran 21.3k, 17.7k and 16.6k tok/s on three
identical batches with the same engine CPU seconds (docs/performance.md, session 11), so something outside
both processes changed between batches. A clock that drops (power or thermal capping) or a GPU shared with
another tenant shows here; a steady clock with lower utilization points back at the host side.

``nvidia-smi --query-gpu ... -lms N`` runs beside the bench (one process, a reader thread stamping each line
with ``time.time()`` as it arrives, so windows need no clock conversion); :meth:`GpuMonitor.window` sums up
the samples between two timestamps. Where there is no ``nvidia-smi`` (CPU hosts, CI) the monitor is off and
every window is ``None``.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["FIELDS", "GpuMonitor", "GpuSample", "parse_line", "summarize"]

#: queried in this order; ``clocks_event_reasons.active`` is a bitmask (0 = not held back)
FIELDS = ("index", "clocks.sm", "clocks.mem", "utilization.gpu", "power.draw", "temperature.gpu",
          "clocks_event_reasons.active")


@dataclass(frozen=True)
class GpuSample:
    t: float
    index: int
    sm_mhz: float
    mem_mhz: float
    util_pct: float
    power_w: float
    temp_c: float
    reasons: int


def _num(s: str) -> float:
    s = s.strip()
    return float(s) if s and s not in ("[N/A]", "N/A", "[Not Supported]") else float("nan")


def parse_line(line: str, t: float) -> GpuSample | None:
    """One ``--format=csv,noheader,nounits`` line of :data:`FIELDS`; ``None`` for anything else (a header,
    an error line, a field the driver does not report as a number)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS) or not parts[0].isdigit():
        return None
    try:
        reasons = int(parts[6], 16) if parts[6].lower().startswith("0x") else int(parts[6])
    except ValueError:
        reasons = -1
    return GpuSample(t=t, index=int(parts[0]), sm_mhz=_num(parts[1]), mem_mhz=_num(parts[2]),
                     util_pct=_num(parts[3]), power_w=_num(parts[4]), temp_c=_num(parts[5]), reasons=reasons)


def _med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x == x]  # drop NaN
    return round(statistics.median(xs), 1) if xs else None


def summarize(samples: list[GpuSample]) -> dict[str, Any] | None:
    """Medians of clock, utilization and power, the hottest reading, and the throttle bitmasks seen."""
    if not samples:
        return None
    temps = [s.temp_c for s in samples if s.temp_c == s.temp_c]
    return {"samples": len(samples), "sm_mhz_median": _med([s.sm_mhz for s in samples]),
            "sm_mhz_min": min(s.sm_mhz for s in samples),
            "util_pct_median": _med([s.util_pct for s in samples]),
            "power_w_median": _med([s.power_w for s in samples]),
            "temp_c_max": max(temps) if temps else None,
            "event_reasons_seen": sorted({hex(s.reasons) for s in samples if s.reasons not in (0, -1)})}


class GpuMonitor:
    """``with GpuMonitor() as mon: ...; mon.window(t0, t1)``: samples every ``interval_ms`` on GPU ``gpu``."""

    def __init__(self, interval_ms: int = 250, gpu: int = 0, command: list[str] | None = None) -> None:
        exe = shutil.which("nvidia-smi")
        self._cmd = command or (self._nvidia_smi(exe, gpu, interval_ms) if exe else None)
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        self._samples: list[GpuSample] = []
        self._lock = threading.Lock()

    @staticmethod
    def _nvidia_smi(exe: str, gpu: int, interval_ms: int) -> list[str] | None:
        """The looping query, its fields checked by one plain query first: older drivers call the last
        field ``clocks_throttle_reasons.active`` (same bitmask), and a field the driver does not know
        makes nvidia-smi exit at once. None when neither form answers (no GPU visible)."""
        for last in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
            query = f"--query-gpu={','.join((*FIELDS[:-1], last))}"
            probe = subprocess.run([exe, f"--id={gpu}", query, "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, timeout=30)
            if probe.returncode == 0 and parse_line(probe.stdout.strip().splitlines()[0] if probe.stdout.strip()
                                                    else "", 0.0) is not None:
                return [exe, f"--id={gpu}", query, "--format=csv,noheader,nounits", f"--loop-ms={interval_ms}"]
        return None

    @property
    def enabled(self) -> bool:
        return self._cmd is not None

    def __enter__(self) -> GpuMonitor:
        if self._cmd is not None:
            self._proc = subprocess.Popen(self._cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                          text=True, bufsize=1)
            self._thread = threading.Thread(target=self._read, name="gpu-monitor", daemon=True)
            self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            s = parse_line(line, time.time())
            if s is not None:
                with self._lock:
                    self._samples.append(s)

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def sampling(self) -> bool:
        """Whether the sampler process runs (False before the ``with`` block and after it)."""
        return self._proc is not None and self._proc.poll() is None

    def samples(self) -> list[GpuSample]:
        """Every sample read so far, oldest first (a copy: the reader thread keeps appending)."""
        with self._lock:
            return list(self._samples)

    def window(self, start: float, end: float) -> dict[str, Any] | None:
        """The summary of the samples stamped within [start, end] (``time.time()`` values)."""
        with self._lock:
            got = [s for s in self._samples if start <= s.t <= end]
        return summarize(got)
