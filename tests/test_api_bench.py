"""bench/api_bench.py runs end to end on a small size and prints its table and a JSON last line
(the 200 MB / 50-client numbers come from running it by hand: see its docstring)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_api_bench_prints_rss_and_poll_numbers(redis_url: str) -> None:
    p = subprocess.run([sys.executable, "-m", "lmdq_bench", "api", "--upload-mb", "2", "--clients", "5",
                        "--polls", "3", "--submit", "--redis-url", redis_url],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.strip().splitlines()
    res = json.loads(lines[-1])
    assert res["upload_bytes"] >= 2_000_000 and res["server_peak_rss_mb"] > 0
    assert res["poll_requests"] == 15 and res["poll_errors"] == 0 and res["poll_statuses"] == ["in_progress"]
    assert res["submit_status"] == "in_progress" and res["submit_requests"] == res["upload_lines"]
    assert any(line.startswith("peak RSS") for line in lines)
    assert all(len(line) <= 80 for line in lines[:-1])  # the table reads at 80 columns
