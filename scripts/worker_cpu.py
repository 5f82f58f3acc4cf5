"""The worker's own CPU per result, with nothing else in the way: sim engine (no decode time), a real
redis-server, one burst worker in this process.

Why: TurboMind runs inside the worker's process, so every millisecond of Python the worker spends per
result (claim, job decode, result scripts, release) is taken from the GIL that TurboMind's callbacks and
LMDeploy's event loop need; at 550 results/s (SmolLM2 chat on the H200) 0.45 ms/result is a quarter of
the GIL (docs/gpu-validation.md, "Session 14"). This prints that number on any machine, so a change to the
worker's per-result path can be measured without a GPU. Where the time goes: run it under
``py-spy record --gil -f raw -o gil.txt -- python scripts/worker_cpu.py``.

usage: python scripts/worker_cpu.py [--n 8192] [--tokens 8] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmdq.contract import GenerationParams  # noqa: E402
from lmdq.redis.keys import Keys  # noqa: E402
from lmdq.submission.submit import SubmitOptions, submit_file  # noqa: E402
from lmdq.worker.engines.sim import SimEngine  # noqa: E402
from lmdq.worker.runner import Worker  # noqa: E402
from lmdq.worker.settings import WorkerSettings  # noqa: E402
from tests.conftest import RedisServer  # noqa: E402


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8192, help="requests (chat lines)")
    ap.add_argument("--tokens", type=int, default=8, help="max_new_tokens each (the sim's own cost grows with it)")
    ap.add_argument("--batch-size", type=int, default=32, help="requests per job")
    a = ap.parse_args()
    srv = RedisServer().start()
    try:
        with tempfile.TemporaryDirectory() as d:
            f = Path(d) / "q.jsonl"
            f.write_text("".join(json.dumps({"custom_id": f"q{i}", "messages": [
                {"role": "user", "content": f"Question {i}: why is the sky blue on day {i}?"}]}) + "\n"
                for i in range(a.n)))
            client = redis.Redis.from_url(srv.url)
            opts = SubmitOptions(model="sim", batch_size=a.batch_size, allow_unknown_model=True,
                                 params=GenerationParams(max_new_tokens=a.tokens, do_sample=False))
            submit_file(f, opts, client=client, keys=Keys(), ttl_s=3600)
        s = WorkerSettings(redis_url=srv.url, burst=True, health_port=0, idle_wait_s=0)
        w = Worker(engine=SimEngine(model_name="sim", step_ms=0, max_batch=1024), client=client, settings=s)
        c0, t0 = _cpu_s(), time.monotonic()
        w.run()
        cpu, wall = _cpu_s() - c0, time.monotonic() - t0
        print(f"worker_cpu: {a.n:,} results in {wall:.2f} s, {cpu:.2f} CPU s (sim engine included): "
              f"{cpu / a.n * 1e6:,.0f} us CPU per result, {w.stats.get('results')} written")
    finally:
        srv.cleanup()


if __name__ == "__main__":
    main()
