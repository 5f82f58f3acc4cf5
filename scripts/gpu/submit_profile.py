"""Where ``lmdq-producer submit`` spends its time on this host (issue 27: measure before choosing).

usage: python3 scripts/gpu/submit_profile.py WORKLOAD.jsonl OUT.txt

Against a throwaway redis-server: three plain submits (wall time each, the interpreter's start
included), one under ``-X importtime`` (the import tree, cumulative, top-level lmdq modules and
their heaviest children) and one under cProfile (the 25 heaviest functions by cumulative time:
imports, validation, staging). Everything goes to OUT.txt; the last lines printed are a summary.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _submit(env: dict[str, str], wl: str, *extra: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, *extra, "-m", "lmdq.producer", "submit", wl, "--model", "bench",
                        "--allow-unknown-model"], env=env, capture_output=True, text=True, timeout=300)
    return time.perf_counter() - t, p


def _import_tree(stderr: str, min_us: int = 20000) -> list[str]:
    rows = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, rest = line.split(":", 1)
        self_us, cum_us, name = rest.split("|")
        if not self_us.strip().isdigit():
            continue
        depth = (len(name) - len(name.lstrip())) // 2
        if int(cum_us) >= min_us and depth <= 4:
            rows.append(f"{int(cum_us) / 1e6:7.3f} s {'  ' * depth}{name.strip()}")
    return rows


def main() -> int:
    wl, out = sys.argv[1], Path(sys.argv[2])
    from lmdq_bench.local_redis import local_redis

    lines: list[str] = []
    with local_redis(None) as url:
        env = {**os.environ, "LMDQ_REDIS_URL": url}
        walls = []
        for _ in range(3):
            secs, p = _submit(env, wl)
            if p.returncode != 0:
                print(p.stderr[-2000:])
                return 1
            walls.append(secs)
        lines.append(f"plain submit of {wl}: " + ", ".join(f"{w:.2f} s" for w in walls))
        _, p = _submit(env, wl, "-X", "importtime")
        lines.append("-X importtime (cumulative, >= 20 ms):")
        lines += _import_tree(p.stderr)
        with tempfile.TemporaryDirectory() as d:
            prof = Path(d) / "submit.prof"
            secs, p = _submit(env, wl, "-m", "cProfile", "-o", str(prof))
            import pstats
            from io import StringIO

            buf = StringIO()
            pstats.Stats(str(prof), stream=buf).sort_stats("cumulative").print_stats(25)
            lines.append(f"cProfile ({secs:.2f} s wall):")
            lines += buf.getvalue().splitlines()
    out.write_text("\n".join(lines) + "\n")
    print(lines[0])
    for ln in lines:
        if any(k in ln for k in ("lmdq.producer.cli", "submit_file", "_validate", "enqueue", "run_cli")):
            print(ln[:160])
    return 0


if __name__ == "__main__":
    sys.exit(main())
