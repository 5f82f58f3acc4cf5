"""Reading an RQ job hash without trusting it: every field size-capped BEFORE it leaves Redis, the
job data decompressed as a stream that stops at the cap.

Why not ``rq.job.Job.fetch``: it pulls the whole hash (HGETALL, any size) and inflates ``data`` and
``exc_info`` with ``zlib.decompress`` in one call, however large the result. A 2 MB zlib bomb pushed
to a queue took a worker to 8.5 GB RSS and ~67 s, starved its heartbeat (so the worker reaped its own
lease and decompressed it again) and made SIGTERM wait minutes. Here one Lua call returns the fields
RQ's bookkeeping needs only if each is within its cap, the data is inflated with
``zlib.decompressobj().decompress(buf, max_length)``, and the RQ ``Job`` is rebuilt from what passed.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable
from typing import Any

import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from lmdq.contract import FORMAT_VERSION
from lmdq.errors import SubmitRejected
from lmdq.redis.replies import reply_text
from lmdq.redis.scripts import LuaScript
from lmdq.settings import DEFAULT_MAX_JOB_BYTES  # declared with the setting; the rule is here

__all__ = [
    "DEFAULT_MAX_JOB_BYTES",
    "FORMAT_FIELD",
    "MAX_FIELD_BYTES",
    "REQUESTS_FIELD",
    "JobRefused",
    "JobTooLarge",
    "JobUndecodable",
    "NotDecodable",
    "RawRequests",
    "inflate",
    "manifest",
    "job_of_reply",
    "read_job",
    "read_job_beside",
    "read_jobs_beside",
]

"""Default cap on one job's data (``LMDQ_MAX_JOB_BYTES``), compressed AND decompressed.

What the producer makes with its defaults: 32 requests a job, each a prompt line of the file, serialised
as JSON. 64 MiB is 2 MiB a request at the default batch size (a 128k-token prompt is ~0.5 MB), and
leaves room for JSON's ``\\uXXXX`` escapes of non-ASCII text; batches of larger prompts should use a
smaller ``--batch-size`` or raise the cap on producer and workers alike. The bound matters for memory:
a decompressed job is parsed into Python objects (worst case ~20 bytes of objects per byte of JSON)."""

FORMAT_FIELD = "lmdq_format"
"""Job hash field: the payload's ``format_version``, readable before the data is inflated or parsed, so a
worker refuses a job written by a newer lmdq by name (and answers its requests) instead of by accident."""

REQUESTS_FIELD = "lmdq_requests"
"""Job hash field: the job's requests as JSON ``[[index, custom_id], ...]`` (:func:`manifest`): what a worker
needs to answer each request of a job whose data it cannot decode (over its LMDQ_MAX_JOB_BYTES, a newer
format), so the batch still ends."""


_REQUEST_HEAD = re.compile(rb'\{"index":(\d+),"custom_id":("(?:[^"\\]|\\.)*"),"endpoint":')
"""How the producer writes each request's JSON: index, custom_id, endpoint first (src/lmdq/submission/submit.py).
Outside a JSON string only: inside one every quote is escaped, so ``{"index":`` cannot match there."""


class RawRequests:
    """A job's requests as JSON already: the producer's validated spill, one request's JSON per item (issue 49:
    parsing each request back into a dict only to serialise it again was a quarter of staging's CPU). Spliced
    into the job's data as it is (:data:`lmdq.jobs.queue.SERIALIZER`); :meth:`manifest` reads the indices and
    custom_ids off the bytes, in one pass."""

    __slots__ = ("raws",)

    def __init__(self, raws: list[bytes]) -> None:
        self.raws = raws

    def __len__(self) -> int:
        return len(self.raws)

    def json(self) -> bytes:
        """The requests as one JSON array."""
        return b"[" + b",".join(self.raws) + b"]"

    def manifest(self) -> str:
        """The :data:`REQUESTS_FIELD` value (``[[index, custom_id], ...]``): read off the bytes when each request
        starts as the producer writes it, else from each request parsed."""
        found = _REQUEST_HEAD.findall(self.json())
        if len(found) == len(self.raws) and all(r.startswith(b'{"index":') for r in self.raws):
            return "[" + ",".join(f"[{i.decode()},{c.decode()}]" for i, c in found) + "]"
        return manifest([json.loads(r) for r in self.raws])


def manifest(requests: list[dict[str, Any]] | RawRequests) -> str:
    """The :data:`REQUESTS_FIELD` value of a job's requests (dicts, or :class:`RawRequests`)."""
    if isinstance(requests, RawRequests):
        return requests.manifest()
    return json.dumps([[r["index"], r["custom_id"]] for r in requests], ensure_ascii=False, separators=(",", ":"))


MAX_FIELD_BYTES = 4096
"""Cap on every other job hash field read (origin, status, dates, description...): lmdq's are < 200 B."""

# The fields Job.restore reads that RQ's bookkeeping needs. Left out on purpose: 'exc_info' (zlib, so
# another bomb), 'result', 'meta', 'webhooks' and the retry/repeat lists (parsed by RQ, unused by lmdq).
_FIELDS = (
    "data",
    "origin",
    "status",
    "created_at",
    "enqueued_at",
    "started_at",
    "ended_at",
    "last_heartbeat",
    "worker_name",
    "description",
    "timeout",
    "result_ttl",
    "failure_ttl",
    "ttl",
    "group_id",
    FORMAT_FIELD,
)



class JobUndecodable(ValueError):
    """Mixin: the job is refused because THIS worker cannot decode it (a newer format, data over its
    LMDQ_MAX_JOB_BYTES), not because it is foreign: its requests deserve an answer
    (:class:`lmdq.jobs.decode.UndecodableJob`)."""


class JobRefused(ValueError):
    """The job is not something this worker will run (foreign, malformed, oversized, unsafe).

    The message is cut to about 1,000 characters (its start and end): it may quote job data (a function
    name, say), which can be megabytes, and it is logged and stored in the job's ``exc_info``."""

    def __init__(self, message: str) -> None:
        super().__init__(message if len(message) <= 1000 else f"{message[:600]} ...(cut)... {message[-300:]}")


class NotDecodable(JobRefused, JobUndecodable):
    """A :class:`JobRefused` for a job this worker cannot decode (see :class:`JobUndecodable`)."""


class JobTooLarge(SubmitRejected):
    """The producer would stage a job over ``LMDQ_MAX_JOB_BYTES``: workers would refuse it, so the submit
    is refused instead (exit 2, nothing enqueued)."""

    def __init__(self, job_no: int, size: int, cap: int) -> None:
        super().__init__(
            f"job {job_no} of this batch would be {size:,} bytes of JSON, over LMDQ_MAX_JOB_BYTES={cap:,} "
            "(workers refuse larger jobs unread): submit with a smaller --batch-size, or raise "
            "LMDQ_MAX_JOB_BYTES on the producer and every worker alike"
        )


def inflate(raw: bytes, max_bytes: int) -> bytes:
    """``raw`` decompressed, never holding more than ``max_bytes + 1`` bytes of output.

    Data that is not a zlib stream is returned as is (RQ stores uncompressed data that way too).
    Raises :class:`JobRefused` when the output would exceed ``max_bytes``, or on a truncated stream.
    """
    d = zlib.decompressobj()
    try:
        out = d.decompress(raw, max_bytes + 1)
    except zlib.error:
        if len(raw) > max_bytes:
            raise NotDecodable(f"job data is {len(raw):,} bytes, over LMDQ_MAX_JOB_BYTES={max_bytes:,}") from None
        return raw
    if len(out) > max_bytes or d.unconsumed_tail:
        raise NotDecodable(
            f"job data inflates to more than LMDQ_MAX_JOB_BYTES={max_bytes:,} bytes "
            f"({len(raw):,} bytes compressed); stopped decompressing there"
        )
    if not d.eof:
        raise JobRefused("job data is a truncated zlib stream")
    return out


def read_job(
    client: redis.Redis, job_id: str, *, max_job_bytes: int = DEFAULT_MAX_JOB_BYTES, serializer: Any = None
) -> Job:
    """The RQ job ``job_id``, read within the caps; its data is decompressed but NOT parsed yet.

    Raises :class:`JobRefused` for a missing, foreign-typed or oversized job hash, or fields RQ cannot
    read; Redis errors propagate (the caller re-queues, never refuses, on those).
    """
    got: list[Any] = READ_JOB(keys=[Job.key_for(job_id)], args=[max_job_bytes, MAX_FIELD_BYTES, *_FIELDS],
                              client=client)
    return job_of_reply(client, job_id, got, max_job_bytes=max_job_bytes, serializer=serializer)


def read_job_beside(client: redis.Redis, job_id: str, also: Callable[[Any], None], *,
                    max_job_bytes: int = DEFAULT_MAX_JOB_BYTES, serializer: Any = None
                    ) -> tuple[Callable[[], Job], Any]:
    """:func:`read_job`'s capped read and the reads ``also`` queues on the pipeline it is handed, in ONE round
    trip (a worker starting a job reads the job and its batch record). Returns the job as a call (raising what
    :func:`read_job` raises, when the caller is ready for it) and ``also``'s one reply."""
    reads, others = read_jobs_beside(client, [job_id], also, max_job_bytes=max_job_bytes, serializer=serializer)
    return reads[0], others[0]


def read_jobs_beside(client: redis.Redis, job_ids: list[str], also: Callable[[Any], None], *,
                     max_job_bytes: int = DEFAULT_MAX_JOB_BYTES, serializer: Any = None
                     ) -> tuple[list[Callable[[], Job]], list[Any]]:
    """:func:`read_job_beside` for several jobs: their capped reads, then whatever ``also`` queues, in ONE round
    trip (a worker's claim of several jobs reads them all, and their batches' records, at once: issue 49).
    Returns one call per job (as :func:`read_job_beside`'s) and the replies of ``also``'s calls, in order."""
    with client.pipeline(transaction=False) as p:
        for job_id in job_ids:
            READ_JOB(keys=[Job.key_for(job_id)], args=[max_job_bytes, MAX_FIELD_BYTES, *_FIELDS], client=p)
        also(p)
        got = p.execute()

    def reader(job_id: str, reply: Any) -> Callable[[], Job]:
        return lambda: job_of_reply(client, job_id, reply, max_job_bytes=max_job_bytes, serializer=serializer)

    return [reader(j, r) for j, r in zip(job_ids, got, strict=False)], got[len(job_ids):]


def job_of_reply(client: redis.Redis, job_id: str, got: list[Any], *, max_job_bytes: int = DEFAULT_MAX_JOB_BYTES,
                 serializer: Any = None) -> Job:
    """The job from READ_JOB's reply ``got`` (untrusted), checked as :func:`read_job` says."""
    tag = reply_text(got[0])
    if tag == "missing":
        raise JobRefused(f"No such job {job_id}: no job hash (deleted, expired, or never created)")
    if tag == "not_hash":
        raise JobRefused(f"job {job_id}: its key is a Redis {reply_text(got[1])}, not an RQ job hash")
    if tag == "too_large":
        is_data = reply_text(got[1]) == "data"
        cap = max_job_bytes if is_data else MAX_FIELD_BYTES
        what = "LMDQ_MAX_JOB_BYTES" if is_data else "the field cap"
        cls = NotDecodable if is_data else JobRefused
        raise cls(f"job {job_id}: field {reply_text(got[1])!r} is {int(got[2]):,} bytes, over {what}={cap:,}")
    fields = {name.encode(): v for name, v in zip(_FIELDS, got[1:]) if v is not None}
    fmt = fields.pop(FORMAT_FIELD.encode(), None)
    if fmt is not None:
        version = reply_text(fmt)
        if not version.isdigit() or int(version) > FORMAT_VERSION:
            raise NotDecodable(f"job {job_id}: written in job format {version[:20]!r}, newer than this worker's "
                               f"({FORMAT_VERSION}): upgrade lmdq on the workers")
    if b"data" not in fields:
        raise JobRefused(f"job {job_id}: no 'data' field (not an RQ job)")
    data = inflate(fields[b"data"], max_job_bytes)
    if data.lstrip()[:1] not in (b"[", b"{"):
        # lmdq's JSON serializer writes a JSON array; anything else (pickle, a nested zlib stream RQ
        # would inflate again, unbounded) is refused before RQ sees it.
        raise JobRefused(f"job {job_id}: its data is not JSON (lmdq jobs are JSON only)")
    fields[b"data"] = data
    try:
        job = Job(job_id, connection=client, serializer=serializer or JSONSerializer())  # RQ checks the id
        job.restore(fields)
    except Exception as e:  # noqa: BLE001 - RQ's parsers raise anything (AssertionError on a bad timeout)
        raise JobRefused(f"job {job_id}: unreadable RQ fields: {type(e).__name__}: {e}") from e
    return job


# ==== Lua: the capped read of a job hash (composed and run by lmdq.redis.scripts.LuaScript) ====

# KEYS: job hash.  ARGV: cap for the first field, cap for the others, field names...
# Returns {'missing'} | {'not_hash', type} | {'too_large', field, size} | {'ok', value1, value2, ...}
READ_JOB = LuaScript("read_job", """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return {'missing'} end
if t ~= 'hash' then return {'not_hash', t} end
local fields = {}
for i = 3, #ARGV do
  local cap = tonumber(ARGV[2])
  if i == 3 then cap = tonumber(ARGV[1]) end
  local n = redis.call('HSTRLEN', KEYS[1], ARGV[i])
  if n > cap then return {'too_large', ARGV[i], n} end
  table.insert(fields, ARGV[i])
end
local vals = redis.call('HMGET', KEYS[1], unpack(fields))
local out = {'ok'}
for i = 1, #fields do out[i + 1] = vals[i] end
return out
""")
