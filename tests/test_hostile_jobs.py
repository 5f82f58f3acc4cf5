"""Hostile and broken jobs (issue 14, worker side), against a real redis-server and a real worker.

Someone with queue access pushes jobs by hand: a batch id that walks out of the output folder, output
URLs that differ from the batch record or fall outside what the worker allows, a zlib bomb. Each is
refused (logged once, failed in RQ, never retried), nothing is written where it should not be, and
the worker keeps serving the good jobs queued behind.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic import ValidationError
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from lmdq.contract import (
    BATCH_ID_PATTERN,
    JOB_FUNCTION,
    Batch,
    BatchStatus,
    JobPayload,
    RequestCounts,
    ResultStatus,
)
from lmdq.jobs.data import DEFAULT_MAX_JOB_BYTES, MAX_FIELD_BYTES, JobRefused, JobTooLarge, inflate, read_job
from lmdq.jobs.decode import decode_job
from lmdq.jobs.queue import JobQueue, job_id_for
from lmdq.redis.keys import Keys, queue_name, rq_queue_key
from lmdq.results.output_urls import OutputPolicy, OutputUrlRejected, parse_output_url
from lmdq.results.store import ResultStore
from tests.conftest import ROOT
from tests.helpers import results_of, wait_batch

MODEL = "sim"


# ---- helpers ---------------------------------------------------------------------------------------


def _batch(client: redis.Redis, prefix: str, n: int, **urls: Any) -> str:
    """A legit batch of ``n`` one-request jobs, enqueued the way the producer does it."""
    from lmdq.testing import enqueue_requests

    return enqueue_requests(client, Keys(prefix), MODEL, [{"prompt": f"question {i}"} for i in range(n)], **urls)


def _push(client: redis.Redis, prefix: str, payload: dict[str, Any], job_id: str) -> str:
    """A hand-made job: an RQ job hash with lmdq's function, pushed on the model's normal queue."""
    qname = queue_name(MODEL, "normal", prefix)
    job = Job.create(JOB_FUNCTION, args=[payload], connection=client, id=job_id, origin=qname,
                     status=JobStatus.QUEUED, serializer=JSONSerializer(), timeout=-1)
    job.save()
    client.expire(job.key, 3600)
    client.rpush(rq_queue_key(qname), job_id)
    return job_id


def _push_raw(client: redis.Redis, prefix: str, job_id: str, **fields: bytes | str) -> str:
    qname = queue_name(MODEL, "normal", prefix)
    client.hset(Job.key_for(job_id), mapping={"origin": qname, "status": "queued", **fields})
    client.expire(Job.key_for(job_id), 3600)
    client.rpush(rq_queue_key(qname), job_id)
    return job_id


def _payload(batch_id: str, job_no: int = 0, index: int = 0, **extra: Any) -> dict[str, Any]:
    return {"format_version": 1, "batch_id": batch_id, "model": MODEL, "job_no": job_no, "params": {},
            "requests": [{"index": index, "custom_id": f"h{index}", "prompt": "hi",
                          "params": {"output_logits": "generation"}}], **extra}


def _run_worker(client: redis.Redis, redis_url: str, prefix: str, **settings: Any) -> dict[str, int]:
    """A real worker (sim engine) in burst mode, in this process; returns its counters."""
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, burst=True, health_port=0, heartbeat_ttl_s=10,
                       **settings)
    w = Worker(engine=SimEngine(model_name=MODEL, step_ms=0), client=client, settings=s)
    assert w.run() == 0
    return w.stats


def _files(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file() or p.is_symlink())


def _assert_refused(client: redis.Redis, prefix: str, job_id: str) -> None:
    """Failed in RQ's registry (with lmdq's reason), never re-queued, no lease left."""
    qname = queue_name(MODEL, "normal", prefix)
    assert job_id in FailedJobRegistry(qname, connection=client).get_job_ids()
    assert client.hget(Job.key_for(job_id), "status") == b"failed"
    assert "refused by lmdq-worker" in zlib.decompress(client.hget(Job.key_for(job_id), "exc_info")).decode()  # type: ignore[arg-type]
    assert client.ttl(Job.key_for(job_id)) > 0
    assert client.llen(rq_queue_key(qname)) == 0
    keys = Keys(prefix)
    assert client.zscore(keys.leases(), job_id) is None and not client.hexists(keys.lease_owner(), job_id)
    # released as done, never re-queued: a finished job's run/attempt counters are dropped (issue 13),
    # while a re-queued one keeps them (the callers check it was refused and logged exactly once)
    assert not client.hexists(keys.runs(), job_id) and not client.hexists(keys.attempts(), job_id)


def _refusal_lines(out: str, job_id: str) -> list[str]:
    return [ln for ln in out.splitlines() if "refused job" in ln and job_id in ln]


def zlib_bomb(head: bytes, total: int, chunk: int = 4 << 20) -> bytes:
    """A VALID zlib stream of ``head`` plus ``total`` bytes of spaces, about 1/1000 of that in size.

    Built without compressing gigabytes: after a full flush a deflate stream restarts from an empty
    history, so one compressed chunk of spaces is repeated; the trailer carries the true Adler-32.
    """
    c = zlib.compressobj(9)
    first = c.compress(head) + c.flush(zlib.Z_FULL_FLUSH)
    filler = b" " * chunk
    block = c.compress(filler) + c.flush(zlib.Z_FULL_FLUSH)
    n = total // chunk
    adler = zlib.adler32(head)
    for _ in range(n):
        adler = zlib.adler32(filler, adler)
    return first + block * n + b"\x03\x00" + struct.pack(">I", adler)  # empty final block, then Adler-32


# ---- the contract: ids, indices ------------------------------------------------------------------


def test_batch_ids_lmdq_makes_are_the_only_ones_a_job_may_carry() -> None:
    import re

    from lmdq.submission.submit import new_batch_id

    for _ in range(20):
        assert re.fullmatch(BATCH_ID_PATTERN, new_batch_id())  # producer and contract agree
    ok = new_batch_id()
    JobPayload.model_validate(_payload(ok))
    bad = ["../../x", "", "x", f"{ok}/..", f"../{ok}", f"{ok}\n", f"{ok}\x00", ok.upper(), ok + "0", ok[:-1],
           "batch_" + "/" * 24, "batch_" + "a" * 10_000, f" {ok}"]
    for b in bad:
        with pytest.raises(ValidationError, match="batch_id"):
            JobPayload.model_validate(_payload(b))


def test_request_indices_unique_and_bounded_and_ids_bounded() -> None:
    from lmdq.submission.submit import new_batch_id

    p = _payload(new_batch_id())
    p["requests"] = [p["requests"][0], {**p["requests"][0], "custom_id": "other"}]
    with pytest.raises(ValidationError, match="index 0 appears twice"):
        JobPayload.model_validate(p)
    for field_, value in (("index", -1), ("index", 10**12), ("custom_id", "c" * 513), ("custom_id", "")):
        p = _payload(new_batch_id())
        p["requests"][0][field_] = value
        with pytest.raises(ValidationError, match=field_):
            JobPayload.model_validate(p)
    for field_, value in (("model", "m" * 513), ("model", ""), ("job_no", -1), ("job_no", 10**12)):
        with pytest.raises(ValidationError, match=field_):
            JobPayload.model_validate({**_payload(new_batch_id()), field_: value})
    with pytest.raises(ValidationError, match="requests"):
        JobPayload.model_validate({**_payload(new_batch_id()), "requests": []})


# ---- output URLs ---------------------------------------------------------------------------------


def test_output_policy_normalises_then_checks_prefixes(tmp_path: Path) -> None:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "link").symlink_to(outside)
    pol = OutputPolicy([str(allowed), "s3://bucket/lmdq"])
    real = os.path.realpath(allowed)
    assert pol.check(str(allowed / "sink")) == f"{real}/sink"
    assert pol.check(f"file://{allowed}/a/b/") == f"{real}/a/b"
    assert pol.check(str(allowed / "x" / ".." / "y")) == f"{real}/y"
    assert pol.check(str(allowed)) == real
    assert pol.check("s3://bucket/lmdq/run1") == "s3://bucket/lmdq/run1"
    refused = [
        str(allowed / ".." / "outside"),  # '..' walks out
        str(allowed / "link" / "sink"),  # a symlink inside the allowed folder points out
        f"{allowed}-evil/sink",  # a sibling sharing the prefix string
        str(outside),
        "relative/folder",  # resolved against the working folder: outside
        "s3://bucket/lmdq-evil/x", "s3://other/lmdq/x", "s3://bucket/lmdq/../x", "s3://bucket/lmdq//x",
        "s3://key:secret@bucket/lmdq/x", "s3://bucket/lmdq/x?versionId=1",
        "http://example.com/x", "memory://x", "gcs://bucket/lmdq", "simplecache::s3://bucket/lmdq/x",
        f"file://evilhost{allowed}/x", f"{allowed}/x\x00y", f"{allowed}/x\ny", "a" * 5000, "",
    ]
    for url in refused:
        with pytest.raises(OutputUrlRejected):
            pol.check(url)
    # a refusal never echoes credentials
    with pytest.raises(OutputUrlRejected) as e:
        pol.check("s3://AKIAXXXX:S3cretPW@bucket/lmdq/x")
    assert "S3cretPW" not in str(e.value)
    # nothing is allowed unless configured
    with pytest.raises(OutputUrlRejected, match="none configured"):
        OutputPolicy([]).check(str(allowed))
    assert OutputPolicy.for_worker("", str(allowed)).check(str(allowed / "t")) == f"{real}/t"
    with pytest.raises(ValueError, match="LMDQ_ALLOWED_OUTPUT_URLS"):
        OutputPolicy.for_worker("s3://ok-bucket/x, ftp://nope", None)
    assert parse_output_url(f"file://localhost{allowed}").url == real


def test_blob_store_keys_and_symlinks_cannot_leave_the_store(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    from lmdq.results.blobs import BlobStore

    store_dir, outside = tmp_path / "store", tmp_path / "outside"
    store_dir.mkdir()
    outside.mkdir()
    store = BlobStore.from_url(str(store_dir))
    for key in ("../x.bin", "a/../../x.bin", "a/./x.bin", "a//x.bin"):
        with pytest.raises(ValueError, match="segment"):
            store.put_bytes(key, b"data")
    (store_dir / "planted").symlink_to(outside)  # someone with write access to the store plants a link
    with pytest.raises(ValueError, match="outside the store"):
        store.put_bytes("planted/x.bin", b"data")
    assert _files(outside) == []
    assert store.put_bytes("ok/x.bin", b"data").endswith("/ok/x.bin") and (store_dir / "ok" / "x.bin").is_file()


# ---- the job hash: caps before and during decompression --------------------------------------------


def test_inflate_stops_at_the_cap() -> None:
    cap = 1 << 20
    exact = b"[" + b" " * (cap - 2) + b"]"
    assert inflate(zlib.compress(exact), cap) == exact
    with pytest.raises(JobRefused, match="inflates to more than"):
        inflate(zlib.compress(exact + b" "), cap)
    with pytest.raises(JobRefused, match="truncated"):
        inflate(zlib.compress(exact)[:-10], cap)
    assert inflate(b'["uncompressed"]', cap) == b'["uncompressed"]'  # RQ's fallback for plain data
    with pytest.raises(JobRefused, match="over LMDQ_MAX_JOB_BYTES"):
        inflate(b"[" * (cap + 1), cap)


def test_read_job_refuses_oversized_and_foreign_hashes_without_reading_them(client: redis.Redis) -> None:
    jid = f"hostile-{time.time_ns()}"
    key = Job.key_for(jid)
    try:
        client.hset(key, mapping={"data": os.urandom(2 << 20), "origin": "q", "status": "queued"})
        with pytest.raises(JobRefused, match="field 'data' is 2,097,152 bytes, over LMDQ_MAX_JOB_BYTES"):
            read_job(client, jid, max_job_bytes=1 << 20)
        client.hset(key, mapping={"data": zlib.compress(b'["f", null, [], {}]'), "origin": "q" * (1 << 20)})
        with pytest.raises(JobRefused, match=f"field 'origin'.*over the field cap={MAX_FIELD_BYTES:,}"):
            read_job(client, jid)
        client.hset(key, mapping={"origin": "q", "created_at": "not a date"})
        with pytest.raises(JobRefused, match="unreadable RQ fields"):
            read_job(client, jid)
        client.hset(key, mapping={"created_at": "2026-01-01T00:00:00.000000Z", "timeout": "not a timeout"})
        with pytest.raises(JobRefused, match="unreadable RQ fields"):
            read_job(client, jid)
        client.hdel(key, "created_at", "timeout")
        client.hset(key, "data", zlib.compress(zlib.compress(b"[]")))  # a zlib stream inside: RQ would inflate it
        with pytest.raises(JobRefused, match="not JSON"):
            read_job(client, jid)
        # a bomb in a field lmdq does not need (RQ inflates exc_info too) is never read
        client.hset(key, mapping={"data": zlib.compress(b'["f", null, [], {}]'),
                                  "exc_info": zlib_bomb(b"", 256 << 20)})
        client.script_flush()  # a restarted Redis has no scripts cached: the read re-loads its own
        job = read_job(client, jid)
        assert job.func_name == "f" and job.origin == "q"
        client.delete(key)
        client.set(key, "a string")
        with pytest.raises(JobRefused, match="Redis string, not an RQ job hash"):
            read_job(client, jid)
        client.delete(key)
        with pytest.raises(JobRefused, match="No such job"):
            read_job(client, jid)
    finally:
        client.delete(key)


def test_decode_job_checks_the_job_against_its_batch_record(tmp_path: Path, client: redis.Redis,
                                                            prefix: str) -> None:
    allowed = tmp_path / "allowed"
    pol = OutputPolicy([str(allowed)])
    jq = JobQueue(client, keys=Keys(prefix))
    bid = _batch(client, prefix, 2, results_url=str(allowed / "sink"))
    good, payload = decode_job(client, jq, job_id_for(bid, 1), outputs=pol)
    assert payload.results_url == f"{os.path.realpath(allowed)}/sink" and payload.requests[0].index == 1
    cases: list[tuple[dict[str, Any], str, str]] = [
        (_payload(bid, 5, index=2, results_url=str(allowed / "sink")), job_id_for(bid, 5), "outside the batch's 2"),
        (_payload(bid, 5, index=1, results_url=str(allowed / "other")), job_id_for(bid, 5), "not the one in the"),
        (_payload(bid, 5, index=1), job_id_for(bid, 5), "results_url is not the one"),
        ({**_payload(bid, 5, index=1, results_url=str(allowed / "sink")), "model": "other"}, job_id_for(bid, 5),
         "model differ"),
        (_payload(bid, 5, index=1, results_url=str(allowed / "sink")), "some-other-id", "its id is not"),
        (_payload("batch_" + "f" * 24), job_id_for("batch_" + "f" * 24, 0), "no batch record"),
        (_payload("../../x"), "x-000000", "batch_id"),
    ]
    for payload_, jid, why in cases:
        _push(client, prefix, payload_, jid)
        with pytest.raises(JobRefused, match=why):
            decode_job(client, jq, jid, outputs=pol)
    # the batch record itself is untrusted too: size-capped and validated
    client.hset(Keys(prefix).batch(bid), "meta", "x" * (2 << 20))
    with pytest.raises(JobRefused, match="over 1,048,576"):
        decode_job(client, jq, job_id_for(bid, 0), outputs=pol)
    client.hset(Keys(prefix).batch(bid), "meta", "[1, 2]")
    with pytest.raises(JobRefused, match="unreadable batch record"):
        decode_job(client, jq, job_id_for(bid, 0), outputs=pol)
    with pytest.raises(JobRefused, match="job id of 300 characters"):
        decode_job(client, jq, "j" * 300, outputs=pol)
    # a refusal quotes job data only cut short (it is logged and stored in exc_info)
    _push_raw(client, prefix, "long-name", data=json.dumps(["f" * 100_000, None, [{}], {}]))
    with pytest.raises(JobRefused, match="is not 'lmdq.jobs.queue.generate'") as e:
        decode_job(client, jq, "long-name", outputs=pol)
    assert len(str(e.value)) < 1100
    assert good.id == job_id_for(bid, 1)


def test_producer_refuses_to_stage_a_job_workers_would_refuse(client: redis.Redis, prefix: str) -> None:
    """The cap is one setting for both sides: a job over it never reaches a queue (exit 2, nothing left)."""
    from lmdq.errors import SubmitRejected
    from lmdq.submission.ledger import new_batch_id
    from lmdq.testing import enqueue_batch

    bid = new_batch_id()
    b = Batch(id=bid, model=MODEL, status=BatchStatus.validating, batch_size=2, num_jobs=2,
              request_counts=RequestCounts(total=3), created_at=time.time())
    big = "x" * (DEFAULT_MAX_JOB_BYTES // 2)  # two of them in one job: over the cap; one alone: under
    reqs = [{"index": i, "custom_id": f"r{i}", "prompt": big} for i in range(3)]
    with pytest.raises(JobTooLarge, match="job 0 of this batch would be .* smaller --batch-size") as e:
        enqueue_batch(b, reqs, client=client, keys=Keys(prefix), ttl_s=3600)
    assert isinstance(e.value, SubmitRejected) and e.value.exit_code == 2
    assert list(client.scan_iter(f"{prefix}:*")) == [] and list(client.scan_iter(f"rq:job:{bid}-*")) == []


# ---- the worker ----------------------------------------------------------------------------------


def test_traversal_job_is_refused_and_nothing_is_written_outside(tmp_path: Path, client: redis.Redis, redis_url: str,
                                                                 prefix: str, capsys: pytest.CaptureFixture[str]
                                                                 ) -> None:
    """Issue 14's attack: batch id '../../x' with local results/blob URLs. Even with a batch record
    planted for it (the attacker can write Redis), the worker refuses it and writes nothing."""
    root = tmp_path / "root"
    allowed = root / "allowed"
    allowed.mkdir(parents=True)
    sink, blobs = str(allowed / "sink"), str(allowed / "blobs")
    keys = Keys(prefix)
    store = ResultStore(client, keys=keys, ttl_s=3600)
    store.batches.create(Batch(id="../../x", model=MODEL, status=BatchStatus.queued, batch_size=1, num_jobs=1,
                             request_counts=RequestCounts(total=1), created_at=time.time(),
                             results_url=sink, blob_url=blobs))
    # RQ only saves ids of letters, digits, '_' and '-': the traversal rides in the payload's batch_id
    hostile = _push(client, prefix, _payload("../../x", results_url=sink, blob_url=blobs), "x-000000")
    good = _batch(client, prefix, 2, results_url=sink)  # queued behind the hostile job

    stats = _run_worker(client, redis_url, prefix, allowed_output_urls=str(allowed))

    assert stats["refused"] == 1 and stats["requeued"] == 0
    _assert_refused(client, prefix, hostile)
    assert len(_refusal_lines(capsys.readouterr().out, hostile)) == 1  # logged once
    # nothing outside the allowed folder, nothing for the hostile job inside it
    assert _files(root) == [Path("allowed/sink") / good / f"results-{j:06d}.jsonl" for j in range(2)]
    assert not (root / "x").exists() and not (tmp_path / "x").exists()
    # no result, partial or counter written for the forged batch; every batch key has a TTL
    assert not client.exists(keys.results("../../x"), keys.partials("../../x"))
    raw = client.hgetall(keys.batch("../../x"))
    assert raw[b"completed"] == raw[b"failed"] == b"0" and raw[b"status"] == b"queued"
    for k in client.scan_iter(f"{prefix}:batch:*"):
        assert client.ttl(k) > 0, f"orphan key without TTL: {k!r}"
    # the worker kept serving: the good batch is complete, its shards in the allowed folder
    b = wait_batch(client, prefix, good, timeout=30)
    assert b.status is BatchStatus.completed and b.request_counts.completed == 2
    assert not client.exists(keys.results(good))  # every record went to its job's shard
    assert [r.index for r in results_of(client, prefix, good)] == [0, 1]  # read back from the shards
    assert sorted(client.hkeys(keys.shards(good))) == [b"0", b"1"]
    shard = json.loads((allowed / "sink" / good / "results-000001.jsonl").read_text())
    assert shard["index"] == 1 and shard["text"]


@pytest.mark.parametrize("case", ["forged-url", "record-outside", "dotdot", "symlink", "sibling", "scheme",
                                  "blob-outside"])
def test_job_urls_must_equal_the_batch_record_and_be_allowed(case: str, tmp_path: Path, client: redis.Redis,
                                                             redis_url: str, prefix: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "link").symlink_to(outside)
    sink = str(allowed / "sink")
    bad_url = {
        "forged-url": str(outside / "sink"),
        "record-outside": str(outside / "sink"),
        "dotdot": f"{allowed}/../outside/sink",
        "symlink": str(allowed / "link" / "sink"),
        "sibling": f"{allowed}-evil/sink",
        "scheme": "memory://lmdq/sink",
        "blob-outside": str(outside / "blobs"),
    }[case]
    if case == "forged-url":
        # a real batch writing to the allowed folder, and a job forged for it that names another folder
        target = _batch(client, prefix, 2, results_url=sink)
        hostile = _push(client, prefix, _payload(target, 7, index=1, results_url=bad_url), job_id_for(target, 7))
    elif case == "blob-outside":
        target = _batch(client, prefix, 1, blob_url=bad_url)
        hostile = job_id_for(target, 0)
    else:  # the batch record itself names the URL (a careless user, or a rewritten record)
        target = _batch(client, prefix, 1, results_url=bad_url)
        hostile = job_id_for(target, 0)
    good = _batch(client, prefix, 2, results_url=sink)

    stats = _run_worker(client, redis_url, prefix, allowed_output_urls=str(allowed))

    out = capsys.readouterr().out
    why = ("not the one in the batch record" if case == "forged-url" else
           "not supported" if case == "scheme" else "outside the worker's allowed output prefixes")
    if case == "forged-url":  # a forged job: refused unread, never run, never retried
        assert stats["refused"] == 1
        _assert_refused(client, prefix, hostile)
        lines = _refusal_lines(out, hostile)
    else:
        # the batch record itself names the place: a genuine job whose requests deserve an answer. They end
        # failed (output_url_not_allowed), nothing is written there, the job ends failed in RQ, never retried
        assert stats["refused"] == 0
        lines = [ln for ln in out.splitlines() if "output URL is not allowed" in ln and hostile in ln]
        b = wait_batch(client, prefix, target, timeout=30)
        assert b.request_counts.failed == b.request_counts.total == 1, b.request_counts
        (r,) = results_of(client, prefix, target)
        assert r.status is ResultStatus.failed and r.error is not None and r.error.code == "output_url_not_allowed"
        assert why in r.error.message and "LMDQ_ALLOWED_OUTPUT_URLS" in r.error.message
        qname = queue_name(MODEL, "normal", prefix)
        assert hostile in FailedJobRegistry(qname, connection=client).get_job_ids()
        assert client.llen(rq_queue_key(qname)) == 0
    assert len(lines) == 1, lines
    assert why in lines[0]
    assert _files(outside) == [] and not Path(f"{allowed}-evil").exists()
    assert wait_batch(client, prefix, good, timeout=30).request_counts.completed == 2
    if case == "forged-url":  # the real jobs of the targeted batch still ran, to the batch's own folder
        assert wait_batch(client, prefix, target, timeout=30).request_counts.completed == 2
        assert (allowed / "sink" / target / "results-000000.jsonl").is_file()


def test_zlib_bomb_refused_in_bounded_memory_and_never_decoded_twice(tmp_path: Path, env: dict[str, str],
                                                                     client: redis.Redis, prefix: str) -> None:
    """A 2 MB job whose data inflates to 2 GiB (lmdq's own function name in front), and one with a bomb in
    'exc_info' (RQ inflates that field too): refused by a worker whose PEAK RSS stays under 1 GB (the
    kernel's own count for that process, from wait4), with no lease lost or job decoded twice."""
    head = b'["' + JOB_FUNCTION.encode() + b'", null, [{"format_version": 1, "batch_id": "'
    bomb = zlib_bomb(head, 2 << 30)
    assert 1_500_000 < len(bomb) < 2_500_000
    d = zlib.decompressobj()  # it really is a bomb: 16 MiB come out of its first ~40 kB (ratio ~1000:1)
    assert len(d.decompress(bomb, 16 << 20)) == 16 << 20 and len(bomb) - len(d.unconsumed_tail) < 40_000
    good = _batch(client, prefix, 2)
    b2 = "batch_" + "e" * 24
    forged = zlib.compress(json.dumps([JOB_FUNCTION, None, [_payload(b2)], {}]).encode())
    data_bomb = _push_raw(client, prefix, "bomb-data", data=bomb)
    exc_bomb = _push_raw(client, prefix, job_id_for(b2, 0), data=forged, exc_info=zlib_bomb(b"", 2 << 30))
    qname = queue_name(MODEL, "normal", prefix)
    client.lmove(rq_queue_key(qname), rq_queue_key(qname), "RIGHT", "LEFT")  # hostile jobs first
    client.lmove(rq_queue_key(qname), rq_queue_key(qname), "RIGHT", "LEFT")
    log = tmp_path / "worker.log"
    t0 = time.monotonic()
    with open(log, "wb") as out:
        pid = _spawn(env, out)  # reaped by _wait_peak_rss, which reads its peak RSS
    peak_kib = _wait_peak_rss(pid, timeout=180)
    took = time.monotonic() - t0
    events = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    peak_mb = peak_kib / 1024
    print(f"\n[bomb] worker peak RSS {peak_mb:.0f} MB, burst run {took:.1f} s (issue 14 before: 8.5 GB, ~67 s)")
    assert peak_mb < 1024, log.read_text()[-3000:]
    refused = [e for e in events if e.get("event") == "refused job: not an lmdq job"]
    assert sorted(e["job"] for e in refused) == sorted([data_bomb, exc_bomb]), refused
    assert "inflates to more than LMDQ_MAX_JOB_BYTES" in next(e for e in refused if e["job"] == data_bomb)["error"]
    assert not [e for e in events if "lease lost" in str(e.get("event")) or "re-queued" in str(e.get("event"))]
    for jid in (data_bomb, exc_bomb):
        _assert_refused(client, prefix, jid)
    assert [e for e in events if e.get("event") == "worker stopped"][0]["refused"] == 2
    assert wait_batch(client, prefix, good, timeout=30).request_counts.completed == 2
    assert all(r.status is ResultStatus.completed for r in results_of(client, prefix, good))
    assert DEFAULT_MAX_JOB_BYTES < (2 << 30)  # the cap is what stopped it


def _spawn(env: dict[str, str], out: Any) -> int:
    import subprocess

    p = subprocess.Popen([sys.executable, "-m", "lmdq.worker", "--engine", "sim", "--served-model-name", MODEL,
                          "--sim-step-ms", "0", "--burst", "--heartbeat-ttl", "10"],
                         env=env, stdout=out, stderr=out, cwd=ROOT)
    p.returncode = 0  # reaped by _wait_peak_rss with os.wait4, not by Popen
    return p.pid


def _wait_peak_rss(pid: int, timeout: float) -> int:
    """Wait for ``pid`` and return its peak RSS in KiB: the kernel's high-water mark of the process's own
    memory (VmHWM in /proc/PID/status, monotonic, so the last reading before exit is the peak up to then),
    read every 5 ms. Not wait4's ru_maxrss: Linux carries the PARENT's RSS over fork + exec into it, so in a
    suite whose pytest process holds a model it reports the parent's 1.7 GB, not the worker's."""
    deadline = time.monotonic() + timeout
    peak = 0
    while True:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        peak = max(peak, int(line.split()[1]))
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass
        got, status, _ = os.wait4(pid, os.WNOHANG)
        if got == pid:
            assert os.waitstatus_to_exitcode(status) == 0
            assert peak > 0, "no VmHWM reading before the worker exited"
            return peak
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.wait4(pid, 0)
            raise AssertionError(f"worker still running after {timeout} s")
        time.sleep(0.005)
