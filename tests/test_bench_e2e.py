"""``lmdq-bench e2e`` on the sim engine: the orchestration the GPU run relies on (a raw process, a real
lmdq-worker process that turns ready, one real lmdq-producer submit process per batch), checked on CPU.
The numbers themselves mean nothing here (the sim's raw side runs one stream call in-process)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_cli


def test_e2e_bench_runs_the_real_clis_and_reports_each_batch(tmp_path: Path, env: dict[str, str]) -> None:
    p = run_cli("lmdq.bench", "e2e", "--engine", "sim", "--sim-step-ms", "1", "--n", "40", "--batches", "2",
                "--batch-size", "8", "--min-input", "4", "--max-input", "12", "--min-output", "2", "--max-output", "6",
                "--workdir", str(tmp_path / "w"), "-o", str(tmp_path / "e2e.json"),
                "--lmdq-variant", "default", "--lmdq-variant", "small:SIM_MAX_BATCH=4", env=env, timeout=600)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    res = json.loads(p.stdout.decode().strip().splitlines()[-1])
    assert res == json.loads((tmp_path / "e2e.json").read_text())
    d = res["detail"]
    budget = d["max_new_tokens_sum"]
    for side in ("raw", "lmdq"):
        assert [b["batch"] for b in d[side]["batches"]] == [0, 1]
        assert all(b["tokens"] == budget and b["s"] > 0 for b in d[side]["batches"]), d[side]
    lm = d["lmdq"]
    assert all(b["results"] == 40 and b["not_completed"] == 0 for b in lm["batches"])
    assert all(0 <= b["first_visible_s"] <= b["s"] for b in lm["batches"]), lm["batches"]
    assert lm["worker_exit"] == 0 and lm["worker_log_lines"] > 0 and lm["worker_log_non_json"] == 0
    assert res["ratio_first"] == round(lm["batches"][0]["tok_s"] / d["raw"]["batches"][0]["tok_s"], 4)
    assert "first batch" in p.stdout.decode()
    assert (tmp_path / "w" / "workload.jsonl").read_text().count("\n") == 40
    # per batch, where the CPU went: the worker's own process and its engine processes (the sim has none)
    assert all(b["worker_cpu_s"] > 0 and b["engine_cpu_s"] >= 0 for b in lm["batches"]), lm["batches"]
    assert all(b["cpu_s"] >= 0 and b["engine_cpu_s"] == 0 for b in d["raw"]["batches"]), d["raw"]["batches"]
    # a second lmdq side against the same raw side, its worker started with the variant's settings
    v = d["variants"]
    assert list(v) == ["default", "small"] and v["small"]["env"] == {"LMDQ_SIM_MAX_BATCH": "4"}
    small = v["small"]["lmdq"]
    assert all(b["results"] == 40 and b["not_completed"] == 0 for b in small["batches"])
    started = [json.loads(ln) for ln in (tmp_path / "w" / "worker_small.log").read_text().splitlines()
               if '"worker started"' in ln]
    assert started and started[0]["capacity"] == 4, started
    assert v["small"]["ratio_first"] == round(small["batches"][0]["tok_s"] / d["raw"]["batches"][0]["tok_s"], 4)
    assert "lmdq[small]: first batch" in p.stdout.decode()
