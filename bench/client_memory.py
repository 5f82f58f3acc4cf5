"""The Python client's peak memory against the rows it submits (issue 44).

``python -m lmdq_bench.client_memory [--rows 200000 2000000]``: each (rows, source) in a fresh child process
against a throwaway redis-server; a generator of prompts (``Client.submit(rows())``: validated into a
spool, then the file pipeline) and, for comparison, the same prompts as a text file (the file pipeline
alone). Prints the child's peak RSS and the seconds the submit took; the LAST line is JSON.

What the numbers say (docs/python-api.md, "How a non-file source is submitted"): the spooling itself
keeps nothing per row (tests/test_client_memory.py), so a generator peaks where the same rows as a file
do; what still grows with the rows is the file pipeline's pass-1 state (src/lmdq/submission/submit.py:
two 8-byte hashes a request, and with prefix groups on an offset and a line number, 12 bytes more).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["measure", "main"]


def _child(n: int, kind: str, url: str) -> dict[str, float | int | str]:
    import lmdq
    from lmdq.client.client import Source
    from lmdq.submission.settings import ProducerSettings

    client = lmdq.Client(url, settings=ProducerSettings(redis_url=url, key_prefix=f"mem{n}{kind}"))
    client.register_models(["m"])

    def rows() -> Iterator[str]:
        for i in range(n):
            yield f"question number {i}: what comes after it?"

    with tempfile.TemporaryDirectory() as d:
        source: Source = rows()
        if kind == "file":
            path = Path(d) / "prompts.txt"
            with path.open("w") as f:
                f.writelines(f"question number {i}: what comes after it?\n" for i in range(n))
            source = path
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t = time.perf_counter()
        batch = client.submit(source, model="m", batch_size=64)
        took = time.perf_counter() - t
    assert batch.counts().total == n
    return {"rows": n, "source": kind, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_before_submit_mib": base / 1024, "submit_s": round(took, 1)}


def measure(rows: list[int], kinds: list[str]) -> list[dict[str, float | int | str]]:
    from lmdq_bench.local_redis import local_redis

    out = []
    with local_redis() as url:
        for n in rows:
            for kind in kinds:
                p = subprocess.run([sys.executable, "-m", "lmdq_bench.client_memory", "--child", str(n), kind, url],
                                   capture_output=True, text=True, check=True)
                res = json.loads(p.stdout.splitlines()[-1])
                print(f"{res['rows']:>10,} rows  {res['source']:<9}  peak RSS {res['peak_rss_mib']:6.1f} MiB  "
                      f"submit {res['submit_s']} s", flush=True)
                out.append(res)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[200_000, 2_000_000])
    ap.add_argument("--sources", nargs="+", default=["generator", "file"], choices=["generator", "file"])
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(int(a.child[0]), a.child[1], a.child[2])))
        return
    print(json.dumps(measure(a.rows, a.sources)))


if __name__ == "__main__":
    main()
