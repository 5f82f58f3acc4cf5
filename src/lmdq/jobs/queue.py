"""lmdq jobs on RQ: staging job hashes (the batch ledger commits them), claim / lease / reap (worker).

RQ owns the job hashes, queues and registries, so ``rq info`` and rq-dashboard see lmdq's work.
lmdq owns delivery: RQ's SimpleWorker sends no heartbeat while a job runs and would fail or
re-queue long jobs on its own clock, so a worker here claims a job with a Lua script that pops it
from the highest-priority non-empty queue AND records a lease in the same step (nothing is lost
between the two), refreshes the lease while it works, and any worker re-queues leases that
expired (the holder died). Results are exactly-once in the store (see :mod:`lmdq.results.store`), so
re-running part of a job is safe.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import orjson
import redis
from orjson import Fragment as _Spliced  # JSON written as it is (not a Lua fragment: tests/test_redis_boundary.py)
from rq.exceptions import DeserializationError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from lmdq.contract import FORMAT_VERSION, JOB_FUNCTION, BatchStatus, JobPayload
from lmdq.jobs.data import (
    DEFAULT_MAX_JOB_BYTES,
    FORMAT_FIELD,
    MAX_FIELD_BYTES,
    REQUESTS_FIELD,
    JobTooLarge,
    RawRequests,
    manifest,
    read_job,
    read_job_beside,
    read_jobs_beside,
)
from lmdq.jobs.leases import JobLeases
from lmdq.jobs.reads import capped_job_field
from lmdq.jobs.rq_records import RQRecords
from lmdq.redis.keys import Keys, queue_name
from lmdq.settings import DEFAULT_RESULT_TTL_S

__all__ = ["Charge", "Claim", "FairShare", "JobQueue", "JobStart", "generate", "job_id_for", "job_id_prefix"]

def _fragment(obj: Any) -> Any:
    if type(obj) is RawRequests:
        return _Spliced(obj.json())
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _parsed(obj: Any) -> Any:
    if type(obj) is RawRequests:
        return json.loads(obj.json())
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


class JobSerializer(JSONSerializer):
    """RQ's JSON serializer (workers read with its ``loads``: any JSON), written with orjson, which also
    splices :class:`~lmdq.jobs.data.RawRequests`' JSON in as it is (issue 49: the stdlib encoder and a
    parse of every request were a third of staging's CPU). What orjson refuses (an int over 64 bits, a lone
    surrogate) is written by the stdlib, as before."""

    @staticmethod
    def dumps(*args: Any, **kwargs: Any) -> bytes:
        if len(args) == 1 and not kwargs:
            try:
                return orjson.dumps(args[0], default=_fragment)
            except (orjson.JSONEncodeError, TypeError):
                return json.dumps(args[0], default=_parsed).encode("utf-8")
        return json.dumps(*args, **kwargs).encode("utf-8")


SERIALIZER = JobSerializer()




def generate(payload: dict[str, Any]) -> None:
    """The RQ function name every lmdq job carries (``lmdq.jobs.queue.generate``).

    lmdq workers never import or call it: they check the name and run the payload on their
    engine. It exists so a stock ``rq worker`` pointed at an lmdq queue fails loudly.
    """
    raise RuntimeError("lmdq jobs must be run by lmdq-worker, which holds the model; not by `rq worker`")


def job_id_prefix(batch_id: str) -> str:
    """Every job id of a batch starts with this (cancel finds them on a queue by it)."""
    return f"{batch_id}-"


def job_id_for(batch_id: str, job_no: int) -> str:
    return f"{job_id_prefix(batch_id)}{job_no:06d}"


class Charge(str, Enum):
    """What a re-queue costs the job (docs/reliability.md, "What counts as an attempt")."""

    #: nothing: a drain, a lost lease, a store error, a crash in the worker's own code
    none = ""
    #: one of ``max_attempts``: the engine failed this job's requests
    attempt = "charge"
    #: an engine death while the job ran (not an attempt; poison-prompt isolation counts it)
    crash = "crash"


@dataclass
class Claim:
    """A job this worker holds a lease on, with its counters as they were when it was claimed."""

    job_id: str
    queue_key: str
    #: 1 for the first claim, +1 for every claim after it, whatever ended the run before
    run: int = 1
    #: runs the engine failed so far (each one charged an attempt)
    charges: int = 0
    #: engine deaths while this job ran
    crashes: int = 0
    #: the request index that was alone in the engine when it last died (poison prompt), if any
    killer: int | None = None
    job: Job | None = None
    execution: Execution | None = None

    @property
    def attempt(self) -> int:
        """The charged attempt this run is: 1 + engine failures so far (what results report)."""
        return self.charges + 1


@dataclass(frozen=True)
class FairShare:
    """A claim that takes no more than its fair share while other workers of its model are idle."""

    #: the model's idle roster (:attr:`lmdq.jobs.idle_roster.IdleRoster.key`)
    roster: str
    #: this worker's entry in it (not counted as an idle peer)
    member: str
    #: jobs this worker holds now
    held: int


@dataclass(frozen=True)
class JobStart:
    """What a worker reads before handing a job to its engine (one round trip)."""

    #: the batch's status, None when missing or not a known status
    status: BatchStatus | None
    #: the batch's completion deadline (unix s), None without one
    expires_at: float | None
    #: request indices that already have a final result (skipped on a re-run)
    finished: set[int] = field(default_factory=set)
    #: the Redis server's clock at that moment: expiry is judged on it, never on a worker's clock
    server_now: float = 0.0

    @property
    def expired(self) -> bool:
        return self.expires_at is not None and self.expires_at < self.server_now


class JobQueue:
    """Queue operations on a Redis client (passed in; no module-level connections)."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        keys: Keys | None = None,
        job_ttl_s: int = DEFAULT_RESULT_TTL_S,
        max_job_bytes: int = DEFAULT_MAX_JOB_BYTES,
    ) -> None:
        self.client = client
        self.keys = keys or Keys()
        self.job_ttl_s = job_ttl_s
        self.max_job_bytes = max_job_bytes
        #: the jobs' stores: this class keeps the rules, :mod:`lmdq.jobs.leases` and
        #: :mod:`lmdq.jobs.rq_records` the calls
        self.leases = JobLeases(client, keys=self.keys)
        self.records = RQRecords(client, keys=self.keys, serializer=SERIALIZER, ttl_s=job_ttl_s)

    # ---- producer side -----------------------------------------------------------------
    def stage(self, payload: dict[str, Any], *, queue: str, job_no: int, pipe: Any) -> str:
        """Save one job hash (status queued) without making it visible on the queue yet."""
        job_id = job_id_for(payload["batch_id"], job_no)
        job = Job.create(
            JOB_FUNCTION,
            args=[payload],
            connection=self.client,
            id=job_id,
            origin=queue,
            status=JobStatus.QUEUED,
            serializer=SERIALIZER,
            timeout=-1,  # lmdq's lease, not RQ's alarm, bounds a job
            result_ttl=self.job_ttl_s,
            failure_ttl=self.job_ttl_s,
            ttl=None,
            description=f"lmdq batch {payload['batch_id']} job {job_no}",
        )
        job.enqueued_at = _utcnow()
        if len(job.data) > self.max_job_bytes:  # workers refuse it unread: say so now, before anything is visible
            raise JobTooLarge(job_no, len(job.data), self.max_job_bytes)
        # Plain fields beside RQ's, readable without inflating or parsing the data: the job's format, and
        # which requests it answers, so a worker that cannot decode the data still answers each of them.
        self.records.stage(job, {FORMAT_FIELD: str(payload.get("format_version", FORMAT_VERSION)),
                                 REQUESTS_FIELD: manifest(payload["requests"])},
                           batch_id=payload["batch_id"], ttl_s=self.job_ttl_s, pipe=pipe)
        return job_id

    # ---- worker side -------------------------------------------------------------------
    def claim(self, queues: Sequence[str], *, model: str, worker: str, lease_s: float) -> Claim | None:
        """Pop the next job from the first non-empty queue and lease it to ``worker``, atomically."""
        got = self.claim_many(queues, model=model, worker=worker, lease_s=lease_s, n=1)
        return got[0] if got else None

    def claim_many(self, queues: Sequence[str], *, model: str, worker: str, lease_s: float, n: int) -> list[Claim]:
        """Up to ``n`` jobs, highest priority first, each popped and leased atomically, in ONE round trip.

        Why: a worker filling an empty engine claims dozens of jobs at once, and each round trip waits
        for the GIL behind the engine's own Python loop (milliseconds each, measured): one call per job
        spread a 32-job ramp over ~0.4 s of engine time."""
        return self.claim_fair(queues, model=model, worker=worker, lease_s=lease_s, n=max(1, n))[0]

    def claim_fair(self, queues: Sequence[str], *, model: str, worker: str, lease_s: float, n: int,
                   fair: FairShare | None = None) -> tuple[list[Claim], int]:
        """:meth:`claim_many` of up to ``n`` jobs (none for ``n`` 0), with ``fair``: no more than the fair share
        while other workers of the model are idle (:func:`lmdq.worker.admission.fair_share`), judged inside
        the same script call. Returns the claims and the share it aimed for (``n`` without ``fair``)."""
        share, res = self.leases.claim(queues, model=model, worker=worker, lease_s=lease_s, n=max(0, n),
                                       roster=fair.roster if fair else "", member=fair.member if fair else "",
                                       held=fair.held if fair else 0)
        return [
            Claim(job_id=res[i].decode(), queue_key=res[i + 1].decode(), run=int(res[i + 2]),
                  charges=_count(res[i + 3]), crashes=_count(res[i + 4]), killer=_index(res[i + 5]))
            for i in range(0, len(res), 6)
        ], share

    def begin(self, claim: Claim, *, batch_id: str, indices: Sequence[int], worker: str, ttl_s: int,
              job_no: int | None = None) -> JobStart:
        """Everything a worker reads before running a job, in ONE round trip: the server's clock, the
        batch's status and deadline, which requests already have results; and RQ's started records.

        ``job_no`` (batches with a results sink): a job whose results were moved to its shard (an
        entry in the batch's shard index, see :mod:`lmdq.results.sink`) has every request finished, though
        the results hash no longer holds them, so a re-run after that runs nothing.

        Why one: each round trip waits for the GIL behind the engine's own Python loop."""
        got, execution = self.records.begin(claim.job, claim.job_id, batch_id=batch_id, indices=indices,
                                            job_no=job_no, worker=worker, ttl_s=ttl_s)
        if claim.job is not None:
            claim.execution = execution
        (sec, usec), (st, exp), have = got[:3]
        sealed = job_no is not None and bool(got[3])
        return JobStart(
            status=_batch_status(st),
            expires_at=_float(exp),
            finished=set(indices) if sealed else {i for i, v in zip(indices, have) if v is not None},
            server_now=int(sec) + int(usec) / 1e6,
        )

    def lease_now(self) -> float:
        """Now on the clock leases are stamped with: the Redis server's TIME, plus the offset the lease
        scripts keep in ``<leases>:clock`` when the server's clock has stepped back (if they keep one), so
        a caller judging "is this lease live?" agrees with the reaper."""
        sec, usec, last, offset = self.leases.clock()
        raw = int(sec) + int(usec) / 1e6
        # as the lease scripts' _NOW: a step back not yet seen by a script counts from the last reading
        return max(raw, _float(last) or 0.0) + (_float(offset) or 0.0)

    def forget(self, job_id: str) -> None:
        """Delete an ended job's hash (its payload: the prompts). Only for a job whose results are all
        in a shard and none is to be retried (``retry`` reads failed requests back from job payloads):
        with a results sink, the prompts are then the largest thing a finished batch leaves in Redis."""
        self.records.forget(job_id)

    def fetch_job(self, job_id: str) -> Job:
        """The job, read within ``max_job_bytes`` (never RQ's unbounded ``Job.fetch``: see
        :mod:`lmdq.jobs.data`); raises ``JobRefused`` (a ValueError) for an oversized or foreign hash."""
        return read_job(self.client, job_id, max_job_bytes=self.max_job_bytes, serializer=SERIALIZER)

    def fetch_job_beside(self, job_id: str, also: Callable[[Any], None]) -> tuple[Callable[[], Job], Any]:
        """:meth:`fetch_job` and the reads ``also`` queues on the pipeline it is handed, in ONE round trip
        (issue 49: a worker starting a job reads the job and its batch record; two round trips cost Redis
        ~24 us of CPU more than one). Returns the job as a call (it raises what :meth:`fetch_job` raises, when
        the caller is ready for it) and ``also``'s one reply."""
        return read_job_beside(self.client, job_id, also, max_job_bytes=self.max_job_bytes, serializer=SERIALIZER)

    def fetch_jobs_beside(self, job_ids: list[str], also: Callable[[Any], None]
                          ) -> tuple[list[Callable[[], Job]], list[Any]]:
        """:meth:`fetch_job_beside` for several jobs in ONE round trip: one call per job, and ``also``'s replies."""
        return read_jobs_beside(self.client, job_ids, also, max_job_bytes=self.max_job_bytes, serializer=SERIALIZER)

    @staticmethod
    def payload_of(job: Job) -> JobPayload:
        """Decode a job's single argument; raises ValueError for anything not an lmdq payload.

        Jobs are fetched with the JSON serializer, so a pickled job (rq's default) fails to decode
        here and is refused: its bytes are never unpickled.
        """
        try:
            func_name = job.func_name
        except DeserializationError as e:
            raise ValueError(f"refusing job {job.id}: its data is not JSON (lmdq jobs are JSON only)") from e
        if func_name != JOB_FUNCTION:
            raise ValueError(f"refusing job {job.id}: function {func_name!r} is not {JOB_FUNCTION!r}")
        if len(job.args) != 1 or job.kwargs:
            raise ValueError(f"refusing job {job.id}: expected one payload argument")
        return JobPayload.model_validate(job.args[0])

    def mark_started(self, claim: Claim, worker: str, ttl_s: int, pipe: Any | None = None) -> None:
        """Reflect the claim in RQ's own records (status, StartedJobRegistry) for rq info/dashboard.

        With ``pipe`` the commands join the caller's pipeline (executed by the caller), so a worker
        starting a job pays one round trip for this and its own reads together."""
        if claim.job is None:
            return
        claim.execution = self.records.started(claim.job, claim.job_id, worker, ttl_s, pipe=pipe)

    def mark_refused(self, job_id: str, reason: str, *, ttl_s: int) -> bool:
        """Record a refused (foreign) job as failed in RQ WITHOUT decoding or re-saving it.

        Only plain fields are written (status, reason, FailedJobRegistry entry), so a job that is
        not lmdq's JSON is never deserialized. Returns False when there is no job hash.
        """
        # a forged origin of any size is never pulled out of Redis (None: missing or over the cap)
        _, origin = capped_job_field(self.client, job_id, "origin", MAX_FIELD_BYTES)
        if origin is None:
            return False
        self.records.failed_unread(
            job_id, _text(origin),
            {
                "status": JobStatus.FAILED.value,
                "exc_info": zlib.compress(reason.encode()),
                "ended_at": _utcnow().strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            },
            ttl_s=ttl_s, until=int(time.time()) + ttl_s,
        )
        return True

    def heartbeat(self, claims: Iterable[Claim], *, worker: str, lease_s: float) -> list[str]:
        """Extend leases this worker still owns; returns job ids it has lost (reaped)."""
        cl = list(claims)
        if not cl:
            return []
        lost = self.leases.renew([c.job_id for c in cl], worker=worker, lease_s=lease_s)
        try:
            self.records.beat([(c.execution, c.job) for c in cl if c.execution is not None and c.job is not None],
                              int(lease_s) + 60)
        except redis.ResponseError:
            pass  # RQ's display records only (e.g. refused under maxmemory): the lease above is what counts
        return [x.decode() for x in lost]

    def finish(self, claim: Claim, *, worker: str, failed: str | None = None) -> bool:
        """Release the lease of a job whose requests all have final results, and record it in RQ."""
        owned = self.release(claim, worker=worker)
        if owned:
            self.record_end(claim, failed=failed)
        return owned

    def release_ended(self, claim: Claim, *, worker: str, failed: str | None = None) -> tuple[bool, bool]:
        """Release the lease of a job that ENDED (every request has its final result: done, or failed) and
        write RQ's end records (:meth:`record_end`), in ONE round trip (issue 49: two were ~24 us of Redis CPU
        per job more). Returns (owned: the release was this worker's, recorded: RQ's records were written).

        The records are in the release's MULTI, so they are written even when the lease was not ``worker``'s
        any more (it expired, was reaped, maybe re-claimed): that is still true of the job, since its requests
        all have final results (exactly once), and a worker that re-runs it skips them all and writes its own
        records after. ``recorded`` False (a record refused, e.g. under maxmemory): the caller writes them with
        :meth:`record_end` on a retry of its own; the fenced release never runs twice."""
        job = claim.job
        if job is None:
            return self.release(claim, worker=worker), True

        def drop(p: Any) -> None:
            self.leases.drop(claim.job_id, worker=worker, mode="done", charge=Charge.none.value, killer="", pipe=p)

        owned, recorded = self.records.ended_after(drop, job, claim.execution, failed=failed,
                                                   ended_at=_utcnow().strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
        return bool(owned), recorded

    def requeue(self, claim: Claim, *, worker: str, charge: Charge = Charge.none, killer: int | None = None) -> bool:
        """Give a held job back to the front of its queue (see :meth:`release`) and reset RQ's view."""
        owned = self.release(claim, worker=worker, requeue=True, charge=charge, killer=killer)
        if owned and claim.job is not None:
            self.record_requeued([claim.job_id])
        return owned

    def release(
        self,
        claim: Claim,
        *,
        worker: str,
        requeue: bool = False,
        charge: Charge = Charge.none,
        killer: int | None = None,
    ) -> bool:
        """Drop ``worker``'s lease on the job, atomically and fenced (False: it owns it no more).

        With ``requeue`` the job goes back to the FRONT of its queue and ``charge`` is counted against
        it in the same step (``killer``: with ``Charge.crash``, the request that was alone in the
        engine when it died). Without, the job is done and its counters are dropped. RQ's records are
        separate calls (:meth:`record_end`, :meth:`record_requeued`), so a caller retrying through a
        store fault retries each step on its own: the fenced release cannot run twice."""
        mode = "requeue" if requeue else "done"
        return self.leases.drop(claim.job_id, worker=worker, mode=mode, charge=charge.value,
                                killer="" if killer is None else killer)

    def move_to_model(self, claim: Claim, *, worker: str, model: str, origin: str | None) -> str | None:
        """Hand a held job of ANOTHER model to that model's queue (same priority as its ``origin``), atomically
        with dropping this worker's lease. Returns the queue it went to, None when the lease was lost.

        Why move, not fail: the job is genuine (it matches its batch record) and another model's workers
        can answer it; it reached this worker only through a queue it does not belong on (pushed by hand,
        or a queue name an older lmdq shared between two model names)."""
        prio = (origin or "").rsplit(":", 1)[-1]
        if prio not in ("high", "normal", "low"):
            prio = "normal"
        target = queue_name(model, prio, self.keys.prefix)
        moved = self.leases.move(claim.job_id, worker=worker, queue=target, model=model)
        if not moved:
            return None
        if claim.job is not None:
            try:
                self.record_requeued([claim.job_id])
            except redis.RedisError:
                pass  # RQ's display records only
        return target

    def record_end(self, claim: Claim, *, failed: str | None = None) -> None:
        """RQ's records of a job that ended (status, Finished/FailedJobRegistry), for rq info/dashboard."""
        job = claim.job
        if job is None:
            return
        self.records.ended(job, claim.execution, failed=failed,
                           ended_at=_utcnow().strftime("%Y-%m-%dT%H:%M:%S.%fZ"))

    def reap(self, *, limit: int = 200) -> list[tuple[str, str]]:
        """Re-queue jobs whose lease expired (their worker died). Returns (job_id, dead worker)."""
        raw = self.leases.reap_expired(limit)
        pairs = [(raw[i].decode(), raw[i + 1].decode()) for i in range(0, len(raw), 2)]
        if pairs:
            try:
                self.record_requeued([j for j, _ in pairs])
            except redis.ResponseError:
                pass  # RQ's display records only (e.g. refused under maxmemory): the jobs are back on their queues
        return pairs

    def record_requeued(self, job_ids: list[str]) -> None:
        """Put RQ's view back to 'queued' and drop stale StartedJobRegistry entries."""
        for jid in job_ids:
            try:
                job = self.fetch_job(jid)
            except Exception:  # noqa: BLE001 - a missing/foreign job hash is not ours to fix
                continue
            self.records.requeued(job)

    def queue_depth(self, queues: Sequence[str]) -> int:
        return self.leases.waiting(queues)


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _count(raw: Any) -> int:
    """A counter read back from Redis (untrusted): anything not a small non-negative int is 0."""
    try:
        n = int(raw)
    except (TypeError, ValueError):
        return 0
    return n if 0 <= n < 1_000_000 else 0


def _index(raw: Any) -> int | None:
    if raw in (None, b"", ""):
        return None
    try:
        n = int(raw)
    except (TypeError, ValueError):
        return None
    return n if n >= 0 else None


def _float(raw: Any) -> float | None:
    if raw is None:
        return None
    try:
        return float(raw)
    except (TypeError, ValueError):
        return None


def _batch_status(raw: Any) -> BatchStatus | None:
    if raw is None:
        return None
    try:
        return BatchStatus(raw.decode() if isinstance(raw, bytes) else str(raw))
    except (ValueError, UnicodeDecodeError):
        return None


def _utcnow() -> Any:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc)
