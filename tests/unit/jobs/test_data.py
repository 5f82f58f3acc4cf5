"""lmdq.jobs.data: bounded inflation and capped job-hash reads (real redis-server; untrusted data)."""

from __future__ import annotations

import json
import uuid
import zlib

import pytest
import redis

from lmdq.errors import ExitCode
from lmdq.jobs.data import (
    FORMAT_FIELD,
    MAX_FIELD_BYTES,
    JobRefused,
    JobTooLarge,
    JobUndecodable,
    NotDecodable,
    inflate,
    manifest,
    read_job,
    read_job_beside,
)


def test_inflate_plain_compressed_and_bombs() -> None:
    assert inflate(b'["x"]', 100) == b'["x"]'  # not zlib: as is
    assert inflate(zlib.compress(b"a" * 100), 100) == b"a" * 100
    bomb = zlib.compress(b"\0" * 10_000_000)
    with pytest.raises(NotDecodable, match="inflates to more than"):
        inflate(bomb, 1000)
    with pytest.raises(NotDecodable, match="over LMDQ_MAX_JOB_BYTES"):
        inflate(b"x" * 101, 100)
    with pytest.raises(JobRefused, match="truncated"):
        inflate(zlib.compress(b"a" * 1000)[:-6], 10_000)


def test_undecodable_is_refused_and_answerable() -> None:
    assert issubclass(NotDecodable, JobRefused) and issubclass(NotDecodable, JobUndecodable)
    assert not issubclass(JobRefused, JobUndecodable)


def test_refusal_messages_are_cut() -> None:
    msg = str(JobRefused("a" * 600 + "b" * 5000 + "z" * 300))
    assert len(msg) < 1000 and msg.startswith("a" * 600) and msg.endswith("z" * 300) and "(cut)" in msg
    assert str(JobRefused("short")) == "short"


def test_manifest_and_job_too_large() -> None:
    assert json.loads(manifest([{"index": 3, "custom_id": "é", "x": 1}])) == [[3, "é"]]
    e = JobTooLarge(4, 2_000_000, 1_000_000)
    assert "job 4" in str(e) and "2,000,000" in str(e) and e.exit_code == ExitCode.bad_input


def _job(client: redis.Redis, **fields: bytes | str) -> str:
    jid = f"unit-{uuid.uuid4().hex}"
    client.hset(f"rq:job:{jid}", mapping=fields)
    return jid


def test_read_job_reads_a_json_job(client: redis.Redis) -> None:
    data = json.dumps(["lmdq.jobs.queue.generate", None, [{"x": 1}], {}]).encode()
    jid = _job(client, data=zlib.compress(data), origin="q", status="queued")
    try:
        job = read_job(client, jid)
        assert job.id == jid and job.origin == "q"
    finally:
        client.delete(f"rq:job:{jid}")


def test_read_job_beside_reads_the_job_and_more_in_one_round_trip(client: redis.Redis) -> None:
    """What a worker starting a job reads with it (its batch record) comes in the same pipeline; the job's
    checks run when the caller asks for the job (a hostile hash still raises there, the other reply is kept)."""
    data = json.dumps(["lmdq.jobs.queue.generate", None, [{"x": 1}], {}]).encode()
    jid = _job(client, data=zlib.compress(data), origin="q", status="queued")
    bad = _job(client, data=b"\x80\x04pickle")
    other = f"unit-{uuid.uuid4().hex}"
    client.set(other, "beside")
    try:
        read, got = read_job_beside(client, jid, lambda p: p.get(other))
        assert got == b"beside" and read().id == jid
        read, got = read_job_beside(client, bad, lambda p: p.get(other))
        assert got == b"beside"
        with pytest.raises(JobRefused, match="not JSON"):
            read()
    finally:
        client.delete(f"rq:job:{jid}", f"rq:job:{bad}", other)


@pytest.mark.parametrize("fields, err, match", [
    ({"origin": "q"}, JobRefused, "no 'data'"),
    ({"data": b"\x80\x04pickle"}, JobRefused, "not JSON"),
    ({"data": zlib.compress(zlib.compress(b"[1]"))}, JobRefused, "not JSON"),
    ({"data": b"[1]", "origin": "o" * (MAX_FIELD_BYTES + 1)}, JobRefused, "field 'origin'"),
    ({"data": b"[1]", FORMAT_FIELD: "999"}, NotDecodable, "newer"),
    ({"data": b"[1]", FORMAT_FIELD: "v2"}, NotDecodable, "newer"),
    ({"data": b"[" + b" " * 5000 + b"]"}, NotDecodable, "LMDQ_MAX_JOB_BYTES=1,000"),
])
def test_read_job_refuses_hostile_hashes(client: redis.Redis, fields: dict[str, bytes | str],
                                         err: type[Exception], match: str) -> None:
    jid = _job(client, **fields)
    try:
        with pytest.raises(err, match=match):
            read_job(client, jid, max_job_bytes=1000)
    finally:
        client.delete(f"rq:job:{jid}")


def test_read_job_missing_and_wrong_type(client: redis.Redis) -> None:
    with pytest.raises(JobRefused, match="no job hash"):
        read_job(client, f"unit-{uuid.uuid4().hex}")
    jid = f"unit-{uuid.uuid4().hex}"
    client.set(f"rq:job:{jid}", "x")
    try:
        with pytest.raises(JobRefused, match="string, not an RQ job hash"):
            read_job(client, jid)
    finally:
        client.delete(f"rq:job:{jid}")


# ---- issue 49: requests spliced into a job as the JSON the producer validated ------------------------------

def _spilled(index: int, cid: str, **rest: object) -> bytes:
    import orjson

    return orjson.dumps({"index": index, "custom_id": cid, "endpoint": "chat", **rest})


def test_raw_requests_manifest_is_read_off_the_bytes_and_parsed_when_in_doubt() -> None:
    from lmdq.jobs.data import RawRequests

    odd = 'a,"endpoint":"x"\\é{"index":9,'  # a quote, a backslash and a request's head inside the id
    raws = [_spilled(7, odd, prompt='{"index":1,"custom_id":"z","endpoint":"chat"}'), _spilled(8, "b", prompt="hi")]
    assert json.loads(RawRequests(raws).manifest()) == [[7, odd], [8, "b"]]
    other = [b'{"custom_id":"a","index":1,"endpoint":"chat"}', _spilled(2, "b")]  # another key order: parsed
    assert json.loads(RawRequests(other).manifest()) == [[1, "a"], [2, "b"]]
    nested = [_spilled(3, "c", messages=[{"index": 5, "custom_id": "n", "endpoint": "x"}])]  # one head too many
    assert json.loads(RawRequests(nested).manifest()) == [[3, "c"]]


def test_manifest_and_job_data_are_the_same_from_raw_requests_and_dicts() -> None:
    """A job staged from the spill's bytes holds, once parsed, exactly what the dicts gave; its manifest too."""
    from lmdq.jobs.data import RawRequests
    from lmdq.jobs.queue import SERIALIZER

    raws = [_spilled(i, f"id-{i}-ü", prompt=f"p {i} \u2028", params={"max_new_tokens": 3}) for i in range(5)]
    dicts = [json.loads(r) for r in raws]
    assert json.loads(manifest(RawRequests(raws))) == json.loads(manifest(dicts)) == [[i, f"id-{i}-ü"]
                                                                                      for i in range(5)]
    job = ("lmdq.jobs.queue.generate", None, [{"batch_id": "b", "requests": RawRequests(raws)}], {})
    assert json.loads(SERIALIZER.dumps(job)) == json.loads(
        SERIALIZER.dumps(("lmdq.jobs.queue.generate", None, [{"batch_id": "b", "requests": dicts}], {})))
    # what orjson refuses (an int over 64 bits) is still written, by the stdlib, the raw requests parsed
    big = ("f", None, [{"n": 2**70, "requests": RawRequests(raws[:1])}], {})
    assert json.loads(SERIALIZER.dumps(big)) == ["f", None, [{"n": 2**70, "requests": dicts[:1]}], {}]
