"""`lmdq-bench` commands run end to end (small sizes, sim engine, real redis-server); numbers are printed,
never asserted as speed targets (docs/performance.md holds the measured ones)."""

from __future__ import annotations

import json

from tests.conftest import run_cli


def test_efficiency_prints_a_table_and_a_json_last_line(redis_url: str, env: dict[str, str]) -> None:
    p = run_cli("bench", "efficiency", "--engine", "sim", "--n", "64", "--batch-size", "8", "--sim-step-ms", "1",
                "--sim-max-batch", "32", "--input-len", "16", "--output-len", "8", "--stream-baseline",
                "--redis-url", redis_url, env=env, timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    lines = p.stdout.decode().strip().splitlines()
    assert any(ln.startswith("lmdq") for ln in lines[:-1]) and any(ln.startswith("naive") for ln in lines[:-1])
    last = json.loads(lines[-1])
    assert {"engine", "model", "n", "batch_size", "raw_tok_s", "lmdq_tok_s", "naive_tok_s", "ratio"} <= set(last)
    assert last["n"] == 64 and last["batch_size"] == 8 and last["engine"] == "sim"
    assert last["ratio"] == round(last["lmdq_tok_s"] / last["raw_tok_s"], 4)
    d = last["detail"]
    assert d["runs"]["lmdq"][0][1] == 64 * 8 and d["runs"]["naive"][0][1] == 64 * 8  # every token accounted for
    assert d["stream1_tok_s"] > 0 and d["lmdq_timelines"][0]["last_finish_s"] > 0
    # sim step counts: the raw call hands every request over at once, so no slot ever waits for one
    assert d["sim_empty_slot_steps"]["raw"] == [0] and len(d["sim_empty_slot_steps"]["lmdq"]) == 1


def test_producer_bench_reports_both_ways(redis_url: str, env: dict[str, str]) -> None:
    p = run_cli("bench", "producer", "--lines", "2000", "--batch-size", "50", "--redis-url", redis_url,
                env=env, timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    out = json.loads(p.stdout.decode().strip().splitlines()[-1])
    assert out["lines"] == 2000 and out["batch_size"] == 50
    for k in ("submit_req_s", "results_per_s", "results_openai_per_s", "submit_peak_rss_mib", "results_peak_rss_mib",
              "redis_bytes_per_queued_request", "redis_bytes_per_result"):
        assert out[k] > 0, k
