"""``lmdq-bench e2e`` on the sim engine: the orchestration the GPU run relies on (a raw process, a real
lmdq-worker process that turns ready, one real lmdq-producer submit process per batch), checked on CPU.
The numbers themselves mean nothing here (the sim's raw side runs one stream call in-process)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import run_cli


def test_e2e_bench_runs_the_real_clis_and_reports_each_batch(tmp_path: Path, env: dict[str, str]) -> None:
    p = run_cli("lmdq_bench", "e2e", "--engine", "sim", "--sim-step-ms", "1", "--n", "40", "--batches", "2",
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
    # the second clock starts at the first visible job: never slower than the submit-start clock
    b0 = lm["batches"][0]
    assert res["ratio_first_from_visible"] == round(
        b0["tokens"] / (b0["s"] - b0["first_visible_s"]) / d["raw"]["batches"][0]["tok_s"], 4)
    assert res["ratio_all_from_visible"] >= res["ratio_all"]
    assert "first batch" in p.stdout.decode() and "first visible job" in p.stdout.decode()
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


def test_e2e_interleave_alternates_raw_and_lmdq_batches_on_engines_loaded_at_once(tmp_path: Path,
                                                                                  env: dict[str, str]) -> None:
    """--interleave: the raw process and the worker load together, then batch b of each side runs with the
    other idle, raw first on even batches and lmdq first on odd ones. Checked from the wall-clock stamps
    each side records (start/end of every batch, ready of each process), never from the test's own clock."""
    p = run_cli("lmdq_bench", "e2e", "--engine", "sim", "--sim-step-ms", "1", "--n", "16", "--batches", "3",
                "--batch-size", "8", "--min-input", "4", "--max-input", "8", "--min-output", "2", "--max-output", "4",
                "--no-raw-warmup", "--interleave", "--workdir", str(tmp_path / "w"), "-o", str(tmp_path / "e2e.json"),
                env=env, timeout=600)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    res = json.loads(p.stdout.decode().strip().splitlines()[-1])
    assert res["interleave"] is True
    d = res["detail"]
    assert d["interleave"] is True and d["order"] == [["raw", "default"], ["default", "raw"], ["raw", "default"]]
    raw, lm = d["raw"]["batches"], d["lmdq"]["batches"]
    budget = d["max_new_tokens_sum"]
    for side in (raw, lm):
        assert [b["batch"] for b in side] == [0, 1, 2]
        assert all(b["tokens"] == budget and b["start"] <= b["end"] for b in side), side
    assert all(b["results"] == 16 and b["not_completed"] == 0 for b in lm), lm
    assert all(b["not_finished"] == 0 for b in raw), raw
    # one at a time, in the recorded order: each batch ends before the next one (either side's) starts
    timeline = sorted(raw + lm, key=lambda b: b["start"])
    assert all(a["end"] <= b["start"] for a, b in zip(timeline, timeline[1:])), timeline
    firsts = ["raw" if raw[b]["start"] < lm[b]["start"] else "lmdq" for b in range(3)]
    assert firsts == ["raw", "lmdq", "raw"], (raw, lm)
    # both engines were up before either side's first batch: started together, not one after the other
    first_start = min(raw[0]["start"], lm[0]["start"])
    assert d["raw"]["ready_at"] < first_start and d["lmdq"]["ready_at"] < first_start
    assert d["raw"]["started_at"] < d["raw"]["ready_at"] and d["lmdq"]["started_at"] < d["lmdq"]["ready_at"]
    assert d["lmdq"]["worker_exit"] == 0 and d["lmdq"]["worker_log_non_json"] == 0
    assert len(d["ratio_per_batch"]) == 3
    table = p.stdout.decode().splitlines()[:-1]
    assert table[0].split() == ["batch", "raw", "tok/s", "lmdq", "tok/s", "lmdq/raw", "first"]
    assert [ln.split()[-1] for ln in table[1:4]] == ["raw", "default", "raw"]
    assert all(len(ln) <= 80 for ln in table[:4]), table


def test_the_gate_wait_returns_on_the_file_and_names_why_the_other_end_cannot_write_it(tmp_path: Path) -> None:
    """bench/raw_pipe.wait_for_file, both ends' wait of --interleave: a file already there returns at once;
    an other end that is gone raises its reason on the first poll (not at the timeout); no file within the
    timeout (0 s: decided by the first poll, no race with the clock) names the file and the folder."""
    from lmdq_bench.raw_pipe import GateError, wait_for_file

    (tmp_path / "go_0").write_text("{}")
    wait_for_file(tmp_path / "go_0", 3600, lambda: "never asked")
    with pytest.raises(GateError, match="^driver gone$"):
        wait_for_file(tmp_path / "go_1", 3600, lambda: "driver gone")
    with pytest.raises(GateError, match=re.escape(f"no go_1 in {tmp_path} after 0 s")):
        wait_for_file(tmp_path / "go_1", 0, lambda: None)


def test_e2e_interleave_keeps_each_variants_jobs_to_its_own_worker(tmp_path: Path, env: dict[str, str]) -> None:
    """Two lmdq sides loaded at once (--interleave), the second with jobs of 16 (``b:BATCH_SIZE=16``): while
    one side's batch runs the other side's worker is up and idle. Each side has its own key prefix, so every
    result of a side's batch comes from that side's one worker (the result's ``worker``), never from the
    other's."""
    p = run_cli("lmdq_bench", "e2e", "--engine", "sim", "--sim-step-ms", "1", "--n", "48", "--batches", "2",
                "--batch-size", "4", "--min-input", "4", "--max-input", "8", "--min-output", "2", "--max-output", "4",
                "--no-raw-warmup", "--interleave", "--lmdq-variant", "a", "--lmdq-variant", "b:BATCH_SIZE=16",
                "--workdir", str(tmp_path / "w"), "-o", str(tmp_path / "e2e.json"), env=env, timeout=600)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    d = json.loads((tmp_path / "e2e.json").read_text())["detail"]
    assert d["order"] == [["raw", "a", "b"], ["b", "a", "raw"]]
    workers = {}
    for name in ("a", "b"):
        batches = d["variants"][name]["lmdq"]["batches"]
        assert all(b["results"] == 48 and b["not_completed"] == 0 for b in batches), batches
        # requests per job as the batch record in Redis has it: --batch-size, or the variant's BATCH_SIZE
        assert [b["job_size"] for b in batches] == [4 if name == "a" else 16] * 2, batches
        seen = {w for b in batches for w in b["workers"]}
        assert len(seen) == 1, (name, seen)
        workers[name] = seen.pop()
    assert workers["a"] != workers["b"]


@pytest.mark.parametrize(("flags", "expected"), [
    (["--backend", "pytorch"], "--num-gpu-blocks N"),
    (["--backend", "pytorch", "--cache-max-entry-count", "0.4"], "--num-gpu-blocks N"),
    (["--backend", "turbomind", "--cache-max-entry-count", "0.15"], "without --interleave"),
    # a block count aborts TurboMind's process (LMDeploy 0.18, seen on the H200): refused too, before it loads
    (["--backend", "turbomind", "--cache-max-entry-count", "20000"], "without --interleave"),
])
def test_e2e_interleave_on_lmdeploy_refuses_a_kv_cache_given_as_a_fraction(tmp_path: Path, env: dict[str, str],
                                                                           flags: list[str], expected: str) -> None:
    """Session 16: --interleave with each engine's default 0.8 of the memory free when it allocated gave the
    second engine a fraction of the first's KV blocks (lmdq "0.58x raw", all of it from a smaller running
    batch). The bench refuses before it builds a model or starts an engine, naming the flag that fixes it."""
    p = run_cli("lmdq_bench", "e2e", "--engine", "lmdeploy", "--model", str(tmp_path / "absent"), "--interleave",
                *flags, env=env, timeout=120)
    err = p.stderr.decode()
    assert p.returncode != 0
    assert "--interleave" in err and expected in err, err[-2000:]
    assert not (tmp_path / "absent").exists()


def test_timeline_counts_the_requests_held_and_when_results_finished() -> None:
    """bench/finished_batch.timeline on hand-made stamps: two jobs of 2 requests, the second job starting late
    (a worker that left the engine short of work). held_min must show the gap, held_mean the time-weighted
    count, the percentiles the finish times from t0."""
    from lmdq.contract import Result, ResultStatus, Timings
    from lmdq_bench.finished_batch import timeline

    def r(i: int, start: float, end: float) -> Result:
        return Result(batch_id="b", custom_id=f"c{i}", index=i, status=ResultStatus.completed, model="m",
                      timings=Timings(started_at=start, finished_at=end))

    # job A: 2 requests 100-104 and 100-106; job B: 2 requests 106.5-110 (the engine held nothing 106-106.5)
    rows = [r(0, 100, 104), r(1, 100, 106), r(2, 106.5, 110), r(3, 106.5, 110)] * 5  # 20 results
    t = timeline(rows, t0=99.0)
    assert t["first_started_s"] == 1.0
    assert t["finished_p10_s"] == 5.0 and t["finished_p50_s"] == 7.0 and t["finished_p99_s"] == 11.0
    # between 10 % done (104) and 90 % done (110, excluded): after 106 nothing is held until 106.5
    assert t["held_min"] == 0.0
    # area: 10 held x 4 s + 5 held x 2 s + 0 x 0.5 s + 10 held x 3.5 s = 85 over 10 s
    assert t["held_mean"] == 8.5
    assert timeline([], t0=0.0) == {}


def test_e2e_runs_a_cli_door_side_and_a_python_door_side_in_one_run(tmp_path: Path, env: dict[str, str]) -> None:
    """Two lmdq sides against one raw side: ``cli`` submits each batch with an lmdq-producer submit process,
    ``api:SUBMIT=python,SIM_MAX_BATCH=4`` with ``lmdq.Client.submit`` in the bench's own process. Every
    request of every batch completes on both; each record names its door; SUBMIT is the bench's key, so it
    is absent from the api worker's environment as the kernel has it, while that variant's real setting
    (SIM_MAX_BATCH) reached it (the worker's own "worker started" capacity says 4)."""
    p = run_cli("lmdq_bench", "e2e", "--engine", "sim", "--sim-step-ms", "1", "--workload", "image", "--n", "64",
                "--batches", "2", "--batch-size", "16", "--chat-max-new-tokens", "8", "--lmdq-variant", "cli",
                "--lmdq-variant", "api:SUBMIT=python,SIM_MAX_BATCH=4", "--workdir", str(tmp_path / "w"),
                "-o", str(tmp_path / "e2e.json"), env=env, timeout=600)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    res = json.loads((tmp_path / "e2e.json").read_text())
    d = res["detail"]
    v = d["variants"]
    assert list(v) == ["cli", "api"]
    assert (v["cli"]["submit"], v["api"]["submit"]) == ("cli", "python")
    for name, door in (("cli", "cli"), ("api", "python")):
        side = v[name]["lmdq"]
        assert side["submit"] == door and side["worker_exit"] == 0
        assert [b["batch"] for b in side["batches"]] == [0, 1]
        assert all(b["results"] == 64 and b["not_completed"] == 0 and b["tokens"] == 64 * 8
                   for b in side["batches"]), side["batches"]
        assert all(b["submit"] == door and b["job_size"] == 16 for b in side["batches"]), side["batches"]
        # the call (or the process) returned once the batch was staged: its jobs were visible by then
        assert all(0 <= b["first_visible_s"] <= b["submit_exit_s"] for b in side["batches"]), side["batches"]
        # the JSON line's per-side summary: the same ratios as the detail
        assert res["sides"][name]["submit"] == door and res["sides"][name]["ratio_all"] == v[name]["ratio_all"]
    # the top-level keys stay the FIRST side's (existing consumers read them)
    assert d["lmdq"]["name"] == "cli" and res["submit"] == "cli" and res["ratio_all"] == v["cli"]["ratio_all"]
    # SUBMIT never reached the worker; the variant's real setting did (read from /proc while it ran)
    api_env = v["api"]["lmdq"]["worker_env_keys"]
    assert v["api"]["env"] == {"LMDQ_SIM_MAX_BATCH": "4"}
    assert "LMDQ_SIM_MAX_BATCH" in api_env and "LMDQ_KEY_PREFIX" in api_env, api_env
    assert not [k for k in api_env if "SUBMIT" in k], api_env
    assert "LMDQ_SIM_MAX_BATCH" not in v["cli"]["lmdq"]["worker_env_keys"]
    started = [json.loads(ln) for ln in (tmp_path / "w" / "worker_api.log").read_text().splitlines()
               if '"worker started"' in ln]
    assert started and started[0]["capacity"] == 4, started
    out = p.stdout.decode()
    assert "lmdq[cli]: first batch" in out and "submit door: cli" in out and "submit door: python" in out
    assert "Client.submit returned after" in p.stderr.decode()


@pytest.mark.parametrize(("spec", "expected"), [
    ("api:SUBMIT=python", ("api", {}, "python")),
    ("cli", ("cli", {}, "cli")),
    ("x:submit=cli,stream_from_new_tokens=9", ("x", {"LMDQ_STREAM_FROM_NEW_TOKENS": "9"}, "cli")),
    ("x:SUBMIT=rest", "SUBMIT: expected cli or python, got 'rest'"),
    ("x:LMDQ_SUBMIT=python", "the submit door is SUBMIT=..."),
])
def test_a_variants_submit_key_picks_the_door_and_stays_out_of_the_workers_env(
        spec: str, expected: tuple[str, dict[str, str], str] | str) -> None:
    from lmdq_bench.e2e import parse_variant

    if isinstance(expected, str):
        with pytest.raises(ValueError, match=re.escape(expected)):
            parse_variant(spec)
        return
    v = parse_variant(spec)
    assert (v.name, v.env, v.submit) == expected
