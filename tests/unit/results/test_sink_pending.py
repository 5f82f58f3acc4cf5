"""lmdq.results.sink_pending: the sink's retry schedule, on a real redis-server."""

from __future__ import annotations

import redis

from lmdq.redis.keys import Keys
from lmdq.results import sink_pending


def test_add_claim_drop_and_count(client: redis.Redis, prefix: str) -> None:
    k = Keys(prefix)
    assert k.sink_pending() == (f"{prefix}:sink:pending", f"{prefix}:sink:pending-data")
    assert sink_pending.count(client, k) == 0
    sink_pending.add(client, k, member="b1:0", data='{"r":[[0,1]],"n":0}', delay_s=0, batch_id="b1", job_no=0)
    sink_pending.add(client, k, member="b1:1", data='{"r":[[2,3]],"n":0}', delay_s=3600, batch_id="b1", job_no=1)
    assert sink_pending.count(client, k) == 2
    got = sink_pending.claim_due(client, k, limit=10, lease_s=30, ahead_s=0)
    assert got == [b"b1:0", b'{"r":[[0,1]],"n":0}']  # only the due one
    assert sink_pending.claim_due(client, k, limit=10, lease_s=30, ahead_s=0) == []  # ours for its lease
    sink_pending.drop(client, k, "b1:0")
    assert sink_pending.count(client, k) == 1


def test_a_sealed_job_is_not_scheduled_again(client: redis.Redis, prefix: str) -> None:
    k = Keys(prefix)
    client.hset(k.shards("b1"), "0", "entry")
    sink_pending.add(client, k, member="b1:0", data='{"r":[[0,1]],"n":0}', delay_s=0, batch_id="b1", job_no=0)
    assert sink_pending.count(client, k) == 0
