"""lmdq.results.sink's store: the shard index entry, a job's finals, the one-call seal and the retry schedule,
on a real redis-server."""

from __future__ import annotations

import redis

from lmdq.contract import Result, ResultStatus
from lmdq.redis.keys import BatchField, Keys
from lmdq.results import sink


def test_seal_moves_records_out_and_the_entry_in_once(client: redis.Redis, prefix: str) -> None:
    k = Keys(prefix)
    client.hset(k.batch("b1"), mapping={BatchField.status.value: "in_progress", BatchField.ttl.value: 60})
    client.hset(k.results("b1"), mapping={"0": "r0", "1": "r1", "2": "r2"})
    assert sink.index_entry(client, k, "b1", "0") is None
    assert sink.job_finals(client, k, "b1", [0, 1, 5]) == [b"r0", b"r1", None]
    assert sink.seal(client, k, "b1", "0", "entry", 60, [0, 1]) == 1
    assert sink.index_entry(client, k, "b1", "0") == b"entry"
    assert client.hkeys(k.results("b1")) == [b"2"]  # only the sealed job's records left
    assert client.getbit(k.sealed("b1"), 0) == 1 and client.getbit(k.sealed("b1"), 1) == 1
    assert client.getbit(k.sealed("b1"), 2) == 0
    assert sink.seal(client, k, "b1", "0", "other", 60, [0, 1]) == 0  # fenced on the entry
    assert sink.index_entry(client, k, "b1", "0") == b"entry"


def test_add_claim_drop_and_count(client: redis.Redis, prefix: str) -> None:
    k = Keys(prefix)
    assert k.sink_pending() == (f"{prefix}:sink:pending", f"{prefix}:sink:pending-data")
    assert sink.pending_count(client, k) == 0
    sink.pending_add(client, k, member="b1:0", data='{"r":[[0,1]],"n":0}', delay_s=0, batch_id="b1", job_no=0)
    sink.pending_add(client, k, member="b1:1", data='{"r":[[2,3]],"n":0}', delay_s=3600, batch_id="b1", job_no=1)
    assert sink.pending_count(client, k) == 2
    got = sink.pending_claim_due(client, k, limit=10, lease_s=30, ahead_s=0)
    assert got == [b"b1:0", b'{"r":[[0,1]],"n":0}']  # only the due one
    assert sink.pending_claim_due(client, k, limit=10, lease_s=30, ahead_s=0) == []  # ours for its lease
    sink.pending_drop(client, k, "b1:0")
    assert sink.pending_count(client, k) == 1


def test_a_sealed_job_is_not_scheduled_again(client: redis.Redis, prefix: str) -> None:
    k = Keys(prefix)
    client.hset(k.shards("b1"), "0", "entry")
    sink.pending_add(client, k, member="b1:0", data='{"r":[[0,1]],"n":0}', delay_s=0, batch_id="b1", job_no=0)
    assert sink.pending_count(client, k) == 0


def test_a_records_status_is_read_from_its_head_and_otherwise_parsed() -> None:
    """The seal counts statuses from each record's head (no parse of its text); a custom_id made to look
    like a status key, or a record in another field order, still gives the record's own status."""
    for cid in ['a"status":"failed"', 'x\\', '\\"status\\":\\"failed', "plain"]:
        for st in (ResultStatus.completed, ResultStatus.failed):
            raw = Result(batch_id="batch_x", custom_id=cid, index=3, status=st, model="m",
                         text='"status":"expired"').model_dump_json().encode()
            assert sink._HEAD.match(raw) is not None and sink._status(raw) is st
    assert sink._status(b'{"custom_id":"c","status":"cancelled"}') is ResultStatus.cancelled  # full parse
    for bad in (b"not json", b'{"status":"nope"}', b"[1]"):
        try:
            sink._status(bad)
        except ValueError as e:
            assert "not a result record" in str(e)
        else:
            raise AssertionError(bad)
