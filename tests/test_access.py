"""Nobody in who shouldn't be: only lmdq's own jobs run; limits, TLS and credentials at the boundary."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import redis

from lmdq.redis.keys import Keys, queue_name, rq_queue_key
from tests.conftest import ROOT, RedisServer, run_cli, start_worker
from tests.faultkit import (
    SIM,
    events,
    no_traceback,
    stopped_stats,
    submit,
)
from tests.helpers import wait_batch, write_jsonl


class _RunsOnUnpickle:
    """Pickles to a call of os.system: unpickling the job's data would run the command."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.cmd,))


@pytest.mark.parametrize("serializer", ["json", "pickle", "bare-id"])
def test_foreign_function_job_is_refused_and_nothing_runs(serializer: str, tmp_path: Path, env: dict[str, str],
                                                          client: redis.Redis, prefix: str) -> None:
    """Someone with queue access enqueues os.system on a model queue: refused, logged, failed in RQ."""
    from rq import Queue
    from rq.registry import FailedJobRegistry
    from rq.serializers import JSONSerializer

    marker, unpickled = tmp_path / "pwned", tmp_path / "unpickled"
    qname = queue_name("sim", "normal", prefix)
    if serializer == "json":
        job_id = Queue(qname, connection=client, serializer=JSONSerializer).enqueue("os.system", f"touch {marker}").id
    elif serializer == "pickle":  # rq's default serializer; merely loading these args would run a command
        job_id = Queue(qname, connection=client).enqueue("os.system", f"touch {marker}",
                                                        _RunsOnUnpickle(f"touch {unpickled}")).id
    else:  # an id pushed straight onto the list, with no job hash behind it
        job_id = "not-a-job"
        client.rpush(rq_queue_key(qname), job_id)
    # a real batch queued behind it still runs
    bid = submit(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "after the bad job"}]), env)["id"]
    log = tmp_path / "w.log"
    w = start_worker(*SIM, "--sim-step-ms", "1", "--burst", env=env, log=log)
    assert w.wait(60) == 0
    assert not marker.exists() and not unpickled.exists(), "a foreign job ran code"
    refused = [e for e in events(log) if e.get("event") == "refused job: not an lmdq job"]
    assert [e["job"] for e in refused] == [job_id]
    why = {"json": "is not 'lmdq.jobs.queue.generate'", "pickle": "its data is not JSON", "bare-id": "No such job"}
    assert why[serializer] in refused[0]["error"], refused[0]
    if serializer != "bare-id":
        assert job_id in FailedJobRegistry(qname, connection=client).get_job_ids()
        assert client.hget(f"rq:job:{job_id}", "status") == b"failed"
        assert "refused by lmdq-worker" in zlib.decompress(client.hget(f"rq:job:{job_id}", "exc_info")).decode()
    assert client.llen(rq_queue_key(qname)) == 0 and client.zcard(Keys(prefix).leases()) == 0
    assert stopped_stats(log)["refused"] == 1
    assert wait_batch(client, prefix, bid).request_counts.completed == 1
    no_traceback(log)


def test_request_line_and_metadata_limits_are_clear_errors_nothing_enqueued(tmp_path: Path, env: dict[str, str],
                                                                    client: redis.Redis, prefix: str) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(6)])
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model",
                env={**env, "LMDQ_MAX_REQUESTS": "5"})
    err = p.stderr.decode()
    assert p.returncode == 2, err
    assert "p.jsonl:6:" in err and "too many requests: the limit is 5 per file" in err and "Traceback" not in err
    big = write_jsonl(tmp_path / "big.jsonl", [{"prompt": "ok"}, {"prompt": "x" * 3000}])
    p = run_cli("producer", "submit", str(big), "--model", "sim", "--allow-unknown-model",
                env={**env, "LMDQ_MAX_LINE_BYTES": "2048"})
    err = p.stderr.decode()
    assert p.returncode == 2, err
    assert "big.jsonl:2:" in err and "over the limit of 2,048 bytes" in err and "Traceback" not in err
    meta = [a for i in range(17) for a in ("--metadata", f"k{i}=v")]
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", *meta,
                "--idempotency-key", "k", env=env)
    err = p.stderr.decode()
    assert p.returncode == 2 and err.strip() == "error: --metadata: at most 16 metadata keys", err
    assert client.get(Keys(prefix).idempotency("k")) is None  # the key was not claimed
    assert client.llen(rq_queue_key(queue_name("sim", "normal", prefix))) == 0
    assert client.zcard(Keys(prefix).batches()) == 0 and not client.keys(f"{prefix}:batch:*")


def test_rediss_url_builds_a_tls_client_without_network() -> None:
    import ssl

    from redis.connection import SSLConnection

    from lmdq.errors import RedisUnavailable
    from lmdq.redis.connection import connect, redact_url

    url = "rediss://lmdq:s3cret@redis.example:6380/2?ssl_cert_reqs=required&ssl_ca_certs=/etc/ssl/ca.pem"
    c = connect(url, check=False)
    pool = c.connection_pool
    assert pool.connection_class is SSLConnection
    kw = pool.connection_kwargs
    assert (kw["host"], kw["port"], kw["db"]) == ("redis.example", 6380, 2)
    assert (kw["username"], kw["password"]) == ("lmdq", "s3cret")
    conn = pool.make_connection()  # built, not connected
    assert conn.cert_reqs == ssl.CERT_REQUIRED and conn.ca_certs == "/etc/ssl/ca.pem"
    # the whole userinfo is redacted, user name included (issue #14: with a missing ':' it IS the password)
    assert redact_url(url) == "rediss://***@redis.example:6380/2?ssl_cert_reqs=required&ssl_ca_certs=/etc/ssl/ca.pem"
    with pytest.raises(RedisUnavailable, match=r"invalid Redis URL 'http://\*\*\*@h'"):
        connect("http://u:pw@h", check=False)


def test_worker_wrong_password_one_line_and_password_never_logged(tmp_path: Path, env: dict[str, str]) -> None:
    srv = RedisServer(password="s3cret-pw").start()
    try:
        bad = srv.url.replace("s3cret-pw", "wrong-pw")
        t = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "lmdq.worker", *SIM, "--burst"], env={**env, "LMDQ_REDIS_URL": bad},
                           capture_output=True, timeout=60, cwd=ROOT)
        err = p.stderr.decode()
        assert p.returncode == 3, err
        assert time.monotonic() - t < 10  # refused credentials are not retried with backoff
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert "wrong-pw" not in err and "***" in err
        log = tmp_path / "w.log"
        w = start_worker(*SIM, "--burst", env={**env, "LMDQ_REDIS_URL": srv.url}, log=log)
        assert w.wait(60) == 0
        text = log.read_text()
        assert "s3cret-pw" not in text and "://***@127.0.0.1" in text
    finally:
        srv.cleanup()
