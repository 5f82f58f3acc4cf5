"""Issue 29: what submit refuses or keeps straight: an idempotency key reused for another file, output URLs
with credentials, response_format schemas nested too deeply; and TTLs that count from a batch's END, so a
short ``--result-ttl`` never expires a running batch under its workers.

Real redis-server (tests/conftest.py), real CLIs and a real sim worker in this process. The TTL test
reads Redis' own TTLs at each step instead of sleeping past a threshold.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from lmdq.batches.records import RUNNING_TTL_S
from lmdq.contract import MAX_SCHEMA_DEPTH, Batch, BatchStatus, RequestCounts
from lmdq.errors import IdempotencyConflict
from lmdq.redis.keys import Keys, queue_name, rq_queue_key
from lmdq.submission.ledger import BatchLedger, new_batch_id
from lmdq.submission.submit import SubmitOptions, submit_file
from tests.conftest import run_cli
from tests.helpers import write_jsonl

MODEL = "sim"


def _rows(n: int, tag: str = "q") -> list[dict[str, Any]]:
    return [{"custom_id": f"r{i}", "prompt": f"{tag} {i}"} for i in range(n)]


def _submit(client: redis.Redis, prefix: str, path: Path, *, ttl_s: int = 3600, **opts: Any) -> tuple[Batch, bool]:
    return submit_file(path, SubmitOptions(model=MODEL, allow_unknown_model=True, **opts), client=client,
                       keys=Keys(prefix), ttl_s=ttl_s)


def _keys(client: redis.Redis) -> set[bytes]:
    return set(client.scan_iter("*"))


# ---- idempotency ------------------------------------------------------------------------------------


def test_same_key_other_file_or_options_is_refused(tmp_path: Path, client: redis.Redis, prefix: str,
                                                   env: dict[str, str]) -> None:
    """bd9ca4b: the second file exited 0 with the first batch's id; nothing said it was not enqueued."""
    a = write_jsonl(tmp_path / "a.jsonl", _rows(5, "a"))
    b = write_jsonl(tmp_path / "b.jsonl", _rows(5, "b"))
    first, created = _submit(client, prefix, a, idempotency_key="nightly")
    assert created
    again, created = _submit(client, prefix, a, idempotency_key="nightly")  # same key, same file: as before
    assert not created and again.id == first.id
    before = _keys(client)
    with pytest.raises(IdempotencyConflict, match=f"'nightly' is bound to batch {first.id}"):
        _submit(client, prefix, b, idempotency_key="nightly")
    with pytest.raises(IdempotencyConflict, match="different file or options"):
        _submit(client, prefix, a, idempotency_key="nightly", batch_size=2)
    assert _keys(client) == before  # nothing enqueued, nothing bound
    p = run_cli("lmdq.producer", "submit", str(b), "--model", MODEL, "--allow-unknown-model",
                "--idempotency-key", "nightly", env=env)
    err = p.stderr.decode()
    assert p.returncode == 2 and err.count("\n") == 1 and first.id in err and "'nightly'" in err, err
    p = run_cli("lmdq.producer", "submit", str(a), "--model", MODEL, "--allow-unknown-model",
                "--idempotency-key", "nightly", env=env)
    assert p.returncode == 0 and p.stdout.decode().strip() == first.id


# ---- credentials in output URLs ------------------------------------------------------------------------


@pytest.mark.parametrize("flag, url", [
    ("--results-url", "s3://AKIAEXAMPLE:S3cretKey@bucket/out"),
    ("--blob-url", "s3://bucket/out?X-Amz-Signature=S3cretKey"),
    ("--results-url", "file://user:S3cretKey@localhost/data/out"),
])
def test_urls_with_credentials_are_refused(tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str,
                                           flag: str, url: str) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", _rows(2))
    p = run_cli("lmdq.producer", "submit", str(f), "--model", MODEL, "--allow-unknown-model", flag, url, env=env)
    err = p.stderr.decode()
    assert p.returncode == 2 and f"{flag}:" in err and "holds credentials" in err, err
    assert "S3cretKey" not in err and "Traceback" not in err
    assert not list(client.scan_iter(f"{prefix}:*"))


def test_status_redacts_credentials_an_older_lmdq_recorded(client: redis.Redis, prefix: str,
                                                           env: dict[str, str]) -> None:
    bid = new_batch_id()
    batch = Batch(id=bid, model=MODEL, status=BatchStatus.validating, batch_size=1, num_jobs=1,
                  request_counts=RequestCounts(total=1), created_at=time.time(),
                  results_url="s3://AKIAEXAMPLE:S3cretKey@bucket/out", blob_url="s3://b/x?token=S3cretKey")
    BatchLedger(client, keys=Keys(prefix), ttl_s=3600).enqueue(batch, [{"index": 0, "custom_id": "a",
                                                                         "prompt": "hi"}])
    for args in (["status", bid, "--json"], ["status", bid], ["list", "--json"]):
        p = run_cli("lmdq.producer", *args, env=env)
        out = p.stdout.decode() + p.stderr.decode()
        assert p.returncode == 0 and "S3cretKey" not in out and "AKIAEXAMPLE" not in out, out
    shown = json.loads(run_cli("lmdq.producer", "status", bid, "--json", env=env).stdout)
    assert shown["results_url"] == "s3://***@bucket/out"


# ---- deep response_format schemas ----------------------------------------------------------------------


def _deep(levels: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}}
    return s


def test_a_deep_schema_is_a_file_line_error(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                            prefix: str) -> None:
    """bd9ca4b: a schema nested 100 levels deep ended in a traceback (pydantic/json recursion)."""
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep(100)}}
    f = write_jsonl(tmp_path / "p.jsonl", [*_rows(2), {"custom_id": "deep", "prompt": "x",
                                                       "params": {"response_format": rf}}])
    p = run_cli("lmdq.producer", "submit", str(f), "--model", MODEL, "--allow-unknown-model", env=env)
    err = p.stderr.decode()
    assert p.returncode == 2 and f"{f}:3:" in err and f"deeper than {MAX_SCHEMA_DEPTH} levels" in err, err
    assert "Traceback" not in err
    (tmp_path / "s.json").write_text(json.dumps(_deep(100)))
    p = run_cli("lmdq.producer", "submit", str(f), "--model", MODEL,
                "--allow-unknown-model", "--json-schema", str(tmp_path / "s.json"), env=env)
    err = p.stderr.decode()
    assert p.returncode == 2 and "--response-format" in err and "deeper than" in err and "Traceback" not in err, err
    shallow = {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep(10)}}
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"custom_id": "a", "prompt": "x", "params": {"response_format": shallow}}])
    assert run_cli("lmdq.producer", "submit", str(ok), "--model", MODEL, "--allow-unknown-model",
                   env=env).returncode == 0


# ---- TTL from the batch's end --------------------------------------------------------------------------


def _worker(client: redis.Redis, url: str, prefix: str) -> None:
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    s = WorkerSettings(redis_url=url, key_prefix=prefix, burst=True, health_port=0, heartbeat_ttl_s=10,
                       idle_wait_s=0)
    assert Worker(engine=SimEngine(model_name=MODEL, step_ms=0), client=client, settings=s).run() == 0


def _batch_keys(client: redis.Redis, prefix: str, batch_id: str) -> list[bytes]:
    return sorted([*client.scan_iter(f"{prefix}:batch:{batch_id}*"), *client.scan_iter(f"rq:job:{batch_id}-*")])


def test_a_short_result_ttl_counts_from_the_batch_end(tmp_path: Path, redis_url: str, client: redis.Redis,
                                                      prefix: str) -> None:
    """bd9ca4b: ``--result-ttl 60`` on a longer batch: at 60 s the batch, its jobs and results vanished under
    its workers. Now every key of a running batch holds the running TTL (read back from Redis after half
    the batch ran: the keys its worker created included) and the 60 s start when the last result lands."""
    f = write_jsonl(tmp_path / "p.jsonl", _rows(4))
    batch, _ = _submit(client, prefix, f, ttl_s=60, batch_size=2, idempotency_key="short")
    q = rq_queue_key(queue_name(MODEL, "normal", prefix))
    parked = f"{prefix}:parked"
    client.lmove(q, parked, "RIGHT", "LEFT")  # hold the second job back: the batch stays running
    _worker(client, redis_url, prefix)
    store_batch = BatchLedger(client, keys=Keys(prefix), ttl_s=60).get(batch.id)
    assert store_batch.status is BatchStatus.in_progress and store_batch.request_counts.completed == 2
    running = _batch_keys(client, prefix, batch.id)
    assert Keys(prefix).results(batch.id).encode() in running and len(running) >= 4
    for k in [*running, Keys(prefix).idempotency("short").encode()]:
        assert client.ttl(k) > RUNNING_TTL_S - 3600, k  # not on a 60 s clock while it runs
    client.lmove(parked, q, "RIGHT", "LEFT")
    _worker(client, redis_url, prefix)
    done = BatchLedger(client, keys=Keys(prefix), ttl_s=60).get(batch.id)
    assert done.status is BatchStatus.completed
    for k in [*_batch_keys(client, prefix, batch.id), Keys(prefix).idempotency("short").encode()]:
        assert 0 < client.ttl(k) <= 60, k  # retention from the end, every key of the batch together
