"""Producer submit through the real CLI: whole-file validation, exit codes, nothing half-enqueued."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from lmdq.keys import Keys, queue_name, rq_queue_key
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
    from lmdq.jobs import JobQueue

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
