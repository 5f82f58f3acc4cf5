"""Prefix-sharing throughput on N GPUs: N lmdq workers vs N raw processes each given 1/N of the file.

Issue #18's second comparison: the same shuffled document-QA file (:func:`lmdq_bench.prefix.make_workload`)
run two ways on N devices, one engine per device, engine settings from ``LMDQ_*`` env vars (the names the
worker reads):

* split: N processes (``python -m lmdq_bench.prefix_fleet part``), process i pinned to device i
  (``CUDA_VISIBLE_DEVICES``), each running one ``pipe(prompts)`` call on the i-th contiguous 1/N of the
  file. Each times its own call (engine start-up excluded); the split's rate is all tokens over the
  slowest part's time, as if the N calls started together.
* lmdq: N ``lmdq.worker`` processes, one per device, started and idle (blocked on their wake list) before
  the file is submitted through the real ``submit`` (prefix groups on); timed from the batch's commit to
  its last result.

Each child is its own entry point under ``if __name__ == "__main__"`` (LMDeploy's PyTorch engine spawns
processes). On a CPU the sim engine stands in (``--engine sim``), so the harness itself is tested.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmdq.contract import GenerationParams
from lmdq.redis.connection import connect
from lmdq.redis.keys import Keys
from lmdq.results.store import ResultStore
from lmdq.submission.submit import SubmitOptions, submit_file
from lmdq_bench.efficiency import EfficiencyConfig, run_raw
from lmdq_bench.fleet import blocked_clients, wait_until
from lmdq_bench.prefix import PrefixConfig

__all__ = ["run_split_and_fleet"]

PREFIX = "benchprefixfleet"
MODEL = "bench"
#: where child processes start: never inside the installed package, whose lmdq/redis/ would hide the
#: redis library from `python -m` (sys.path[0] is the working directory)
CHILD_CWD = tempfile.gettempdir()


def _prompts(workload: Path) -> list[str]:
    return [str(json.loads(line)["prompt"]) for line in workload.read_text().splitlines() if line.strip()]


def _part(prompts: list[str], i: int, parts: int) -> list[str]:
    """The i-th contiguous 1/parts of the file ("each given half of the file")."""
    n = len(prompts)
    return prompts[i * n // parts:(i + 1) * n // parts]


def _device_env(base: dict[str, str], i: int, engine: str) -> dict[str, str]:
    return {**base, "CUDA_VISIBLE_DEVICES": str(i)} if engine == "lmdeploy" else dict(base)


def run_split_and_fleet(cfg: PrefixConfig, *, workers: int, engine: str, env: dict[str, str], workload: Path,
                        redis_url: str, log: Callable[[str], None] = print, timeout_s: float = 1800.0
                        ) -> dict[str, Any]:
    """Both runs; ``env`` holds the engine's ``LMDQ_*`` settings (engine, model, backend, cache size...)."""
    base = {**os.environ, **env, "PYTHONUNBUFFERED": "1", "LMDQ_LOG_FORMAT": "json"}
    tmp = Path(tempfile.mkdtemp(prefix="lmdq-prefix-fleet-"))
    # 1. split: N raw processes at once, one per device
    procs = []
    for i in range(workers):
        out = open(tmp / f"part{i}.out", "wb")  # noqa: SIM115 - closed with the process
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "lmdq_bench.prefix_fleet", "part", str(workload), str(i), str(workers),
             str(cfg.output_len)], env=_device_env(base, i, engine), cwd=CHILD_CWD, stdout=out,
            stderr=open(tmp / f"part{i}.log", "wb")), out))  # noqa: SIM115
    parts = []
    for i, (p, out) in enumerate(procs):
        rc = p.wait(timeout_s)
        out.close()
        text = (tmp / f"part{i}.out").read_text().strip().splitlines()
        if rc != 0 or not text:
            raise RuntimeError(f"raw part {i} exited {rc}: see {tmp / f'part{i}.log'}")
        parts.append(json.loads(text[-1]))
    split_s = max(x["s"] for x in parts)
    split_tokens = sum(x["tokens"] for x in parts)
    log(f"split: {workers} raw processes, {split_tokens:,} tokens, slowest part {split_s:.2f} s")
    # 2. lmdq: N workers, idle before the submit
    client = connect(redis_url)
    wenv = {**base, "LMDQ_REDIS_URL": redis_url, "LMDQ_KEY_PREFIX": PREFIX, "LMDQ_SERVED_MODEL_NAME": MODEL,
            "LMDQ_HEALTH_PORT": "0", "LMDQ_PARTIAL_INTERVAL_S": "3600"}
    ws = []
    try:
        for i in range(workers):
            log_f = open(tmp / f"worker{i}.log", "wb")  # noqa: SIM115 - closed with the process
            ws.append(subprocess.Popen([sys.executable, "-m", "lmdq.worker", "--worker-name", f"prefix-{i}"],
                                       env=_device_env(wenv, i, engine), cwd=CHILD_CWD, stdout=log_f, stderr=log_f))

        def ready() -> bool:
            for i, w in enumerate(ws):
                if w.poll() is not None:
                    raise RuntimeError(f"worker {i} exited {w.returncode}: see {tmp / f'worker{i}.log'}")
            return blocked_clients(client) >= workers

        wait_until(ready, timeout_s, f"{workers} workers to load their engines and block on their wake list")
        opts = SubmitOptions(model=MODEL, batch_size=cfg.batch_size, allow_unknown_model=True,
                             params=GenerationParams(max_new_tokens=cfg.output_len, ignore_eos=True, do_sample=False))
        batch, _ = submit_file(workload, opts, client=client, keys=Keys(PREFIX), ttl_s=3600)
        store = ResultStore(client, keys=Keys(PREFIX))
        wait_until(lambda: store.batches.get(batch.id).status.terminal, timeout_s, "the batch")
        b = store.batches.get(batch.id)
        assert b.request_counts.completed == cfg.n, b.request_counts
        toks = sum(json.loads(raw)["generate_token_len"] for _, raw in store.iter_results(batch.id, cfg.n) if raw)
        lmdq_s = (b.completed_at or 0) - (b.queued_at or 0)
    finally:
        for w in ws:
            w.terminate()
        for w in ws:
            try:
                w.wait(60)
            except subprocess.TimeoutExpired:
                w.kill()
    log(f"lmdq: {workers} workers, {toks:,} tokens in {lmdq_s:.2f} s")
    # The ratio of the two rates as printed (as the fleet bench's efficiency is), so the table reads
    # consistently: from the unrounded rates it could differ in the 4th decimal (a CI run saw 1.0817
    # beside printed rates whose ratio is 1.0818).
    split_tok_s, lmdq_tok_s = round(split_tokens / split_s, 1), round(toks / lmdq_s, 1)
    return {"workers": workers, "split_tok_s": split_tok_s, "lmdq_tok_s": lmdq_tok_s,
            "ratio": round(lmdq_tok_s / split_tok_s, 4), "split_parts": parts,
            "lmdq": {"s": round(lmdq_s, 3), "tokens": toks}, "logs": str(tmp)}


def _part_main(workload: str, i: int, parts: int, output_len: int) -> None:
    """A raw part: the engine the env names, a short warm-up, then one call on part i of the file."""
    from lmdq.worker.engine_factory import build_engine
    from lmdq.worker.settings import load_worker_settings

    eng = build_engine(load_worker_settings())
    prompts = _part(_prompts(Path(workload)), i, parts)
    cfg = EfficiencyConfig(n=len(prompts), output_len=output_len)
    run_raw(eng, prompts[:8], EfficiencyConfig(n=min(8, len(prompts)), output_len=4))  # graphs, allocator
    secs, toks = run_raw(eng, prompts, cfg)
    eng.close()
    print(json.dumps({"part": i, "n": len(prompts), "s": round(secs, 3), "tokens": toks}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "part":
        _part_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        sys.exit("usage: python -m lmdq_bench.prefix_fleet part WORKLOAD I PARTS OUTPUT_LEN")
