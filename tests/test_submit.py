"""Producer submit through the real CLI: whole-file validation, exit codes, nothing half-enqueued."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from lmdq.redis.keys import Keys, queue_name, rq_queue_key
from tests.conftest import run_cli
from tests.helpers import write_jsonl

BAD = Path(__file__).parent / "data" / "bad"


def _nothing_enqueued(client: redis.Redis, prefix: str) -> None:
    assert client.llen(rq_queue_key(queue_name("sim", "normal", prefix))) == 0
    assert client.zcard(Keys(prefix).batches()) == 0
    assert not client.keys(f"{prefix}:batch:*")


@pytest.mark.parametrize("name", sorted(p.name for p in BAD.iterdir()))
def test_every_bad_file_exits_2_with_file_line_and_enqueues_nothing(name: str, env: dict[str, str],
                                                                     client: redis.Redis, prefix: str) -> None:
    p = run_cli("producer", "submit", str(BAD / name), "--model", "sim", "--allow-unknown-model", env=env)
    err = p.stderr.decode()
    assert p.returncode == 2, err
    assert f"{name}:" in err, err  # file:line in the message
    assert "Traceback" not in err
    _nothing_enqueued(client, prefix)


def test_error_late_in_file_enqueues_nothing(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                             prefix: str) -> None:
    rows: list[dict] = [{"prompt": f"p{i}"} for i in range(500)]
    rows.append({"prompt": "x", "params": {"temperature": 9}})
    f = write_jsonl(tmp_path / "late.jsonl", rows)
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--batch-size", "7", env=env)
    assert p.returncode == 2
    assert "late.jsonl:501: field 'params.temperature'" in p.stderr.decode()
    _nothing_enqueued(client, prefix)


def test_duplicate_custom_id_names_both_lines(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                              prefix: str) -> None:
    f = write_jsonl(tmp_path / "dup.jsonl", [{"custom_id": "a", "prompt": "1"}, {"custom_id": "b", "prompt": "2"},
                                             {"custom_id": "a", "prompt": "3"}])
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", env=env)
    assert p.returncode == 2
    assert "dup.jsonl:3: field 'custom_id'" in p.stderr.decode() and "line 1" in p.stderr.decode()
    _nothing_enqueued(client, prefix)


def test_default_custom_id_is_line_number(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                          prefix: str) -> None:
    f = tmp_path / "p.txt"
    f.write_text("first\n\nthird\n")
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--json", env=env)
    assert p.returncode == 0, p.stderr.decode()
    b = json.loads(p.stdout)
    job = client.hgetall(f"rq:job:{b['id']}-000000")
    assert job[b"status"] == b"queued"
    from lmdq.jobs.queue import JobQueue

    payload = JobQueue.payload_of(JobQueue(client, keys=Keys(prefix)).fetch_job(f"{b['id']}-000000"))
    assert [r.custom_id for r in payload.requests] == ["1", "3"]
    assert [r.prompt for r in payload.requests] == ["first", "third"]


def test_unknown_model_rejected_with_known_list(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                                prefix: str) -> None:
    client.hset(Keys(prefix).models(), "llama-8b", 1)
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    p = run_cli("producer", "submit", str(f), "--model", "nope", env=env)
    assert p.returncode == 2
    assert "unknown model 'nope'" in p.stderr.decode() and "llama-8b" in p.stderr.decode()
    _nothing_enqueued(client, prefix)


def test_bad_generation_flag(tmp_path: Path, env: dict[str, str]) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--top-p", "3", env=env)
    assert p.returncode == 2 and "--top-p" in p.stderr.decode()


def test_unknown_batch_is_a_clear_error(env: dict[str, str]) -> None:
    for cmd in (["status"], ["results"], ["cancel"]):
        p = run_cli("producer", *cmd, "batch_doesnotexist", env=env)
        assert p.returncode == 1
        assert "no such batch: 'batch_doesnotexist'" in p.stderr.decode() and "Traceback" not in p.stderr.decode()


def test_idempotency_key_returns_existing_batch(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                                prefix: str) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    args = ("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--json",
            "--idempotency-key", "nightly-2026-11-29")
    a = json.loads(run_cli(*args, env=env).stdout)
    b = json.loads(run_cli(*args, env=env).stdout)
    assert a["id"] == b["id"] and a["created"] is True and b["created"] is False
    assert client.llen(rq_queue_key(queue_name("sim", "normal", prefix))) == 1


def test_redis_wrong_password_is_one_clear_line(tmp_path: Path, env: dict[str, str]) -> None:
    from tests.conftest import RedisServer

    srv = RedisServer(password="s3cret-pw").start()
    try:
        bad = srv.url.replace("s3cret-pw", "wrong-pw")
        p = run_cli("producer", "list", env={**env, "LMDQ_REDIS_URL": bad})
        err = p.stderr.decode()
        assert p.returncode == 3, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert "wrong-pw" not in err and "***" in err
        ok = run_cli("producer", "list", env={**env, "LMDQ_REDIS_URL": srv.url})
        assert ok.returncode == 0, ok.stderr.decode()
    finally:
        srv.cleanup()


def test_json_schema_and_regex_flags(tmp_path: Path, env: dict[str, str]) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "give me a person"}])
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}))
    ok = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--json",
                 "--json-schema", str(schema), "--output-logits", "generation", env=env)
    assert ok.returncode == 0, ok.stderr.decode()
    params = json.loads(ok.stdout)["params"]
    assert params["response_format"]["type"] == "json_schema" and params["output_logits"] == "generation"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "no-such-type"}}}))
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--json-schema", str(bad),
                env=env)
    assert p.returncode == 2 and "--json-schema" in p.stderr.decode()
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--regex", "([a-z", env=env)
    assert p.returncode == 2 and "--regex" in p.stderr.decode()
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--output-logits", "some",
                env=env)
    assert p.returncode == 2 and "--output-logits" in p.stderr.decode()


# ---- the file changes between validation and staging (#14) ----------------------------------------

# Runs the real CLI (lmdq.producer.cli.main) with SubmitOptions.after_validation set to edit the file:
# the edit lands exactly between the two passes, every run, with no sleeping process to race.
_EDIT_DURING_SUBMIT = """
import os
import sys
import lmdq.submission.submit as submit
from lmdq.producer.cli import main

mode = sys.argv.pop(1)
real = submit.submit_file


def edit(path):
    data = path.read_bytes()
    if mode == "append":  # lines with custom_ids already used: the duplicates validation would refuse
        path.write_bytes(data + data.splitlines(keepends=True)[0] * 3)
    elif mode == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif mode == "same-size":  # one prompt changed in place, size AND mtime kept: only the content hash sees it
        st = os.stat(path)
        path.write_bytes(data.replace(b"prompt number 7", b"PROMPT NUMBER 7", 1))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif mode == "delete":
        path.unlink()


def patched(path, opts, **kw):
    opts.after_validation = lambda: edit(path)
    return real(path, opts, **kw)


submit.submit_file = patched
sys.argv[0] = "lmdq-producer"
main()
"""


def _all_keys(client: redis.Redis) -> set[bytes]:
    return set(client.keys("*"))


@pytest.mark.parametrize("mode", ["append", "truncate", "same-size", "delete"])
def test_file_edited_during_submit_exits_2_and_leaves_nothing(mode: str, tmp_path: Path, env: dict[str, str],
                                                              client: redis.Redis, prefix: str) -> None:
    import subprocess
    import sys

    rows = [{"custom_id": f"r{i}", "prompt": f"prompt number {i}"} for i in range(600)]
    f = write_jsonl(tmp_path / "edited.jsonl", rows)
    before = _all_keys(client)
    p = subprocess.run([sys.executable, "-c", _EDIT_DURING_SUBMIT, mode, "submit", str(f), "--model", "sim",
                        "--allow-unknown-model", "--batch-size", "7", "--idempotency-key", "edit-once"],
                       env=env, capture_output=True, timeout=120)
    err = p.stderr.decode()
    assert p.returncode == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"{f}: the file changed during submit" in err and "nothing was enqueued" in err
    _nothing_enqueued(client, prefix)
    # no job hashes, no job list, no idempotency key, no batch; other tests' TTL'd keys may expire meanwhile
    assert not _all_keys(client) - before
    assert client.get(Keys(prefix).idempotency("edit-once")) is None


def test_unchanged_file_still_submits_with_the_hook(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                                    prefix: str) -> None:
    """The driver above changes nothing in lmdq but the file: with no edit, submit succeeds."""
    import subprocess
    import sys

    f = write_jsonl(tmp_path / "same.jsonl", [{"prompt": f"prompt number {i}"} for i in range(20)])
    p = subprocess.run([sys.executable, "-c", _EDIT_DURING_SUBMIT, "none", "submit", str(f), "--model", "sim",
                        "--allow-unknown-model", "--json", "--batch-size", "7"], env=env, capture_output=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr.decode()
    b = json.loads(p.stdout)
    assert b["status"] == "queued" and b["request_counts"]["total"] == 20
    assert client.llen(rq_queue_key(queue_name("sim", "normal", prefix))) == 3


# ---- Redis refuses the writes (#14) ------------------------------------------------------------------


def test_redis_out_of_memory_at_submit_is_one_line_exit_5(tmp_path: Path, env: dict[str, str]) -> None:
    import os

    from tests.conftest import RedisServer

    srv = RedisServer().start()
    try:
        c = redis.Redis.from_url(srv.url)
        c.config_set("maxmemory-policy", "noeviction")
        c.config_set("maxmemory", int(c.info("memory")["used_memory"]) + 256 * 1024)
        before = _all_keys(c)
        f = write_jsonl(tmp_path / "big.jsonl", [{"prompt": os.urandom(400).hex()} for _ in range(2000)])
        p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--batch-size", "2",
                    "--idempotency-key", "oom-once",
                    # past submit's headroom check (issue 17), which would refuse this batch before it writes
                    env={**env, "LMDQ_REDIS_URL": srv.url, "LMDQ_MEMORY_HEADROOM_FRACTION": "0"})
        err = p.stderr.decode()
        assert p.returncode == 5, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert "out of memory (maxmemory)" in err and f"127.0.0.1:{srv.port}" in err
        # Issue 27: the first jobs were visible (workers start while submit stages the rest) when Redis filled
        # up, so the batch cannot vanish: submit says how to end it, and `cancel` does once Redis has room.
        # Deleting its staged-but-invisible jobs frees memory, so ending it usually works at once; where Redis
        # still refuses, the message says how to end it later (tests/test_submit_progressive.py forces that).
        assert "Staging stopped after 8 of 1000 jobs" in err and "1,984 were never queued" in err, err
        bid = err.split(" of batch ")[1].split(" ")[0]
        c.config_set("maxmemory", "0")
        if "it was cancelled" not in err:
            assert f"lmdq-producer cancel {bid}` once Redis accepts writes" in err, err
            cancel = run_cli("producer", "cancel", bid, env={**env, "LMDQ_REDIS_URL": srv.url})
            assert cancel.returncode == 0, cancel.stderr.decode()
        st = json.loads(run_cli("producer", "status", bid, "--json", env={**env, "LMDQ_REDIS_URL": srv.url}).stdout)
        assert st["status"] == "cancelled" and st["request_counts"]["cancelled"] == 2000, st
        assert not _queued_ids(c)
        assert _all_keys(c) - before  # the batch's record stays until its TTL, as any ended batch's
    finally:
        srv.cleanup()


def _queued_ids(c: redis.Redis) -> list[bytes]:
    return [j for k in c.keys("rq:queue:*") for j in c.lrange(k, 0, -1)]


def test_redis_read_only_replica_at_submit_is_one_line_exit_5(tmp_path: Path, env: dict[str, str]) -> None:
    from tests.conftest import RedisServer, free_port

    srv = RedisServer().start()
    try:
        c = redis.Redis.from_url(srv.url)
        c.replicaof("127.0.0.1", free_port())  # a replica (its primary is not up): refuses every write
        f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
        p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model",
                    env={**env, "LMDQ_REDIS_URL": srv.url})
        err = p.stderr.decode()
        assert p.returncode == 5, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert f"Redis at 127.0.0.1:{srv.port} is a read-only replica" in err
        assert c.dbsize() == 0
    finally:
        srv.cleanup()


def test_sampling_knobs_without_do_sample_warn_once_per_file(tmp_path: Path, env: dict[str, str],
                                                             client: redis.Redis, prefix: str) -> None:
    rows: list[dict] = [{"prompt": f"t{i}", "params": {"temperature": 0.7, "seed": i}} for i in range(30)]
    rows += [{"prompt": f"k{i}", "params": {"top_p": 0.9, "max_tokens": 4}} for i in range(5)]
    rows += [{"prompt": "explicit", "params": {"temperature": 0.7, "do_sample": False, "stop": "."}}]
    f = write_jsonl(tmp_path / "knobs.jsonl", rows)
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", env=env)
    err = p.stderr.decode()
    assert p.returncode == 0, err
    warnings = [x for x in err.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 2, err  # one line per kind, never one per request line
    assert "knobs.jsonl: 30 lines set temperature without do_sample (first: line 1)" in warnings[0]
    assert "knobs.jsonl: 5 lines set top_p/top_k/min_p without temperature or do_sample (first: line 31)" \
        in warnings[1]
    assert client.zcard(Keys(prefix).batches()) == 1

    # with --do-sample the batch samples: the top_p lines need no warning; the temperature ones still do
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--do-sample", env=env)
    err = p.stderr.decode()
    assert p.returncode == 0, err
    assert [x for x in err.splitlines() if x.startswith("warning:")] == warnings[:1], err


def test_cli_temperature_without_do_sample_samples(tmp_path: Path, env: dict[str, str]) -> None:
    f = tmp_path / "p.txt"
    f.write_text("one\n")
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--temperature", "0.7",
                "--json", env=env)
    assert p.returncode == 0, p.stderr.decode()
    assert json.loads(p.stdout)["params"]["do_sample"] is True
    assert "without --do-sample/--greedy: sampling" in p.stderr.decode()
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--temperature", "0.7",
                "--greedy", "--json", env=env)
    assert p.returncode == 0 and json.loads(p.stdout)["params"]["do_sample"] is False
    assert "note:" not in p.stderr.decode()
