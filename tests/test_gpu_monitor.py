"""bench/gpu_monitor.py: the per-batch GPU readings ``lmdq-bench e2e`` records. The parser on lines in the
format nvidia-smi writes (``--format=csv,noheader,nounits``, driver 580 on the H200), and the monitor's
process and windows with a real child process standing in for nvidia-smi (none on CPU hosts)."""

from __future__ import annotations

import shutil
import sys
import time

import pytest

from lmdq_bench.gpu_monitor import FIELDS, GpuMonitor, parse_line, summarize

H200_LINE = "0, 1980, 3201, 97, 612.45, 54, 0x0000000000000000"


def test_parse_line_reads_each_field_and_refuses_other_lines() -> None:
    s = parse_line(H200_LINE, 12.5)
    assert s is not None and (s.t, s.index, s.sm_mhz, s.mem_mhz, s.util_pct, s.power_w, s.temp_c, s.reasons) == (
        12.5, 0, 1980.0, 3201.0, 97.0, 612.45, 54.0, 0)
    assert parse_line("0, 1755, 3201, 88, [N/A], 61, 0x0000000000000004", 1.0).reasons == 4  # type: ignore[union-attr]
    assert parse_line("index, clocks.current.sm [MHz], ...", 1.0) is None
    assert parse_line("Field \"clocks_event_reasons.active\" is not a valid field to query.", 1.0) is None
    assert parse_line("0, 1980, 3201", 1.0) is None
    assert len(FIELDS) == len(H200_LINE.split(","))


def test_summarize_gives_medians_minimum_clock_hottest_reading_and_reasons() -> None:
    lines = ["0, 1980, 3201, 97, 600, 50, 0x0", "0, 1500, 3201, 95, 700, 58, 0x4", "0, 1980, 3201, 99, 650, 55, 0x0"]
    got = summarize([s for i, x in enumerate(lines) if (s := parse_line(x, float(i))) is not None])
    assert got == {"samples": 3, "sm_mhz_median": 1980.0, "sm_mhz_min": 1500.0, "util_pct_median": 97.0,
                   "power_w_median": 650.0, "temp_c_max": 58.0, "event_reasons_seen": ["0x4"]}
    assert summarize([]) is None


def test_monitor_windows_split_what_a_running_sampler_printed() -> None:
    """A child prints one sample line every 20 ms, then waits to be terminated; windows are cut from the
    timestamps the reader recorded (no sleeps to race: the window bounds come from the samples themselves)."""
    script = ("import sys,time\n"
              "for i in range(30):\n"
              "    print(f'0, {1000 + i}, 3201, 90, 600, 50, 0x0', flush=True); time.sleep(0.02)\n"
              "time.sleep(600)\n")
    mon = GpuMonitor(command=[sys.executable, "-c", script])
    assert mon.enabled
    with mon:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(mon.samples()) < 30:
            time.sleep(0.01)
        assert mon.sampling
        samples = mon.samples()
        assert len(samples) == 30
        whole = mon.window(samples[0].t, samples[-1].t)
        second_half = mon.window(samples[15].t, samples[-1].t)
    assert whole is not None and whole["samples"] == 30 and whole["sm_mhz_min"] == 1000.0
    assert second_half is not None and second_half["sm_mhz_min"] >= 1015.0
    assert mon.window(samples[-1].t + 1, samples[-1].t + 2) is None
    assert not mon.sampling  # the sampler is gone after the block


def test_without_nvidia_smi_the_monitor_is_off() -> None:
    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU host: nvidia-smi is there")
    with GpuMonitor() as mon:
        assert not mon.enabled and mon.window(0.0, time.time()) is None
