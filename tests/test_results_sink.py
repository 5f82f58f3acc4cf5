"""lmdq.results.sink: a job's shard is the exact bytes Redis held, sealed only when it may be, and the
retry schedule of shard writes that failed (real redis-server, real folder sink)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis

from lmdq.contract import Batch, BatchStatus, JobPayload, Request, RequestCounts, Result, ResultStatus
from lmdq.redis.keys import Keys
from lmdq.results.blobs import SinkAbandoned
from lmdq.results.reader import ResultReader
from lmdq.results.shards import shard_key
from lmdq.results.sink import PendingShard, add_pending, claim_pending, drop_pending, flush_job, pending_count
from lmdq.results.store import ResultStore


def _setup(client: redis.Redis, prefix: str, tmp_path: Path, indices: list[int], total: int = 4
           ) -> tuple[Keys, ResultStore, Batch, JobPayload]:
    keys = Keys(prefix)
    store = ResultStore(client, keys=keys, ttl_s=3600)
    url = str(tmp_path / "sink")
    b = Batch(id=f"batch_{time.time_ns():024x}"[:30], model="m", status=BatchStatus.in_progress, batch_size=2,
              request_counts=RequestCounts(total=total), created_at=time.time(), results_url=url)
    store.batches.create(b)
    for i in indices:
        assert store.write_result(Result(batch_id=b.id, custom_id=f"r{i}", index=i, status=ResultStatus.completed,
                                         text=f"answer {i} é", model="m"))
    payload = JobPayload(batch_id=b.id, model="m", job_no=3, results_url=url,
                         requests=[Request(index=i, custom_id=f"r{i}", prompt="p") for i in indices])
    return keys, store, b, payload


def test_the_shard_is_the_bytes_redis_held_in_index_order(client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    """A job of requests out of input order (prefix groups): its shard holds Redis' exact bytes, sorted by
    index, its entry names them as runs, and the reader serves them where they belong."""
    keys, store, b, payload = _setup(client, prefix, tmp_path, [3, 0, 1])
    held = {i: client.hget(keys.results(b.id), str(i)) for i in (0, 1, 3)}
    entry = flush_job(client, keys, payload)
    assert entry is not None and entry.ranges == [(0, 1), (3, 3)]
    shard = tmp_path / "sink" / shard_key(b.id, 3)
    assert shard.read_bytes() == b"".join(held[i] + b"\n" for i in (0, 1, 3))  # type: ignore[operator]
    got = dict(ResultReader.of(store, store.batches.get(b.id)).records(partial=False))
    assert got == {0: held[0], 1: held[1], 2: None, 3: held[3]}


def test_nothing_is_sealed_past_the_drain_deadline(client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    """``cancel`` set (the worker is past its drain deadline): the seal does not run, so the records stay
    in Redis, where every reader still finds them, and the job has no index entry."""
    keys, store, b, payload = _setup(client, prefix, tmp_path, [0, 1])
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(SinkAbandoned):
        flush_job(client, keys, payload, cancel=cancel)
    assert client.hlen(keys.results(b.id)) == 2 and not client.exists(keys.shards(b.id))
    assert [i for i, raw in store.iter_results(b.id) if raw] == [0, 1]


def test_a_job_of_a_purged_batch_is_not_sealed(client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    keys, store, b, payload = _setup(client, prefix, tmp_path, [0, 1])
    client.delete(keys.batch(b.id))  # purged (or expired) after its results were written
    assert flush_job(client, keys, payload) is None
    assert not client.exists(keys.shards(b.id), keys.sealed(b.id))  # nothing brought back without a TTL


def test_the_retry_schedule_leases_entries_and_forgets_sealed_jobs(client: redis.Redis, prefix: str,
                                                                   tmp_path: Path) -> None:
    keys, store, b, payload = _setup(client, prefix, tmp_path, [0, 1])
    p = PendingShard(batch_id=b.id, job_no=3, ranges=[(0, 1)])
    add_pending(client, keys, p, 0.0)
    assert pending_count(client, keys) == 1
    assert claim_pending(client, keys, limit=10, lease_s=60) == [p]
    assert claim_pending(client, keys, limit=10, lease_s=60) == []  # ours for the lease: not claimed twice
    assert claim_pending(client, keys, limit=10, lease_s=60, ahead_s=120) == [p]  # a last sweep takes it
    assert flush_job(client, keys, payload) is not None  # another worker's flush landed meanwhile
    add_pending(client, keys, p.model_copy(update={"tries": 1}), 0.0)  # the failed try reschedules it...
    assert pending_count(client, keys) == 0  # ...but a sealed job is taken off the schedule instead
    add_pending(client, keys, PendingShard(batch_id=b.id, job_no=4, ranges=[(2, 3)]), 0.0)
    drop_pending(client, keys, f"{b.id}:4")
    assert pending_count(client, keys) == 0
