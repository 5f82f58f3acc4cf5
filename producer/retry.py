"""Retry a batch: resubmit its failed requests (optionally cancelled/expired ones) as a NEW batch.

The original requests are read back from the batch's own RQ job payloads (the ``batch_jobs``
list, in job order), so a retry needs no input file: same custom_ids, same per-request and batch
params, same model and priority. The new batch carries ``metadata.retry_of`` and gets fresh
indices 0..n-1 in the original order; the original batch and its results are left untouched.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import redis
from lmdq.producer.submit import claim_idempotency_key, enqueue_batch, new_batch_id
from rq.job import Job

from lmdq.contract import Batch, BatchStatus, Priority, Request, RequestCounts, ResultStatus
from lmdq.errors import RetryRejected
from lmdq.jobs import SERIALIZER, JobQueue
from lmdq.keys import Keys
from lmdq.store import ResultStore

__all__ = ["retry_batch"]

_FETCH_CHUNK = 500


def _indices_to_retry(store: ResultStore, batch: Batch, statuses: set[ResultStatus]) -> list[int]:
    """Indices of final results whose status is in ``statuses``, in input order."""
    wanted = {s.value for s in statuses}
    out = []
    for index, raw in store.iter_results(batch.id, batch.request_counts.total, partial=False):
        if raw is not None and json.loads(raw)["status"] in wanted:
            out.append(index)
    return out


def _original_requests(client: redis.Redis, keys: Keys, batch: Batch, indices: list[int]) -> Iterator[Request]:
    """The accepted requests at ``indices`` (sorted), read from the batch's job payloads."""
    bs = batch.batch_size
    by_job: dict[int, set[int]] = {}
    for i in indices:
        by_job.setdefault(i // bs, set()).add(i)
    job_ids = [j.decode() for j in client.lrange(keys.batch_jobs(batch.id), 0, -1)]
    needed = sorted(by_job)
    if needed and needed[-1] >= len(job_ids):
        raise RetryRejected(
            f"batch {batch.id!r}: its job list has {len(job_ids)} jobs, request index {indices[-1]} needs "
            f"job {needed[-1]} (jobs expire with the batch's results)"
        )
    for start in range(0, len(needed), _FETCH_CHUNK):
        chunk = needed[start : start + _FETCH_CHUNK]
        jobs = Job.fetch_many([job_ids[n] for n in chunk], connection=client, serializer=SERIALIZER)
        for job_no, job in zip(chunk, jobs):
            if job is None:
                raise RetryRejected(f"batch {batch.id!r}: job {job_ids[job_no]} is gone (expired?)")
            try:
                payload = JobQueue.payload_of(job)
            except ValueError as e:
                raise RetryRejected(f"batch {batch.id!r}: job {job.id} is not a readable lmdq job: {e}") from e
            want = by_job[job_no]
            found = [r for r in payload.requests if r.index in want]
            if len(found) != len(want):
                missing = sorted(want - {r.index for r in found})
                raise RetryRejected(f"batch {batch.id!r}: job {job.id} lacks request indices {missing[:5]}")
            yield from found


def _as_dict(new_index: int, r: Request) -> dict[str, Any]:
    d = r.model_dump(mode="json", exclude_none=True)
    d["index"] = new_index
    return d


def retry_batch(
    client: redis.Redis,
    keys: Keys,
    batch_id: str,
    *,
    ttl_s: int,
    include_cancelled: bool = False,
    include_expired: bool = False,
    priority: Priority | None = None,
    idempotency_key: str | None = None,
) -> tuple[Batch, bool]:
    """Enqueue a new batch of ``batch_id``'s failed requests. Returns (batch, created); created is
    False when ``idempotency_key`` matched an existing batch."""
    store = ResultStore(client, keys=keys, ttl_s=ttl_s)
    if idempotency_key:
        existing = client.get(keys.idempotency(idempotency_key))
        if existing:
            return store.get_batch(existing.decode()), False
    orig = store.get_batch(batch_id)
    if not orig.status.terminal:
        raise RetryRejected(
            f"batch {batch_id!r} is {orig.status.value}; retry it once it has ended "
            f"(`lmdq-producer status {batch_id} --watch`)"
        )
    statuses = {ResultStatus.failed}
    if include_cancelled:
        statuses.add(ResultStatus.cancelled)
    if include_expired:
        statuses.add(ResultStatus.expired)
    indices = _indices_to_retry(store, orig, statuses)
    if not indices:
        c = orig.request_counts
        which = "/".join(sorted(s.value for s in statuses))
        raise RetryRejected(
            f"batch {batch_id!r} has no {which} requests to retry (failed={c.failed} cancelled={c.cancelled} "
            f"expired={c.expired}; see --include-cancelled / --include-expired)"
        )
    metadata = {**orig.metadata, "retry_of": batch_id}
    if len(metadata) > 16:
        raise RetryRejected(f"batch {batch_id!r} already has 16 metadata keys; no room for 'retry_of'")

    new_id = new_batch_id()
    if idempotency_key:
        existing_id = claim_idempotency_key(client, keys, idempotency_key, new_id, ttl_s)
        if existing_id is not None:
            return store.get_batch(existing_id), False
    now = time.time()
    n = len(indices)
    batch = Batch(
        id=new_id,
        model=orig.model,
        status=BatchStatus.validating,
        input_file=orig.input_file,
        priority=priority or orig.priority,
        batch_size=orig.batch_size,
        num_jobs=(n + orig.batch_size - 1) // orig.batch_size,
        params=orig.params,
        request_counts=RequestCounts(total=n),
        metadata=metadata,
        idempotency_key=idempotency_key,
        completion_window_s=orig.completion_window_s,
        results_url=orig.results_url,
        blob_url=orig.blob_url,
        created_at=now,
        expires_at=(now + orig.completion_window_s) if orig.completion_window_s else None,
    )
    requests = (_as_dict(i, r) for i, r in enumerate(_original_requests(client, keys, orig, indices)))
    # enqueue_batch undoes everything (idempotency key included) if reading the originals fails midway
    return enqueue_batch(batch, requests, client=client, keys=keys, ttl_s=ttl_s), True
