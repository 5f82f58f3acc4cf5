"""Cancel a batch: pull its queued jobs off the queue, abort what workers hold.

Queued jobs are removed by one Lua script that rebuilds the queue list without the batch's
job ids (O(queue length), not O(jobs × queue)), and their requests get 'cancelled' results
right here, so counts are right even when no worker is running. In-flight requests are aborted
by their workers, which watch the cancelled set.
"""

from __future__ import annotations

import time

import redis

from lmdq.contract import Batch, BatchStatus, Result, ResultStatus, Timings
from lmdq.jobs import JobQueue, job_id_prefix
from lmdq.keys import Keys, queue_names, rq_queue_key
from lmdq.store import ResultStore

__all__ = ["cancel_batch"]

# KEYS: queue list.  ARGV: id prefix.  Returns the removed ids.
_REMOVE_PREFIX = """
local ids = redis.call('LRANGE', KEYS[1], 0, -1)
local keep, gone = {}, {}
local p = ARGV[1]
for _, id in ipairs(ids) do
  if string.sub(id, 1, string.len(p)) == p then table.insert(gone, id) else table.insert(keep, id) end
end
if #gone > 0 then
  redis.call('DEL', KEYS[1])
  for s = 1, #keep, 4000 do
    redis.call('RPUSH', KEYS[1], unpack(keep, s, math.min(s + 3999, #keep)))
  end
end
return gone
"""


def cancel_batch(client: redis.Redis, keys: Keys, batch_id: str, *, ttl_s: int) -> Batch:
    store = ResultStore(client, keys=keys, ttl_s=ttl_s)
    batch = store.get_batch(batch_id)
    if batch.status.terminal:
        return batch
    store.transition(
        batch_id,
        [BatchStatus.validating, BatchStatus.queued, BatchStatus.in_progress],
        BatchStatus.cancelling,
        "cancelling_at",
    )
    client.sadd(keys.cancelled(), batch_id)
    remove = client.register_script(_REMOVE_PREFIX)
    jq = JobQueue(client, keys=keys, job_ttl_s=ttl_s)
    now = time.time()
    for q in queue_names(batch.model, keys.prefix):
        gone = remove(keys=[rq_queue_key(q)], args=[job_id_prefix(batch_id)])
        for jid in gone:
            job = jq.fetch_job(jid.decode())
            payload = jq.payload_of(job)
            store.write_results(
                Result(
                    batch_id=batch_id,
                    custom_id=r.custom_id,
                    index=r.index,
                    status=ResultStatus.cancelled,
                    model=batch.model,
                    endpoint=r.endpoint,
                    error=None,
                    timings=Timings(enqueued_at=batch.created_at, finished_at=now),
                )
                for r in payload.requests
            )
            client.hset(job.key, "status", "canceled")
    # A batch with nothing in flight may already be complete; otherwise workers finish it.
    b = store.get_batch(batch_id)
    if b.request_counts.done >= b.request_counts.total and b.status is BatchStatus.cancelling:
        store.transition(batch_id, [BatchStatus.cancelling], BatchStatus.cancelled, "cancelled_at")
    return store.get_batch(batch_id)
