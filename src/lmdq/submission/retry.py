"""Retry a batch: resubmit its failed requests (optionally cancelled/expired ones) as a NEW batch.

The original requests are read back from the batch's own RQ job payloads (the ``batch_jobs``
list, in job order), so a retry needs no input file: same custom_ids, same per-request and batch
params, same model and priority. The new batch carries ``metadata.retry_of`` and gets fresh
indices 0..n-1 in the original order; the original batch and its results are left untouched.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from lmdq.contract import Batch, BatchStatus, Priority, Request, RequestCounts, ResultStatus
from lmdq.errors import RetryRejected
from lmdq.jobs.data import DEFAULT_MAX_JOB_BYTES
from lmdq.redis.keys import InvalidModelName, Keys, check_model_name
from lmdq.submission.ledger import BatchLedger, new_batch_id

__all__ = ["retry_batch"]


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
    max_job_bytes: int = DEFAULT_MAX_JOB_BYTES,
) -> tuple[Batch, bool]:
    """Enqueue a new batch of ``batch_id``'s failed requests. Returns (batch, created); created is
    False when ``idempotency_key`` matched an existing batch. Source jobs are read within
    ``max_job_bytes`` (LMDQ_MAX_JOB_BYTES), like a worker reads them."""
    ledger = BatchLedger(client, keys=keys, ttl_s=ttl_s, max_job_bytes=max_job_bytes)
    # what the key is bound to: this batch retried with these options (another batch or options: refused)
    fingerprint = (f"retry:{batch_id}:cancelled={include_cancelled}:expired={include_expired}:"
                   f"priority={priority.value if priority else ''}")
    if idempotency_key:
        bound = ledger.bound_batch(idempotency_key, fingerprint=fingerprint)
        if bound is not None:
            return bound, False
    orig = ledger.get(batch_id)
    if orig.model_counts:
        raise RetryRejected(f"batch {batch_id!r} runs on several models ({', '.join(orig.models)}): retry takes a "
                            "batch of one model; export its failed requests and submit them again")
    try:
        check_model_name(orig.model)
    except InvalidModelName as e:
        raise RetryRejected(f"batch {batch_id!r}: {e}; no worker can serve it (submit its file again under "
                            "a valid --model)") from e
    stuck = False
    if not orig.status.terminal:
        held = ledger.in_flight(orig)
        if held:
            raise RetryRejected(
                f"batch {batch_id!r} is {orig.status.value}; retry it once it has ended (`lmdq-producer status "
                f"{batch_id} --watch`), or cancel it first: {held} job(s) queued or running"
            )
        # Stuck: nothing queued, nothing held, yet not ended (e.g. jobs refused by an older lmdq). End it
        # (its unanswered requests become cancelled) and retry those with the failed ones.
        orig = ledger.cancel(batch_id)
        stuck = True
    statuses = {ResultStatus.failed}
    if include_cancelled or stuck:
        statuses.add(ResultStatus.cancelled)
    if include_expired:
        statuses.add(ResultStatus.expired)
    indices = ledger.indices_with(orig, statuses)
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
        # issue 47: a --reuse batch's retry answers from, and records into, the reuse index as the original did
        reuse_ttl_s=orig.reuse_ttl_s,
        created_at=now,
        expires_at=(now + orig.completion_window_s) if orig.completion_window_s else None,
    )
    if idempotency_key:  # bound only once the batch record is known to be valid
        existing_id = ledger.bind_key(idempotency_key, new_id)
        if existing_id is not None:
            return ledger.bound_batch(idempotency_key, fingerprint=fingerprint) or ledger.get(existing_id), False
    requests = (_as_dict(i, r) for i, r in enumerate(ledger.source_requests(orig, indices)))
    # enqueue undoes everything (idempotency key included) if reading the originals fails midway
    return ledger.enqueue(batch, requests, fingerprint=fingerprint if idempotency_key else None), True
