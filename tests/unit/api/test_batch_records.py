"""lmdq.api.batch_records: the HTTP API's batch records, their open set and their one-replica lease."""

from __future__ import annotations

import redis

from lmdq.api.batch_records import ApiBatchRecords
from lmdq.redis.keys import Keys


def _records(client: redis.Redis, prefix: str) -> tuple[ApiBatchRecords, Keys]:
    keys = Keys(prefix)
    return ApiBatchRecords(client, keys), keys


def test_create_writes_the_owner_lists_it_for_the_tenant_and_marks_it_open(client: redis.Redis, prefix: str) -> None:
    recs, keys = _records(client, prefix)
    recs.create("batch_1", "acme", {"state": "validating", "runs": 0}, ttl_s=300, created=2.5)
    assert recs.read("batch_1") == {b"tenant": b"acme", b"state": b"validating", b"runs": b"0"}
    assert 0 < client.ttl(keys.api_batch("batch_1")) <= 300 and 0 < client.ttl(recs.index("acme")) <= 300
    assert recs.index("acme") == f"{prefix}:api:tenant:acme:batches"
    assert client.zrange(recs.index("acme"), 0, -1, withscores=True) == [(b"batch_1", 2.5)]
    assert recs.open_ids() == ["batch_1"]


def test_fields_update_set_once_has_field_and_count_run(client: redis.Redis, prefix: str) -> None:
    recs, _ = _records(client, prefix)
    recs.create("batch_2", "t", {"state": "validating", "runs": 0}, ttl_s=60, created=1.0)
    assert [recs.count_run("batch_2"), recs.count_run("batch_2")] == [1, 2]
    assert recs.set_once("batch_2", "cancel_requested_at", 100) is True
    assert recs.set_once("batch_2", "cancel_requested_at", 200) is False  # the first request's time stays
    assert recs.field("batch_2", "cancel_requested_at") == b"100"
    assert recs.has_field("batch_2", "cancel_requested_at") and not recs.has_field("batch_2", "lmdq_id")
    recs.update("batch_2", {"state": "submitted", "lmdq_id": "b-9"})
    assert recs.field("batch_2", "lmdq_id") == b"b-9" and recs.field("batch_2", "last_error") is None
    assert recs.open_ids() == ["batch_2"]  # an update leaves it open


def test_finish_ends_it_and_takes_it_off_the_open_set_and_the_sweep_reads(client: redis.Redis, prefix: str) -> None:
    recs, _ = _records(client, prefix)
    for i in (1, 2, 3):
        recs.create(f"batch_{i}", "t", {"state": "validating"}, ttl_s=60, created=float(i))
    recs.finish("batch_1", {"state": "failed", "failed_at": 7})
    assert recs.read("batch_1")[b"state"] == b"failed"
    assert sorted(recs.open_ids()) == ["batch_2", "batch_3"]
    assert recs.take_lease("batch_3", "tok", 60)
    got = recs.open_records(["batch_2", "batch_3", "batch_gone"])
    assert [(raw.get(b"state"), leased) for raw, leased in got] == [(b"validating", False),
                                                                    (b"validating", True), (None, False)]
    assert recs.read_many(["batch_gone", "batch_2"]) == [{}, {b"tenant": b"t", b"state": b"validating"}]
    recs.drop_open(["batch_2", "batch_gone"])
    recs.drop_open([])
    assert recs.open_ids() == ["batch_3"]


def test_the_lease_is_held_by_one_token_renewed_held_back_or_dropped_only_by_it(client: redis.Redis,
                                                                                prefix: str) -> None:
    recs, keys = _records(client, prefix)
    lease = keys.api_lease("batch_l")
    assert recs.take_lease("batch_l", "a", 30) and not recs.take_lease("batch_l", "b", 30)
    recs.renew_lease("batch_l", "b", 1000)  # not b's: unchanged
    assert client.ttl(lease) <= 30
    recs.renew_lease("batch_l", "a", 1000)
    assert 30 < client.ttl(lease) <= 1000
    recs.drop_lease("batch_l", "b")
    assert client.get(lease) == b"a"
    recs.drop_lease("batch_l", "a", hold_s=5)  # kept a while: the back-off before a re-run
    assert client.get(lease) == b"a" and 0 < client.ttl(lease) <= 5
    recs.drop_lease("batch_l", "a")
    assert client.exists(lease) == 0 and recs.take_lease("batch_l", "b", 30)
