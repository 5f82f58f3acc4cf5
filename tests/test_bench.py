"""`lmdq-bench` commands run end to end (small sizes, sim engine, real redis-server); numbers are printed,
never asserted as speed targets (docs/performance.md holds the measured ones)."""

from __future__ import annotations

import json

import pytest

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
    # two clocks: from the submit's start (parse and staging included) lmdq can only be slower
    assert last["ratio_from_submit"] == round(last["lmdq_from_submit_tok_s"] / last["raw_tok_s"], 4)
    assert 0 < last["lmdq_from_submit_tok_s"] <= last["lmdq_tok_s"]
    assert any(ln.strip().startswith("from submit") for ln in lines[:-1])
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


def test_producer_bench_tabular_reports_parquet_and_jsonl_side_by_side(redis_url: str, env: dict[str, str]) -> None:
    pytest.importorskip("pyarrow")
    p = run_cli("bench", "producer", "--lines", "0", "--tabular-rows", "3000", "--batch-size", "50", "--redis-url",
                redis_url, env=env, timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    out = json.loads(p.stdout.decode().strip().splitlines()[-1])["tabular"]
    assert out["rows"] == 3000 and out["results_parquet_order_and_ids_checked"] is True
    for k in ("submit_jsonl_rows_s", "submit_parquet_rows_s", "parquet_rate_vs_jsonl", "submit_jsonl_peak_rss_mib",
              "submit_parquet_peak_rss_mib", "results_parquet_per_s", "results_parquet_peak_rss_mib"):
        assert out[k] > 0, k
    assert "submit Parquet :" in p.stderr.decode() and "x JSONL's rate" in p.stderr.decode()


def test_fleet_bench_reports_rates_costs_and_idle_cost() -> None:
    """Tiny fleet on the bench's own redis-server: every number is there and consistent (none is a target)."""
    import os

    p = run_cli("bench", "fleet", "--workers", "2", "--capacity", "16", "--batch-size", "4", "--rounds", "2",
                "--output-len", "4", "--decode-step-ms", "2", "--idle-workers", "3", "--poll-workers", "1",
                "--idle-window", "2", env=dict(os.environ), timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    lines = p.stdout.decode().strip().splitlines()
    assert all(len(ln) <= 80 for ln in lines[:-1]), lines[:-1]
    assert any(ln.startswith("fleet ") for ln in lines[:-1])
    out = json.loads(lines[-1])
    one, fleet = out["runs"]
    assert (one["workers"], one["requests"], fleet["workers"], fleet["requests"]) == (1, 32, 2, 64)
    assert fleet["efficiency"] == round(fleet["req_s"] / (2 * one["req_s"]), 4)
    for r in (one, fleet):
        assert r["req_s"] > 0 and r["redis_cpu_us_per_req"] > 0 and r["commands_per_req"] > 1
    assert out["bytes_per_queued"] > 0 and out["bytes_per_running"] > 0 and out["bytes_per_completed"] > 0
    assert out["idle_blocking"]["workers"] == 3 and out["idle_polling"]["workers"] == 1
    # polling costs commands every poll_interval_s; blocking workers cost a handful per idle_wait_s
    assert out["idle_polling"]["commands_per_s"] > out["idle_blocking"]["commands_per_s"]


def test_prefix_bench_runs_on_the_sim_and_writes_its_workload(redis_url: str, env: dict[str, str],
                                                              tmp_path) -> None:  # type: ignore[no-untyped-def]
    wl = tmp_path / "wl.jsonl"
    p = run_cli("bench", "prefix", "--engine", "sim", "--docs", "10", "--doc-tokens", "200", "--questions", "4",
                "--output-len", "4", "--batch-size", "8", "--sim-step-ms", "1", "--workload", str(wl),
                "--redis-url", redis_url, env=env, timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    lines = p.stdout.decode().strip().splitlines()
    assert any(ln.startswith("raw") for ln in lines[:-1]) and any(ln.startswith("lmdq") for ln in lines[:-1])
    last = json.loads(lines[-1])
    assert last["n"] == 40 and last["ratio"] == round(last["lmdq_tok_s"] / last["raw_tok_s"], 4)
    d = last["detail"]
    assert d["runs"]["raw"]["tokens"] == d["runs"]["lmdq"]["tokens"] == 40 * 4
    # the KV cache holds 1 of the 10 documents: raw re-prefills them, lmdq's grouped jobs don't
    assert d["engine_settings"]["sim_prefix_cache_tokens"] == d["kv_blocks"] * 64
    assert d["runs"]["lmdq"]["prefilled_tokens"] < d["runs"]["raw"]["prefilled_tokens"] / 2
    rows = [json.loads(x) for x in wl.read_text().splitlines()]
    assert len(rows) == 40 and len({r["custom_id"] for r in rows}) == 40
    assert [r["custom_id"] for r in rows] != sorted((r["custom_id"] for r in rows), key=lambda c: (
        int(c[3:].split("-")[0]), c))  # shuffled


def test_sink_bench_reports_bytes_per_request_both_ways(env: dict[str, str]) -> None:
    p = run_cli("bench", "sink", "--n", "500", env=env, timeout=300)  # its own redis-server: used_memory is global
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    lines = p.stdout.decode().strip().splitlines()
    assert any(ln.startswith("with_sink") for ln in lines) and any(ln.startswith("without") for ln in lines)
    out = json.loads(lines[-1])
    for run in (out["with_sink"], out["without"]):
        assert run["n"] == 500 and run["exported"] == 500 and run["in_order"]
        assert run["memory_usage_b_per_request"] > 0  # exact per key; used_memory is server-wide (noise)
        assert isinstance(run["used_memory_delta_b_per_request"], float)
    # Only the batch without a sink is large enough (~750 B x 500) for used_memory's noise not to matter;
    # with a sink (~11 B x 500) allocator noise alone can move it either way.
    assert out["without"]["used_memory_delta_b_per_request"] > 100
    assert out["with_sink"]["memory_usage_b_per_request"] < out["without"]["memory_usage_b_per_request"]


def test_prefix_bench_with_two_workers_against_two_raw_halves_on_the_sim(env: dict[str, str]) -> None:
    """`prefix --workers 2` (issue 18's 2-GPU comparison; sim engine here): two raw processes on half the
    file each, then two worker processes on the whole file through submit; every token counted once."""
    import os

    p = run_cli("bench", "prefix", "--engine", "sim", "--workers", "2", "--docs", "10", "--doc-tokens", "200",
                "--questions", "4", "--output-len", "4", "--batch-size", "8", "--sim-step-ms", "1",
                env=dict(os.environ), timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    lines = p.stdout.decode().strip().splitlines()
    assert any(ln.startswith("split x2") for ln in lines) and any(ln.startswith("lmdq x2") for ln in lines)
    d = json.loads(lines[-1])["detail"]
    assert [(x["part"], x["n"], x["tokens"]) for x in d["split_parts"]] == [(0, 20, 80), (1, 20, 80)]
    assert d["lmdq"]["tokens"] == 160 and d["workers"] == 2
    assert d["ratio"] == round(d["lmdq_tok_s"] / d["split_tok_s"], 4)


def test_exporter_bench_reports_both_ways_side_by_side(env: dict[str, str]) -> None:
    p = run_cli("bench", "exporter", "--batches", "2000", "--scrapes", "40", env=env, timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    lines = p.stdout.decode().strip().splitlines()
    assert any(ln.startswith("at_scrape") for ln in lines) and any(ln.startswith("snapshot") for ln in lines)
    out = json.loads(lines[-1])
    assert out["batches"] == 2000 and out["at_scrape"]["scrapes"] == out["snapshot"]["scrapes"] == 40
    assert out["snapshot"]["redis_commands_per_scrape"] == 0  # exact: scrapes never touch Redis
    assert out["at_scrape"]["redis_commands_per_scrape"] >= 1  # the old way: a read per scrape
