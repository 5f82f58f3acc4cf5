"""Turning a queued job into a payload a worker may run: the one door untrusted job data comes in by.

Anyone who can push to the queue can hand a worker a job, so everything read here is untrusted
input (see docs/reliability.md, security). In order, each step bounded before the next one runs:

1. the job hash is read within caps and its data inflated as a stream that stops at
   ``LMDQ_MAX_JOB_BYTES`` (:mod:`lmdq.jobs.data`): a zlib bomb costs a few MB and milliseconds;
2. the data must be lmdq's function with ONE JSON payload, valid as :class:`~lmdq.contract.JobPayload`
   (batch id of the form lmdq makes, bounded ids and indices, unique indices);
3. the batch record the producer wrote must exist (size-capped), name the same model, hold the
   request indices, and name the SAME output URLs as the job; the worker then takes those URLs from
   the batch record, never from the job;
4. each output URL must fall under a prefix the worker allows (:mod:`lmdq.results.output_urls`) and is
   replaced by its normalised form, which is where the worker writes.

A job failing any step raises :class:`JobRefused`: it is refused, never run and never retried.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import ValidationError
from rq.job import Job

from lmdq.contract import MAX_JOB_REQUESTS, Batch, JobPayload
from lmdq.jobs import reads
from lmdq.jobs.data import MAX_FIELD_BYTES, REQUESTS_FIELD, JobRefused, NotDecodable
from lmdq.jobs.queue import JobQueue, job_id_for
from lmdq.redis.scripts import LuaScript
from lmdq.results.output_urls import OutputPolicy, OutputUrlRejected

__all__ = [
    "MAX_BATCH_RECORD_BYTES",
    "MAX_JOB_ID_CHARS",
    "JobRefused",
    "OutputNotAllowed",
    "Prefetched",
    "UndecodableJob",
    "decode_job",
    "prefetch",
    "undecodable",
]


class OutputNotAllowed(JobRefused):
    """A well-formed job of a live batch whose results/blob URL (the batch record's own) is outside what
    this worker may write to (LMDQ_BLOB_URL, LMDQ_ALLOWED_OUTPUT_URLS). Unlike a forged job, its requests
    deserve an answer: the worker fails them (``output_url_not_allowed``) and writes nothing there, and
    the job ends failed in RQ, never retried. ``payload`` is the job's, with its URLs removed."""

    def __init__(self, message: str, *, job: Job, payload: JobPayload) -> None:
        super().__init__(message)
        self.job = job
        self.payload = payload

class UndecodableJob(JobRefused):
    """A job of a live batch that this worker cannot decode (:class:`~lmdq.jobs.data.NotDecodable`: a newer
    job format, data over its LMDQ_MAX_JOB_BYTES) but whose requests it can name from the job's manifest
    (:data:`~lmdq.jobs.data.REQUESTS_FIELD`). Like :class:`OutputNotAllowed` its requests are answered (failed,
    ``undecodable_job``, with the reason) so the batch ends; the job ends failed in RQ, never retried."""

    def __init__(self, message: str, *, batch: Batch, requests: list[tuple[int, str]]) -> None:
        super().__init__(message)
        self.batch = batch
        self.requests = requests


MAX_JOB_ID_CHARS = 256
"""lmdq job ids are ``<batch id>-<job no>`` (37 characters); ids come off the queue list, untrusted too."""

MAX_BATCH_RECORD_BYTES = 1 << 20
"""Cap on a batch record's ``meta`` field (a Batch with 16 metadata pairs and params is a few kB)."""



@dataclass(frozen=True)
class Prefetched:
    """A claimed job's reads made with the other jobs of its claim (:func:`prefetch`): its capped read, as a
    call that raises what :meth:`JobQueue.fetch_job` raises, and its batch record's raw READ_BATCH reply."""

    read: Callable[[], Job]
    batch: Any


def prefetch(queue: JobQueue, job_ids: list[str]) -> dict[str, Prefetched]:
    """The reads :func:`decode_job` makes, for every job of a claim in ONE round trip: each job's capped read
    and, once per batch among them, its record (issue 49: a round trip per job cost Redis ~24 us of CPU; a
    claim takes ~3 jobs, often of one batch). Ids not of lmdq's form are left out (:func:`decode_job` reads
    them itself, and refuses them). Nothing is checked here: each job's thread decodes its own reads."""
    ids = [(j, m.group(1)) for j in job_ids if len(j) <= MAX_JOB_ID_CHARS and (m := _JOB_ID.match(j)) is not None]
    if not ids:
        return {}
    batches = list(dict.fromkeys(b for _, b in ids))

    def records(p: Any) -> None:
        for b in batches:
            _queue_batch_read(p, queue, b)

    reads, got = queue.fetch_jobs_beside([j for j, _ in ids], records)
    record = dict(zip(batches, got, strict=True))
    return {j: Prefetched(read=r, batch=record[b]) for (j, b), r in zip(ids, reads, strict=True)}


def decode_job(
    client: redis.Redis, queue: JobQueue, job_id: str, *, outputs: OutputPolicy | None,
    prefetched: Prefetched | None = None,
) -> tuple[Job, JobPayload]:
    """Fetch ``job_id`` and decode its payload (see the module doc). Raises :class:`JobRefused` for
    anything that is not a well-formed lmdq job of a live batch writing where this worker allows;
    Redis errors propagate unchanged (the job is then re-queued, not refused).

    ``prefetched``: the job's reads, made with its claim's other jobs (:func:`prefetch`).

    ``outputs=None`` is for callers that write nothing to the job's URLs (cancel writes its results to
    Redis only): the URLs must still equal the batch record's, but no worker policy applies."""
    if len(job_id) > MAX_JOB_ID_CHARS:
        raise JobRefused(f"job id of {len(job_id):,} characters, over {MAX_JOB_ID_CHARS}")
    # An id of the form lmdq gives names its batch: its record is read with the job, in one round trip (it is
    # used only once the payload is shown to be that batch's job: job_id == job_id_for(batch, job_no) below).
    lmdq_id = _JOB_ID.match(job_id)
    batch_got: Any = _UNREAD
    try:
        if prefetched is not None and lmdq_id is not None:  # read with the other jobs of its claim
            job, batch_got = prefetched.read(), prefetched.batch
        elif lmdq_id is not None:
            read, batch_got = queue.fetch_job_beside(job_id, lambda p: _queue_batch_read(p, queue, lmdq_id.group(1)))
            job = read()
        else:
            job = queue.fetch_job(job_id)  # bounded: raises JobRefused for oversized / foreign hashes
    except NotDecodable as e:
        raise undecodable(client, queue, job_id, str(e)) from e
    try:
        payload = queue.payload_of(job)
    except ValidationError as e:
        raise JobRefused(f"job {job_id}: not a valid lmdq payload: {_first_error(e)}") from e
    except ValueError as e:
        raise JobRefused(str(e)) from e
    if job_id != job_id_for(payload.batch_id, payload.job_no):
        raise JobRefused(f"job {job_id}: its id is not {job_id_for(payload.batch_id, payload.job_no)!r}, "
                         f"the id lmdq gives job {payload.job_no} of batch {payload.batch_id}")
    batch, total = _batch_record(client, queue, payload.batch_id, got=batch_got)
    where = f"job {job_id} of batch {payload.batch_id}"
    if batch.id != payload.batch_id or payload.model not in batch.models:  # several: one of the batch's models
        raise JobRefused(f"{where}: batch id / model differ from the batch record's")
    top = max(r.index for r in payload.requests)
    if top >= total:
        raise JobRefused(f"{where}: request index {top} is outside the batch's {total} requests")
    urls: dict[str, Any] = {}
    for name in ("results_url", "blob_url"):
        theirs, ours = getattr(payload, name), getattr(batch, name)
        if theirs != ours:
            raise JobRefused(f"{where}: its {name} is not the one in the batch record (a forged or edited job)")
        if ours is not None and outputs is not None:
            try:
                urls[name] = outputs.check(ours)
            except OutputUrlRejected as e:
                # a genuine job of a live batch, which names a place this worker may not write: its
                # requests are answered (failed), not left without a result; nothing is written there
                raise OutputNotAllowed(f"{where}: {name} {e}", job=job,
                                       payload=payload.model_copy(update={"results_url": None,
                                                                          "blob_url": None})) from e
    return job, payload.model_copy(update=urls) if urls else payload


_JOB_ID = re.compile(r"^(batch_[0-9a-f]{24})-([0-9]{6,10})$")


def undecodable(client: redis.Redis, queue: JobQueue, job_id: str, reason: str) -> JobRefused:
    """The error for a job this worker cannot decode: :class:`UndecodableJob` when its id, batch record and
    manifest say which requests of a live batch it holds (bounded reads, validated: untrusted), else a
    plain :class:`JobRefused` (a foreign or forged job: nothing to answer)."""
    m = _JOB_ID.match(job_id)
    if m is None:
        return JobRefused(reason)
    try:
        batch, total = _batch_record(client, queue, m.group(1))
    except JobRefused:
        return JobRefused(reason)
    if int(m.group(2)) >= max(1, batch.num_jobs):
        return JobRefused(f"{reason} (job {int(m.group(2))} is not one of the batch's {batch.num_jobs} jobs)")
    cap = max(MAX_FIELD_BYTES, min(queue.max_job_bytes, 64 << 20))
    size, raw = reads.capped_job_field(client, job_id, REQUESTS_FIELD, cap)
    if size > cap:
        return JobRefused(f"{reason} (its request list is over {cap:,} bytes)")
    try:
        pairs = json.loads(raw) if raw is not None else None
        requests = [(int(i), str(c)) for i, c in pairs] if isinstance(pairs, list) else []
    except (ValueError, TypeError, RecursionError):
        requests = []
    ok = (0 < len(requests) <= MAX_JOB_REQUESTS and len({i for i, _ in requests}) == len(requests)
          and all(0 <= i < total and 0 < len(c) <= 512 for i, c in requests))
    if not ok:
        return JobRefused(f"{reason} (and it names no requests of batch {batch.id} to answer)")
    return UndecodableJob(reason, batch=batch, requests=requests)


def _queue_batch_read(pipe: Any, queue: JobQueue, batch_id: str) -> None:
    """The capped read of ``batch_id``'s record queued on ``pipe`` (its reply: :func:`_batch_record`'s ``got``)."""
    READ_BATCH(keys=[queue.keys.batch(batch_id)], args=[MAX_BATCH_RECORD_BYTES], client=pipe)


_UNREAD = object()
"""``_batch_record``'s ``got`` when the record was not read with the job (None is READ_BATCH's "no record")."""


def _batch_record(client: redis.Redis, queue: JobQueue, batch_id: str, *, got: Any = _UNREAD) -> tuple[Batch, int]:
    """The producer's record of ``batch_id`` (size-capped, validated) and its request total; ``got``: READ_BATCH's
    reply for it already read (with the job), else it is read now."""
    if got is _UNREAD:
        got = READ_BATCH(keys=[queue.keys.batch(batch_id)], args=[MAX_BATCH_RECORD_BYTES], client=client)
    if not got or got[1] is None:
        raise JobRefused(f"batch {batch_id}: no batch record (deleted, expired, or the job is forged)")
    if got[0] == b"too_large":
        raise JobRefused(f"batch {batch_id}: record of {int(got[1]):,} bytes, over {MAX_BATCH_RECORD_BYTES:,}")
    try:
        data = json.loads(got[1])
        data["status"] = "queued"  # live fields are not in 'meta'; only the identity and URLs are used here
        batch = Batch.model_validate(data)
        total = int(got[2])
    except (ValueError, TypeError, RecursionError) as e:  # pydantic's ValidationError is a ValueError
        raise JobRefused(f"batch {batch_id}: unreadable batch record: {type(e).__name__}") from e
    return batch, total


def _first_error(e: ValidationError) -> str:
    """One short line: the field and what was wrong, never the (untrusted, maybe huge) input itself."""
    errs = e.errors(include_input=False, include_url=False)
    first = errs[0]
    loc = ".".join(str(x) for x in first["loc"]) or "payload"
    more = f" (+{len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"field {loc!r}: {first['msg']}{more}"


# ==== Lua: the capped read of a batch record (composed and run by lmdq.redis.scripts.LuaScript) ====

# KEYS: batch hash.  ARGV: cap on 'meta'.  Returns false | {'too_large', size} | {'ok', meta, total}
READ_BATCH = LuaScript("read_batch", """
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash' then return false end
local n = redis.call('HSTRLEN', KEYS[1], 'meta')
if n > tonumber(ARGV[1]) then return {'too_large', n} end
local v = redis.call('HMGET', KEYS[1], 'meta', 'total')
return {'ok', v[1], v[2]}
""")
