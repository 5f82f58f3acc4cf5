"""Turning a queued job into a payload a worker may run: the one door untrusted job data comes in by.

Anyone who can push to the queue can hand a worker a job, so everything read here is untrusted
input (see docs/reliability.md, security). A job that is not lmdq's is refused, never run and never
retried.
"""

from __future__ import annotations

import redis
from rq.job import Job

from lmdq.contract import JobPayload
from lmdq.jobs import JobQueue

__all__ = ["JobRefused", "decode_job"]


class JobRefused(ValueError):
    """The job is not something this worker will run (foreign, malformed, oversized, unsafe)."""


def decode_job(client: redis.Redis, queue: JobQueue, job_id: str) -> tuple[Job, JobPayload]:
    """Fetch ``job_id`` and decode its payload. Raises :class:`JobRefused` for anything that is not
    a well-formed lmdq job; Redis errors propagate unchanged (the job is then re-queued, not refused)."""
    job = queue.fetch_job(job_id)
    try:
        return job, queue.payload_of(job)
    except ValueError as e:  # pydantic's ValidationError is a ValueError too
        raise JobRefused(str(e)) from e
