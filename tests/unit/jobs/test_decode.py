"""lmdq.jobs.decode: a queued job checked against its batch record before a worker may run it
(real redis-server; the many forged-job cases are tests/test_hostile_jobs.py's)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis
from rq.job import Job

from lmdq.jobs.data import REQUESTS_FIELD, JobRefused
from lmdq.jobs.decode import OutputNotAllowed, UndecodableJob, decode_job, prefetch, undecodable
from lmdq.jobs.queue import JobQueue, job_id_for
from lmdq.redis.keys import Keys
from lmdq.results.output_urls import OutputPolicy
from lmdq.testing import enqueue_requests


def _batch(client: redis.Redis, prefix: str, n: int, **fields: object) -> str:
    return enqueue_requests(client, Keys(prefix), "m", [{"prompt": f"q{i}"} for i in range(n)], **fields)


def test_a_genuine_job_decodes_with_its_urls_normalised(client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    sink = tmp_path / "out" / ".." / "out" / "sink"
    bid = _batch(client, prefix, 2, results_url=str(sink))
    jq = JobQueue(client, keys=Keys(prefix))
    job, payload = decode_job(client, jq, job_id_for(bid, 1), outputs=OutputPolicy([str(tmp_path / "out")]))
    assert job.id == job_id_for(bid, 1) and [r.index for r in payload.requests] == [1]
    assert payload.results_url == os.path.realpath(tmp_path / "out" / "sink")
    # outputs=None (cancel): the URL must still match the record, but is passed on as recorded
    _, as_recorded = decode_job(client, jq, job_id_for(bid, 0), outputs=None)
    assert as_recorded.results_url == str(sink)


def test_a_claim_s_jobs_are_read_in_one_round_trip_and_decode_as_read_alone(client: redis.Redis,
                                                                             prefix: str) -> None:
    """Issue 49: the jobs of one claim and their batches' records are read together (each record once); each
    decodes from those reads exactly as from its own, and a forged one is still refused by decode_job."""
    b1, b2 = _batch(client, prefix, 3, batch_size=1), _batch(client, prefix, 1)
    jq = JobQueue(client, keys=Keys(prefix))
    ids = [job_id_for(b1, 0), job_id_for(b1, 2), job_id_for(b2, 0), "not-an-lmdq-id"]
    before = int(client.info("commandstats").get("cmdstat_eval", {}).get("calls", 0))
    pre = prefetch(jq, ids)
    assert int(client.info("commandstats")["cmdstat_eval"]["calls"]) - before == 3 + 2  # 3 jobs, 2 records
    assert sorted(pre) == sorted(ids[:3])  # an id not of lmdq's form is read (and refused) the usual way
    for jid in ids[:3]:
        job, payload = decode_job(client, jq, jid, outputs=None, prefetched=pre[jid])
        alone_job, alone = decode_job(client, jq, jid, outputs=None)
        assert job.id == alone_job.id == jid and payload == alone
    client.hset(Job.key_for(ids[1]), "data", b"\x80\x04pickle")  # forged after the claim's reads: not seen
    assert decode_job(client, jq, ids[1], outputs=None, prefetched=pre[ids[1]])[0].id == ids[1]
    with pytest.raises(JobRefused, match="not JSON"):
        decode_job(client, jq, ids[1], outputs=None, prefetched=prefetch(jq, [ids[1]])[ids[1]])


def test_a_genuine_job_writing_outside_the_policy_is_answerable(client: redis.Redis, prefix: str,
                                                                 tmp_path: Path) -> None:
    bid = _batch(client, prefix, 1, results_url=str(tmp_path / "elsewhere"))
    with pytest.raises(OutputNotAllowed, match="outside") as e:
        decode_job(client, JobQueue(client, keys=Keys(prefix)), job_id_for(bid, 0),
                   outputs=OutputPolicy([str(tmp_path / "allowed")]))
    assert e.value.payload.results_url is None and e.value.payload.batch_id == bid


def test_undecodable_names_the_requests_from_the_manifest(client: redis.Redis, prefix: str) -> None:
    bid = _batch(client, prefix, 3)
    jq = JobQueue(client, keys=Keys(prefix))
    jid = job_id_for(bid, 1)
    err = undecodable(client, jq, jid, "too big")
    assert isinstance(err, UndecodableJob) and err.batch.id == bid and [i for i, _ in err.requests] == [1]


@pytest.mark.parametrize("manifest", [b"not json", b"[]", b"[[7, \"c\"]]", b"[[1, \"a\"], [1, \"b\"]]",
                                      b"[[1, \"\"]]"])
def test_undecodable_with_a_bad_manifest_answers_nothing(client: redis.Redis, prefix: str, manifest: bytes) -> None:
    bid = _batch(client, prefix, 3)
    jid = job_id_for(bid, 1)
    client.hset(Job.key_for(jid), REQUESTS_FIELD, manifest)
    err = undecodable(client, JobQueue(client, keys=Keys(prefix)), jid, "too big")
    assert type(err) is JobRefused and "names no requests" in str(err)


def test_undecodable_foreign_ids_and_jobs_beyond_the_batch(client: redis.Redis, prefix: str) -> None:
    jq = JobQueue(client, keys=Keys(prefix))
    assert type(undecodable(client, jq, "not-lmdq", "why")) is JobRefused
    assert type(undecodable(client, jq, job_id_for("batch_" + "a" * 24, 0), "why")) is JobRefused  # no record
    bid = _batch(client, prefix, 2)
    err = undecodable(client, jq, job_id_for(bid, 5), "why")
    assert type(err) is JobRefused and "not one of the batch's 2 jobs" in str(err)
