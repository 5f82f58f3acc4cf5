"""lmdq.batches.records: a batch's record written, read and moved between states on a real Redis."""

from __future__ import annotations

import time

import pytest
import redis

from lmdq.batches.records import RUNNING_TTL_S, STAGING_TTL_S, BatchRecords, staging_ttl
from lmdq.contract import Batch, BatchStatus, RequestCounts
from lmdq.errors import BatchNotFound
from lmdq.redis.keys import BatchField, Keys


def _batch(n: int, created_at: float) -> Batch:
    return Batch(id=f"batch_{n:024x}", model="m", status=BatchStatus.validating, batch_size=2,
                 request_counts=RequestCounts(total=4), created_at=created_at, idempotency_key=f"k{n}")


def test_a_record_reads_back_as_written_with_live_counters(client: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    records = BatchRecords(client, keys=keys, ttl_s=60)
    b = _batch(1, time.time())
    records.create(b, extra={BatchField.fingerprint.value: "fp"})
    got = records.get(b.id)
    assert got == b
    raw = client.hgetall(keys.batch(b.id))
    assert raw[b"ttl"] == b"60" and raw[b"fingerprint"] == b"fp" and raw[b"completed"] == b"0"
    assert raw[b"idempotency"] == keys.idempotency("k1").encode()
    # the TTL a submit's staging keys get: at least a day, so a slow submit is not expired under itself
    assert STAGING_TTL_S - 5 <= client.ttl(keys.batch(b.id)) <= STAGING_TTL_S
    assert staging_ttl(60) == STAGING_TTL_S and staging_ttl(10 * STAGING_TTL_S) == 10 * STAGING_TTL_S
    assert RUNNING_TTL_S > STAGING_TTL_S
    client.hincrby(keys.batch(b.id), BatchField.completed.value, 3)  # what the results script bumps
    assert records.get(b.id).request_counts.completed == 3
    with pytest.raises(BatchNotFound):
        records.get("batch_" + "0" * 24)


def test_newest_first_and_many_at_once(client: redis.Redis, prefix: str) -> None:
    records = BatchRecords(client, keys=Keys(prefix), ttl_s=60)
    bs = [_batch(n, 1000.0 + n) for n in range(3)]
    for b in bs:
        records.create(b)
    assert [b.id for b in records.newest(2)] == [bs[2].id, bs[1].id]
    assert [b.id for b in records.get_many([bs[0].id, "batch_" + "f" * 24, bs[2].id])] == [bs[0].id, bs[2].id]


def test_transition_moves_only_from_the_given_states_and_ends_the_batch(client: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    records = BatchRecords(client, keys=keys, ttl_s=60)
    b = _batch(7, time.time())
    records.create(b)
    client.expire(keys.batch(b.id), RUNNING_TTL_S)  # as the commit leaves it
    assert records.transition(b.id, [BatchStatus.queued], BatchStatus.in_progress) == "validating"  # not moved
    assert records.transition(b.id, [BatchStatus.validating], BatchStatus.in_progress,
                              BatchField.in_progress_at) == "in_progress"
    assert records.get(b.id).in_progress_at is not None
    assert client.ttl(keys.batch(b.id)) > STAGING_TTL_S  # still running: the running bound
    assert records.transition(b.id, [BatchStatus.in_progress], BatchStatus.cancelled) == "cancelled"
    assert 0 < client.ttl(keys.batch(b.id)) <= 60  # ended: its own retention starts now
    assert records.transition("batch_" + "0" * 24, [BatchStatus.queued], BatchStatus.in_progress) is None
