"""lmdq.jobs.reads: plain reads for callers outside the owning object, untrusted replies kept raw."""

from __future__ import annotations

import redis
from rq.job import Job

from lmdq.jobs import reads
from lmdq.redis.keys import BatchField, Keys


def test_batch_status_is_the_raw_field_and_none_without_a_record(client: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    client.hset(keys.batch("b1"), BatchField.status.value, "in_progress")
    assert reads.batch_status(client, keys, "b1") == b"in_progress"
    assert reads.batch_status(client, keys, "nope") is None


def test_capped_job_field_hands_over_at_most_cap_bytes(client: redis.Redis, prefix: str) -> None:
    job_id = f"{prefix}-job-0"
    client.hset(Job.key_for(job_id), mapping={"small": "abc", "large": "x" * 100})
    assert reads.capped_job_field(client, job_id, "small", cap=3) == (3, b"abc")
    assert reads.capped_job_field(client, job_id, "large", cap=99) == (100, None)  # the size, not the bytes
    assert reads.capped_job_field(client, job_id, "missing", cap=10) == (0, None)


def test_inflight_count_is_the_models_inflight_list_length(client: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    assert reads.inflight_count(client, keys, "m") == 0
    client.rpush(keys.inflight("m"), "j1", "j2")
    client.rpush(keys.inflight("other"), "j3")
    assert reads.inflight_count(client, keys, "m") == 2
