"""The batch ledger: every batch-level rule lmdq keeps in Redis, in one place.

A batch is created, staged, committed or rolled back, cancelled, and read back for ``retry`` here,
and nowhere else: the producer commands call these methods and hold no Redis client calls of their
own, so the rules that make submit all-or-nothing live beside the keys they touch.

Keys a batch owns (all built by :class:`lmdq.redis.keys.Keys`; ``P`` is the key prefix):

=============================  ================  ===============================================
key                            written by        removed by
=============================  ================  ===============================================
``P:batch:<id>``               :meth:`create`    :meth:`rollback`; TTL
``P:batches`` (member ``id``)  :meth:`create`    :meth:`rollback`
``P:idem:<key>``               :meth:`bind_key`  :meth:`rollback`, :meth:`release_key` (only while
                                                 bound to this batch); TTL
``rq:job:<id>-<n>``            :meth:`stage`     :meth:`rollback`; TTL
``P:batch:<id>:jobs``          :meth:`stage`     :meth:`rollback`; TTL (set at commit)
``rq:queue:<queue>`` entries   :meth:`commit`    :meth:`cancel`; workers' claims
``rq:queues`` (member)         :meth:`commit`    never (RQ's registry of queues, shared)
``P:cancelled`` (member)       :meth:`cancel`    never (workers poll it)
=============================  ================  ===============================================

Results, partials and counters (``P:batch:<id>:results`` / ``:partials``) belong to
:class:`lmdq.results.store.ResultStore`; leases and attempts to :class:`lmdq.jobs.queue.JobQueue`.

This module decides WHEN each step may run and what it means; the Redis commands themselves are in
:mod:`lmdq.redis` (tests/test_redis_boundary.py): the record, the listing and the cancelled set in
:class:`lmdq.batches.records.BatchHashes` (through :attr:`BatchLedger.records`), the staged writes, job
list, commit and queue scans in :class:`lmdq.batches.batch_jobs.BatchJobs`, idempotency keys in
:class:`lmdq.batches.idempotency.IdempotencyKeys`.

Why a commit is one Lua script that also flips the status: jobs become visible and the batch
becomes ``queued`` in the same step, and the script is fenced on ``queued_at`` so a retried call
(redis-py re-sends after a dropped connection) cannot push the jobs twice. After a failed commit
call the ledger asks Redis whether the commit happened before rolling anything back, so a batch
whose jobs a worker may already hold is never deleted under it.
"""

from __future__ import annotations

import functools
import json
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis
from rq.exceptions import NoSuchJobError
from rq.job import Job

from lmdq.batches.batch_jobs import BatchJobs
from lmdq.batches.idempotency import IdempotencyKeys
from lmdq.batches.records import RUNNING_TTL_S, staging_ttl
from lmdq.batches.staging import IDS_CHUNK, StagingLeases
from lmdq.contract import (
    Batch,
    BatchStatus,
    ErrorCode,
    ErrorInfo,
    GenerationParams,
    Request,
    Result,
    ResultStatus,
    Timings,
)
from lmdq.errors import (
    BatchNotFound,
    IdempotencyConflict,
    PurgeRefused,
    RedisRefused,
    RetryRejected,
    SubmitRejected,
)
from lmdq.gates.config import GateConfig, canary_jobs
from lmdq.gates.store import GateStore
from lmdq.jobs.data import DEFAULT_MAX_JOB_BYTES, REQUESTS_FIELD, RawRequests
from lmdq.jobs.decode import JobRefused, decode_job
from lmdq.jobs.queue import JobQueue, job_id_for, job_id_prefix
from lmdq.logs.config import get_logger
from lmdq.redis.connection import Refusal, refusal, server_address
from lmdq.redis.keys import BatchField, Keys, queue_name, queue_names, rq_queue_key
from lmdq.redis.replies import reply_text
from lmdq.registry.store import ModelRegistry
from lmdq.results.store import ResultStore
from lmdq.settings import CommonSettings, default_of

__all__ = ["BatchLedger", "Purged", "Staged", "StagingLeaseLost", "job_payloads", "new_batch_id", "redis_refusal"]

F = BatchField

Progress = Callable[[int], None]

_FETCH_CHUNK = 500
"""Jobs fetched per round trip when reading a batch's requests back for ``retry``, or checked at once for a
live lease by ``cancel``."""




INTERRUPTED = (f"{ErrorCode.submit_interrupted}: the submit staging this batch stopped renewing its staging lease "
               "(it died) before it staged every request, and no re-run of it resumed the batch")
"""``staging_failed`` of a batch ended by whoever noticed its lapsed lease, and its unstaged requests' message."""


class StagingLeaseLost(SubmitRejected):
    """The staging lease lapsed under a submit that is still running (it stalled longer than the lease): the
    batch is no longer its to commit. Whoever took it over resumes it or ends it; this submit stops."""


class _Renewer:
    """Renews a staging lease every third of it from a thread of its own, so a submit that stages slowly (a
    slow disk, a slow Redis, a long ``after_first_commit``) keeps it; ``lost`` is set once it is not ours."""

    def __init__(self, leases: StagingLeases, batch_id: str, token: str, lease_s: float) -> None:
        self.leases, self.batch_id, self.token, self.lease_s = leases, batch_id, token, lease_s
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lmdq-staging-lease-{batch_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                if not self.leases.renew(self.batch_id, self.token, lease_s=self.lease_s):
                    self.lost.set()
                    return
            except redis.RedisError:
                continue  # tried again a third of the lease later; the commit fence catches a lapse

    def check(self) -> None:
        if self.lost.is_set():
            raise StagingLeaseLost(f"batch {self.batch_id}: its staging lease lapsed while this submit staged it")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5)


def _manifest(raw: Any, total: int) -> list[tuple[int, str]] | None:
    """A job's request manifest (:data:`lmdq.jobs.data.REQUESTS_FIELD`, untrusted), or None when missing or
    not one: only indices of the batch and non-empty custom ids are kept."""
    if raw is None:
        return None
    try:
        pairs = json.loads(raw)
        out = [(int(i), str(c)) for i, c in pairs]
    except (ValueError, TypeError, RecursionError):
        return None
    return [(i, c) for i, c in out if 0 <= i < total and 0 < len(c) <= 512]


def new_batch_id() -> str:
    """A fresh batch id: ``batch_`` and 24 hex digits."""
    return f"batch_{uuid.uuid4().hex[:24]}"


def job_payloads(
    requests: Iterable[dict[str, Any] | bytes],
    *,
    batch_id: str,
    model: str,
    params: GenerationParams,
    batch_size: int,
    results_url: str | None = None,
    blob_url: str | None = None,
    job_sizes: Sequence[int] | None = None,
    reuse_ttl_s: int | None = None,
    gated: Callable[[int], bool] | None = None,
) -> Iterator[dict[str, Any]]:
    """Job payload dicts of ``batch_size`` requests each, in request order; with ``job_sizes``
    (prefix groups: src/lmdq/submission/prefix_groups.py), job k takes the next ``job_sizes[k]`` requests.
    ``gated(job_no)``: the job's results feed the batch's quality gates (``gated`` set in its payload).

    A request dict holding ``model`` (a batch over several models) gives its job that model instead of
    ``model``; every request of a job must then name the same one (the submit plans it so). A request as
    ``bytes`` is its JSON already, as submit's pass 1 wrote it (no ``model``): a job of such requests holds
    them as they are (:class:`lmdq.jobs.data.RawRequests`)."""
    p = params.model_dump(exclude_none=True)
    urls: dict[str, Any] = {k: v for k, v in (("results_url", results_url), ("blob_url", blob_url)) if v}
    if reuse_ttl_s is not None:  # issue 47: the job's worker answers from, and records into, the reuse index
        urls["reuse_ttl_s"] = reuse_ttl_s

    def job(job_no: int, reqs: list[dict[str, Any] | bytes]) -> dict[str, Any]:
        held: list[dict[str, Any]] | RawRequests
        if all(type(r) is bytes for r in reqs):  # the spill's JSON as it is: the job's model is the batch's
            held = RawRequests(reqs)  # type: ignore[arg-type]  # all bytes: checked on the line above
            job_model = model
        else:
            held = [r if isinstance(r, dict) else json.loads(r) for r in reqs]
            names = {r.pop("model") for r in held if "model" in r}
            if len(names) > 1:
                raise SubmitRejected(f"batch {batch_id}: job {job_no} would mix models {sorted(names)}; nothing "
                                     "was enqueued")
            job_model = names.pop() if names else model
        out = {"format_version": 1, "batch_id": batch_id, "model": job_model, "job_no": job_no, "params": p,
               "requests": held, **urls}
        if gated is not None and gated(job_no):
            out["gated"] = True
        return out

    reqs: list[dict[str, Any] | bytes] = []
    job_no = 0
    want = job_sizes[0] if job_sizes else batch_size
    for req in requests:
        reqs.append(req)
        if len(reqs) == want:
            yield job(job_no, reqs)
            job_no += 1
            reqs = []
            if job_sizes:
                want = job_sizes[job_no] if job_no < len(job_sizes) else batch_size
    if reqs:
        yield job(job_no, reqs)




def _where(client: redis.Redis) -> str:
    """Where the client's server is, for messages: never the URL, so never a password."""
    return server_address(client)


_ENQUEUE_OUTCOME = "nothing was enqueued"


def redis_refusal(
    err: redis.RedisError, client: redis.Redis, outcome: str = _ENQUEUE_OUTCOME
) -> RedisRefused | None:
    """The one-line :class:`RedisRefused` for a write Redis refused on purpose, or None.

    Out of memory under ``maxmemory``, a read-only replica and a failed RDB save (MISCONF) are
    refusals: the server is fine, retrying later or against the primary can work, so the user
    gets the cause in one line instead of a traceback. ``outcome`` says what that means for the
    operation ("nothing was enqueued").
    """
    kind = refusal(err)
    where = _where(client)
    if kind is Refusal.out_of_memory:
        return RedisRefused(
            f"Redis at {where} is out of memory (maxmemory) and refused a write; {outcome}. "
            "Free memory (finished batches, results) or raise maxmemory, then try again"
        )
    if kind is Refusal.read_only:
        return RedisRefused(
            f"Redis at {where} is a read-only replica and refused a write; {outcome}. "
            "Point LMDQ_REDIS_URL at the primary"
        )
    if kind is Refusal.misconf:
        return RedisRefused(
            f"Redis at {where} refuses writes because it cannot save its snapshot (MISCONF); {outcome}. "
            "Fix the server's disk or persistence settings, then try again"
        )
    return None


@dataclass(frozen=True)
class Staged:
    """What :meth:`BatchLedger.stage` wrote: the commit checks it against the batch record."""

    jobs: int
    requests: int


@dataclass(frozen=True)
class Purged:
    """What :meth:`BatchLedger.purge` deleted (``purge`` prints it)."""

    batch_id: str
    #: the batch's status when it was purged
    status: BatchStatus
    #: Redis keys deleted (batch record, results, index, job hashes, ...)
    keys: int
    #: job hashes among them
    jobs: int
    #: queued jobs taken off their queue (only a running batch purged with ``force``)
    dequeued: int

    def __str__(self) -> str:
        was = f"{self.status.value}, " if not self.status.terminal else ""
        pulled = f", took {self.dequeued:,} queued jobs off the queue" if self.dequeued else ""
        return (f"purged {self.batch_id} ({was}{self.keys:,} Redis keys deleted, {self.jobs:,} of them "
                f"job hashes{pulled}); files in its results URL are left as they are")


class BatchLedger:
    """Batch-level Redis rules: create, stage, commit, rollback, cancel, retry's sources, idempotency.

    The client, key layout and TTL are passed in (no module-level connections); a ledger holds no
    per-batch state, so one instance serves any number of batches and threads.
    """

    def __init__(
        self, client: redis.Redis, *, keys: Keys, ttl_s: int, max_job_bytes: int = DEFAULT_MAX_JOB_BYTES,
        staging_lease_s: float = default_of(CommonSettings, "staging_lease_s"),
    ) -> None:
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s
        #: LMDQ_STAGING_LEASE_S: how long a progressive submit's lease lasts unrenewed (docs/reliability.md)
        self.staging_lease_s = staging_lease_s
        self.staging = StagingLeases(client, keys=keys)
        self.store = ResultStore(client, keys=keys, ttl_s=ttl_s)
        # the same cap the workers read jobs with (LMDQ_MAX_JOB_BYTES): staging refuses a job over it, and
        # retry reads its source jobs within it
        self.jobs = JobQueue(client, keys=keys, job_ttl_s=staging_ttl(ttl_s), max_job_bytes=max_job_bytes)
        # the Redis commands (lmdq.redis): the batch record, its jobs, idempotency keys; the rules are here
        self.records = self.store.batches
        self.batch_jobs = BatchJobs(client, keys=keys)
        self.idempotency = IdempotencyKeys(client, keys=keys)
        self._commit = self.batch_jobs.commit
        #: quality gates (submit --canary / --gate-window): their keys, the held jobs, pause and resume
        self.gates = GateStore(client, keys=keys)

    @functools.cached_property
    def _log(self) -> Any:
        """The ledger's logger, made by its first line: a ledger that logs nothing (``status``, ``list``)
        never imports structlog (lmdq.logs.config; issue 49)."""
        return get_logger("lmdq.submission.ledger")

    @contextmanager
    def _refusals(self, outcome: str = _ENQUEUE_OUTCOME) -> Iterator[None]:
        """Turn a refused write (OOM, READONLY, MISCONF) into one RedisRefused line."""
        try:
            yield
        except redis.RedisError as e:
            refused = redis_refusal(e, self.client, outcome)
            if refused is None:
                raise
            raise refused from e

    def _queue_of(self, batch: Batch, payload: dict[str, Any]) -> str:
        """The queue a staged job goes on: its own model's (a batch over several models), at the batch's
        priority. A job naming a model its batch does not run is refused: it could never be answered."""
        model = payload["model"]
        if model != batch.model and model not in batch.models:
            raise SubmitRejected(f"batch {batch.id}: job {payload['job_no']} names model {model!r}, which the "
                                 "batch does not run on; nothing was enqueued")
        return queue_name(model, batch.priority, self.keys.prefix)

    def _queues(self, batch: Batch) -> list[str]:
        """Every queue the batch's jobs may be on: each of its models', at every priority."""
        return [q for m in batch.models for q in queue_names(m, self.keys.prefix)]

    def _commit_keys(self, batch: Batch) -> tuple[str, list[str]]:
        """(the queue key commits push onto, or '' when each job goes to its own model's queue: the job
        hash's ``origin``), and the wake lists of every model of the batch."""
        qkey = "" if batch.model_counts else rq_queue_key(queue_name(batch.model, batch.priority, self.keys.prefix))
        return qkey, [self.keys.wake(m) for m in batch.models]

    # ---- lookups --------------------------------------------------------------------------
    def get(self, batch_id: str) -> Batch:
        """The batch record; raises BatchNotFound."""
        return self.store.batches.get(batch_id)

    def known_models(self, extra: Iterable[str] = ()) -> set[str]:
        """Model names ``submit`` accepts: registered by an operator or served by some worker
        (:class:`lmdq.registry.store.ModelRegistry`), plus ``extra`` (the producer's LMDQ_KNOWN_MODELS)."""
        return ModelRegistry(self.client, keys=self.keys).known() | set(extra)

    # ---- idempotency ------------------------------------------------------------------------
    def bound_batch(self, idempotency_key: str, *, fingerprint: str | None = None) -> Batch | None:
        """The batch ``idempotency_key`` is bound to, or None when it is free.

        With ``fingerprint`` (what the submit is: :func:`lmdq.submission.submit.submit_fingerprint`), a
        bound batch recorded with a different one is refused (:class:`IdempotencyConflict`): the same
        key with another file or other options would otherwise be dropped without a word. A batch with
        no recorded fingerprint (made by an older lmdq) matches any."""
        batch_id = self.idempotency.bound(idempotency_key)
        if not batch_id:
            return None
        (theirs,) = self.records.hashes.fields(batch_id, [F.fingerprint.value])
        batch = self.get(batch_id)
        if fingerprint is not None and theirs is not None and reply_text(theirs) != fingerprint:
            raise IdempotencyConflict(
                f"--idempotency-key {idempotency_key!r} is bound to batch {batch_id} ({batch.status.value}), "
                "submitted with a different file or options; nothing was enqueued. Use a new key, or "
                f"`lmdq-producer status {batch_id}` for that batch"
            )
        return batch

    def bind_key(self, idempotency_key: str, batch_id: str) -> str | None:
        """Bind ``idempotency_key`` to ``batch_id`` unless it is bound already; returns the bound
        batch id then. SET NX, so two concurrent submits with one key cannot both enqueue."""
        with self._refusals():
            if self.idempotency.bind(idempotency_key, batch_id, ttl_s=staging_ttl(self.ttl_s)):
                return None
        existing = self.idempotency.bound(idempotency_key)
        if existing is None:  # it expired between the two calls: bind again
            return self.bind_key(idempotency_key, batch_id)
        return existing

    def release_key(self, idempotency_key: str, batch_id: str) -> None:
        """Free ``idempotency_key`` if it is still bound to ``batch_id`` (never another batch's).

        Called on failure paths, so a Redis error is logged, not raised over the original failure:
        the key would then expire with its TTL."""
        try:
            self.idempotency.release(idempotency_key, batch_id)  # reads first: nothing to write on a replica
        except redis.RedisError as e:
            self._log.error("idempotency key not released", batch=batch_id, error=str(e))

    # ---- create, stage, commit, rollback ------------------------------------------------------
    def create(self, batch: Batch, *, fingerprint: str | None = None) -> None:
        """Write the batch record (status ``validating``: invisible to workers until commit);
        ``fingerprint``: what an idempotency key's later submits are compared with."""
        with self._refusals():
            self.store.batches.create(batch, extra={F.fingerprint.value: fingerprint} if fingerprint else None)

    def stage(
        self, batch: Batch, requests: Iterable[dict[str, Any] | bytes], *, progress: Progress | None = None,
        chunk_jobs: int = 256, job_sizes: Sequence[int] | None = None,
        gated: Callable[[int], bool] | None = None,
    ) -> Staged:
        """Save the batch's job hashes, pipelined ``chunk_jobs`` at a time, without queueing them.

        Raises SubmitRejected (and stops reading ``requests``) once they exceed the batch's
        recorded total: a batch must never run more requests than it counts.
        """
        total = batch.request_counts.total
        jobs = reqs = 0
        with self._refusals(), self.batch_jobs.writes() as writes:
            for payload in job_payloads(
                requests,
                batch_id=batch.id,
                model=batch.model,
                params=batch.params,
                batch_size=batch.batch_size,
                results_url=batch.results_url,
                blob_url=batch.blob_url, reuse_ttl_s=batch.reuse_ttl_s,
                job_sizes=job_sizes,
                gated=gated,
            ):
                reqs += len(payload["requests"])
                if reqs > total or jobs >= batch.num_jobs:
                    raise SubmitRejected(
                        f"batch {batch.id}: more requests than the {total} its record counts; nothing was enqueued"
                    )
                self.jobs.stage(payload, queue=self._queue_of(batch, payload), job_no=payload["job_no"],
                                pipe=writes.pipe)
                jobs += 1
                if jobs % chunk_jobs == 0:
                    writes.flush()
                    if progress:
                        progress(jobs)
            writes.flush()
        if progress:
            progress(jobs)
        return Staged(jobs=jobs, requests=reqs)

    def commit(self, batch: Batch, staged: Staged, *, held: bool = False) -> int:
        """Make every staged job visible on the batch's queue and mark it ``queued``, in one step.

        Refuses (SubmitRejected) a batch whose staged jobs do not add up to its record: a batch
        with fewer requests than its total would never complete. Returns the jobs made visible
        (0 when this batch had been committed already).
        """
        if staged.requests != batch.request_counts.total or staged.jobs != batch.num_jobs:
            raise SubmitRejected(
                f"batch {batch.id}: staged {staged.requests} requests in {staged.jobs} jobs, its record counts "
                f"{batch.request_counts.total} in {batch.num_jobs}; nothing was enqueued"
            )
        qkey, wakes = self._commit_keys(batch)
        with self._refusals():
            n = self._commit(batch_id=batch.id, queue_key=qkey, wakes=wakes, now=time.time(), ttl_s=RUNNING_TTL_S,
                             hold=self.gates.hold_keys(batch.id) if held else None)
        return max(0, int(n))

    def committed(self, batch_id: str) -> bool:
        """Whether the batch's jobs were made visible (its commit ran)."""
        return self.records.hashes.has_field(batch_id, F.queued_at.value)

    def rollback(self, batch: Batch) -> None:
        """Delete everything :meth:`create`, :meth:`bind_key` and :meth:`stage` wrote for an
        uncommitted batch: record, listing entry, job hashes, job list, idempotency key.

        Job ids are derived from the batch id, so a job hash whose id never reached the job list
        (a pipeline cut short by OOM) is deleted too. A committed batch is left alone: workers
        may hold its jobs.
        """
        if self.committed(batch.id):
            self._log.warning("not rolling back a committed batch", batch=batch.id)
            return
        listed = set(self.batch_jobs.job_ids(batch.id))
        derived = {job_id_for(batch.id, n) for n in range(batch.num_jobs)}
        prefix = job_id_prefix(batch.id)
        candidates = [Job.key_for(j) for j in sorted(derived | {j for j in listed if j.startswith(prefix)})]
        candidates += [self.keys.batch_jobs(batch.id), self.keys.batch(batch.id), *self.gates.all_keys(batch.id)]
        # Read first, delete only what exists: when the refusal was a read-only replica nothing was
        # written, and a rollback that writes nothing cannot be refused in turn.
        present, is_listed = self.batch_jobs.staged(batch.id, candidates)
        if present or is_listed:
            self.batch_jobs.unstage(batch.id, present)
            self.staging.release(batch.id)
        if batch.idempotency_key:
            self.release_key(batch.idempotency_key, batch.id)

    def enqueue(
        self, batch: Batch, requests: Iterable[dict[str, Any] | bytes], *, progress: Progress | None = None,
        chunk_jobs: int = 256, job_sizes: Sequence[int] | None = None, fingerprint: str | None = None,
        first_jobs: int | None = None, after_first_commit: Callable[[], None] | None = None,
        id_chunks: Iterable[str | bytes] = (), resume: bool = False, gates: GateConfig | None = None,
    ) -> Batch:
        """Create ``batch``, stage its jobs and commit them: all or nothing.

        Any failure before the commit (a bad request source, Redis out of memory, Ctrl-C) rolls
        everything back, idempotency key included, and re-raises; a refused write is raised as one
        :class:`RedisRefused` line.

        ``first_jobs``: progressive instead (:meth:`_enqueue_progressively`): the first ``first_jobs`` jobs
        become visible as soon as they are staged, then every ``chunk_jobs``, so workers start while the
        rest is staged; ``after_first_commit`` is called once, right after the first jobs became visible.
        ``id_chunks``: the batch's custom_ids in input order, JSON arrays of :data:`IDS_CHUNK` (progressive
        staging writes them before anything is visible: what answers requests no job ever held), read once,
        in order, and written to Redis a bounded number of chunks at a time (:meth:`StagingLeases.begin`).
        ``resume``: ``batch`` is a part-staged batch whose staging lease lapsed, and ``requests`` the same
        submit's (same file, same options): take the lease over and stage what is not visible yet.
        ``gates``: quality gates (lmdq.gates): with a canary, only its jobs are queued at the commit and the
        rest are held until its verdict; the whole batch is staged first (``first_jobs`` is ignored: the
        sample is spread over the whole file, so the file is staged before anything runs).
        """
        if gates is not None:
            return self._enqueue_gated(batch, requests, gates, progress=progress, chunk_jobs=chunk_jobs,
                                       job_sizes=job_sizes, fingerprint=fingerprint)
        if first_jobs is not None or resume:
            return self._enqueue_progressively(batch, requests, progress=progress, chunk_jobs=chunk_jobs,
                                               job_sizes=job_sizes, first_jobs=first_jobs or 8,
                                               after_first_commit=after_first_commit, fingerprint=fingerprint,
                                               id_chunks=id_chunks, resume=resume)
        try:
            self.create(batch, fingerprint=fingerprint)
            staged = self.stage(batch, requests, progress=progress, chunk_jobs=chunk_jobs, job_sizes=job_sizes)
            self.commit(batch, staged)
        except BaseException as e:
            if not self._commit_landed(batch, e):
                self._rollback_quietly(batch)
                raise
        return self.get(batch.id)

    def _enqueue_gated(self, batch: Batch, requests: Iterable[dict[str, Any] | bytes], gates: GateConfig, *,
                       progress: Progress | None, chunk_jobs: int, job_sizes: Sequence[int] | None,
                       fingerprint: str | None) -> Batch:
        """:meth:`enqueue` with quality gates: the gates' keys, then the jobs (canary and window jobs
        marked ``gated``), then one commit that queues the canary and holds the rest."""
        total, size = batch.request_counts.total, batch.batch_size
        sizes = list(job_sizes) if job_sizes else [min(size, total - j * size) for j in range(batch.num_jobs)]
        canary = set(canary_jobs(gates, sizes))
        window = gates.window is not None
        qkey, wakes = self._commit_keys(batch)
        try:
            self.create(batch, fingerprint=fingerprint)
            with self._refusals():
                self.gates.create(batch.id, gates, canary_job_ids=[job_id_for(batch.id, j) for j in sorted(canary)],
                                  queue_key=qkey, queues=[rq_queue_key(q) for q in self._queues(batch)],
                                  wakes=wakes, ttl_s=RUNNING_TTL_S)
            staged = self.stage(batch, requests, progress=progress, chunk_jobs=chunk_jobs, job_sizes=job_sizes,
                                gated=lambda j: window or j in canary)
            self.commit(batch, staged, held=bool(canary))
        except BaseException as e:
            if not self._commit_landed(batch, e):
                self._rollback_quietly(batch)
                raise
        self._log.info("batch committed with quality gates", batch=batch.id, canary_jobs=len(canary),
                       canary_requests=sum(sizes[j] for j in canary),
                       held_jobs=batch.num_jobs - len(canary) if canary else 0, window=gates.window)
        return self.get(batch.id)

    def resume(self, batch_id: str) -> Batch:
        """Run the rest of a ``paused`` batch (its gate failed): its held jobs onto the queue, the rolling
        window started afresh. Refuses (SubmitRejected) a batch that is not paused."""
        batch = self.get(batch_id)
        with self._refusals("the resume did not finish; run it again once Redis accepts writes"):
            n = self.gates.resume(batch_id)
        if n < 0:
            raise SubmitRejected(f"batch {batch_id} is {batch.status.value}, not paused: nothing to resume")
        self._log.info("paused batch resumed", batch=batch_id, released_jobs=n)
        return self.get(batch_id)

    def _enqueue_progressively(
        self, batch: Batch, requests: Iterable[dict[str, Any] | bytes], *, progress: Progress | None,
        chunk_jobs: int, job_sizes: Sequence[int] | None, first_jobs: int,
        after_first_commit: Callable[[], None] | None, fingerprint: str | None = None,
        id_chunks: Iterable[str | bytes] = (), resume: bool = False,
    ) -> Batch:
        """Stage and make visible in steps: the GPU does not wait for the whole batch to be staged.

        Only requests the caller has validated may come in (submit validates the whole file first and
        checks every request of its second pass against the first): "a bad line enqueues nothing" holds.
        A failure before the first jobs are visible rolls everything back as :meth:`enqueue` does. A
        failure after (the file changed, Redis refused a write, Ctrl-C) cannot un-run visible jobs, so the
        batch ends cancelled (:meth:`abandon`): staged-but-invisible jobs are deleted, queued ones get
        ``cancelled`` results, running ones are aborted by their workers, the never-queued requests get
        ``cancelled`` results too (their ids are in Redis from the start), and ``staging_failed`` says why;
        the error is re-raised with that added.

        A submit that DIES instead (SIGKILL, a lost host) ends nothing itself: its staging lease
        (LMDQ_STAGING_LEASE_S, renewed by a thread of its own and checked by every commit) lapses, and then
        a re-run of the same submit resumes the batch here (``resume``: the jobs already visible are
        skipped, never staged twice) or whoever notices first ends it (:meth:`end_interrupted`)."""
        total = batch.request_counts.total
        jobs = reqs = visible = visible_reqs = 0
        token = uuid.uuid4().hex
        renewer: _Renewer | None = None
        try:
            if resume:
                visible, visible_reqs = self._take_over(batch, token)
            else:
                self.create(batch, fingerprint=fingerprint)
                with self._refusals():
                    self.staging.begin(batch.id, token, lease_s=self.staging_lease_s,
                                   id_chunks=id_chunks, ttl_s=staging_ttl(self.ttl_s))
            renewer = _Renewer(self.staging, batch.id, token, self.staging_lease_s)
            with self._refusals(), self.batch_jobs.writes() as writes:
                next_commit = max(1, first_jobs) if visible == 0 else visible + max(1, chunk_jobs)
                for payload in job_payloads(requests, batch_id=batch.id, model=batch.model, params=batch.params,
                                            batch_size=batch.batch_size, results_url=batch.results_url,
                                            blob_url=batch.blob_url, reuse_ttl_s=batch.reuse_ttl_s,
                                            job_sizes=job_sizes):
                    reqs += len(payload["requests"])
                    if jobs < visible:  # resumed: this job is visible already (same file, same options: same jobs)
                        jobs += 1
                        if jobs == visible and reqs != visible_reqs:
                            raise SubmitRejected(f"batch {batch.id}: its {visible} visible jobs hold {visible_reqs} "
                                                 f"requests, this submit's first {visible} hold {reqs}")
                        continue
                    if reqs > total or jobs >= batch.num_jobs:
                        raise SubmitRejected(f"batch {batch.id}: more requests than the {total} its record counts")
                    self.jobs.stage(payload, queue=self._queue_of(batch, payload), job_no=payload["job_no"],
                                    pipe=writes.pipe)
                    jobs += 1
                    if jobs == next_commit and jobs < batch.num_jobs:
                        writes.flush()
                        renewer.check()
                        first = visible == 0
                        self._make_visible(batch, jobs, reqs, last=False, token=token)
                        visible, visible_reqs = jobs, reqs
                        next_commit = jobs + max(1, chunk_jobs)
                        if progress:
                            progress(jobs)
                        if first and after_first_commit is not None:
                            after_first_commit()
                writes.flush()
            if reqs != total or jobs != batch.num_jobs:
                raise SubmitRejected(f"batch {batch.id}: staged {reqs} requests in {jobs} jobs, its record counts "
                                     f"{total} in {batch.num_jobs}")
            renewer.check()
            self._make_visible(batch, jobs, reqs, last=True, token=token)
            renewer.stop()
            self.staging.release(batch.id, token)
            if progress:
                progress(jobs)
        except BaseException as e:
            if renewer is not None:
                renewer.stop()
            if isinstance(e, StagingLeaseLost):
                raise  # the batch is another's now: a re-run resumes it, or a noticer ends it
            if visible == 0 and not resume and not self._commit_landed(batch, e):
                self._rollback_quietly(batch)
                raise
            err = self._abandoned(batch, e, visible, visible_reqs)
            if err is e:
                raise
            raise err from e
        return self.get(batch.id)

    def resumable(self, batch: Batch) -> bool:
        """Whether ``batch`` is part-staged with its staging unended: a re-run of its submit may resume it once
        its lease lapses."""
        if batch.status.terminal or batch.status is BatchStatus.cancelling:
            return False
        vis, staged, failed = self.records.hashes.fields(
            batch.id, [F.visible_jobs.value, F.staged_at.value, F.staging_failed.value])
        return vis is not None and staged is None and failed is None

    def _take_over(self, batch: Batch, token: str) -> tuple[int, int]:
        """Take a lapsed staging lease over for a re-run (waiting up to the lease for a live one to lapse);
        drop the dead submit's staged-but-invisible jobs; returns (jobs, requests) visible."""
        deadline = time.monotonic() + self.staging_lease_s + 1
        while True:
            got = self.staging.acquire(batch.id, token, lease_s=self.staging_lease_s)
            if got == 1:
                break
            if got == -2:
                raise StagingLeaseLost(f"batch {batch.id} can no longer be resumed: it was staged or ended")
            if time.monotonic() > deadline:
                raise StagingLeaseLost(f"batch {batch.id} is being staged by another submit (its lease is live)")
            time.sleep(min(0.2, self.staging_lease_s / 4))
        raw = self.records.hashes.fields(batch.id, [F.visible_jobs.value, F.visible_requests.value])
        visible, visible_reqs = int(raw[0] or 0), int(raw[1] or 0)
        self._drop_invisible(batch, visible)
        self._log.warning("resuming a batch whose submit died while staging it", batch=batch.id,
                          visible_jobs=visible, jobs=batch.num_jobs)
        return visible, visible_reqs

    def _drop_invisible(self, batch: Batch, visible: int) -> None:
        """Delete the batch's staged jobs past its first ``visible`` (never visible: nothing may run them)."""
        listed = self.batch_jobs.job_ids(batch.id, start=visible)
        gone = {job_id_for(batch.id, n) for n in range(visible, batch.num_jobs)} | set(listed)
        self.batch_jobs.drop_unqueued(batch.id, sorted(gone), keep=visible)

    def _make_visible(self, batch: Batch, jobs: int, reqs: int, *, last: bool, token: str = "") -> None:
        qkey, wakes = self._commit_keys(batch)
        with self._refusals("the batch was cancelled"):
            n = self.batch_jobs.commit_upto(batch_id=batch.id, queue_key=qkey, wakes=wakes, jobs=jobs, requests=reqs,
                                            now=time.time(), ttl_s=RUNNING_TTL_S, last=last, token=token)
        if n == -2:
            raise SubmitRejected(f"batch {batch.id} was cancelled while it was being staged")
        if n == -3:
            raise StagingLeaseLost(f"batch {batch.id}: its staging lease lapsed while this submit staged it; "
                                   "nothing more of it was made visible")

    # ---- a part-staged batch's end: every request answered ----------------------------------------
    def answer_unstaged(self, batch: Batch, status: ResultStatus, error: ErrorInfo | None = None) -> int:
        """Give every request of a part-staged batch that no visible job holds its final result (``status``,
        ``error``), so the batch counts and exports one line per request however it ended; staged jobs that
        never became visible are deleted first. The caller has frozen the batch's visible jobs (moved it to
        cancelling, or claimed its lapsed lease). Idempotent (a request is answered once). Returns how many
        results were new."""
        vis, vis_reqs = self.records.hashes.fields(batch.id, [F.visible_jobs.value, F.visible_requests.value])
        visible, visible_reqs = int(vis or 0), int(vis_reqs or 0)
        self._drop_invisible(batch, visible)
        total = batch.request_counts.total
        covered = bytearray(total)
        if batch.prefix_groups:  # jobs hold any indices: their manifests say which
            job_ids = self.batch_jobs.job_ids(batch.id)[:visible]
            for start in range(0, len(job_ids), _FETCH_CHUNK):
                for _, (raw,) in self.batch_jobs.leases_and_fields(job_ids[start : start + _FETCH_CHUNK],
                                                                   [REQUESTS_FIELD]):
                    for i, _cid in _manifest(raw, total) or []:
                        covered[i] = 1
        else:  # jobs in input order: the visible ones hold the first requests
            n = min(visible_reqs, total)
            covered[:n] = b"\x01" * n
        model = "" if batch.model_counts else batch.model  # a batch over several models: the line's model is unknown
        now = time.time()
        new = 0
        chunks = (total + IDS_CHUNK - 1) // IDS_CHUNK
        for c0 in range(0, chunks, 20):
            ids = self.staging.ids(batch.id, c0, min(chunks, c0 + 20) - 1)
            ids += [[]] * (min(chunks, c0 + 20) - c0 - len(ids))
            results = []
            for k, chunk in enumerate(ids):
                base = (c0 + k) * IDS_CHUNK
                for i in range(base, min(total, base + IDS_CHUNK)):
                    if covered[i]:
                        continue
                    j = i - base
                    cid = chunk[j] if j < len(chunk) else f"<unknown:{i}>"  # its ids expired: still one line each
                    results.append(Result(batch_id=batch.id, custom_id=cid, index=i, status=status, model=model,
                                          error=error, timings=Timings(enqueued_at=batch.created_at, finished_at=now)))
            new += self.store.write_results(results)
        self.staging.mark_answered(batch.id, now)
        return new

    def end_interrupted(self, batch_id: str) -> bool:
        """End a part-staged batch whose staging lease lapsed (its submit died and no re-run resumed it): its
        staged-but-invisible jobs are deleted, every request no visible job holds is answered ``failed`` with
        ``submit_interrupted``; the visible jobs run on, and the batch ends when they are done. Whoever notices
        calls this (workers, status/results/cancel, the API); the lease script lets one of them claim it, and
        a claimer that died half-way is finished by the next. True when this call ended it."""
        got = self.staging.claim_end(batch_id, INTERRUPTED)
        if got in (0, -2):
            return False
        vis, answered, why = self.records.hashes.fields(
            batch_id, [F.visible_jobs.value, F.unstaged_answered.value, F.staging_failed.value])
        if answered is not None:
            self.staging.release(batch_id)
            return False
        batch = self.get(batch_id)
        if got == -1 and (why is None or reply_text(why) != INTERRUPTED):
            self.cancel(batch_id)  # its submit failed and was cancelling it when it stopped: finish that
        else:
            n = self.answer_unstaged(batch, ResultStatus.failed,
                                     ErrorInfo(code=ErrorCode.submit_interrupted.value, message=INTERRUPTED))
            self._log.warning("ended a batch whose submit died while staging it", batch=batch_id,
                              visible_jobs=int(vis or 0), jobs=batch.num_jobs, unstaged_failed=n)
        self.staging.release(batch_id)
        return True

    def notice_interrupted(self, batch_ids: Iterable[str] | None = None, *,
                           keep: Collection[str] = ()) -> list[str]:
        """End every part-staged batch (of ``batch_ids``, or of the staging set) whose lease lapsed, but those
        in ``keep`` (a re-run of their submit is on its way: the API's own retry); returns the ids this call
        ended. Cheap when there is none: one SMEMBERS (or one script per id given)."""
        ended = []
        for batch_id in (self.staging.pending() if batch_ids is None else batch_ids):
            if batch_id in keep:
                continue
            try:
                if self.end_interrupted(batch_id):
                    ended.append(batch_id)
            except BatchNotFound:
                self.staging.release(batch_id)
        return ended

    def _abandoned(self, batch: Batch, err: BaseException, visible: int, visible_reqs: int) -> BaseException:
        """Cancel a batch whose staging stopped after ``visible`` jobs were visible; the error to raise."""
        # the error's own text may say "nothing was enqueued", which is no longer true: the rest of the message says
        reason = (str(err) or type(err).__name__).replace(f"; {_ENQUEUE_OUTCOME}", "").replace(_ENQUEUE_OUTCOME,
                                                                                                "staging stopped")
        try:
            self.abandon(batch.id, reason)
            outcome = "it was cancelled"
        except (redis.RedisError, RedisRefused, SubmitRejected) as e2:
            # the error raised says so, with how to end it later: one line for the user, not two
            self._log.debug("could not cancel the part-staged batch", batch=batch.id, error=str(e2))
            outcome = f"cancel it with `lmdq-producer cancel {batch.id}` once Redis accepts writes"
        total = batch.request_counts.total
        what = (f"{reason}. Staging stopped after {visible} of {batch.num_jobs} jobs of batch {batch.id} were "
                f"queued ({visible_reqs:,} of {total:,} requests): {outcome} (queued requests cancelled, running "
                f"ones aborted, finished ones kept; the other {total - visible_reqs:,} were never queued)")
        if isinstance(err, RedisRefused):
            return RedisRefused(what)
        if isinstance(err, (SubmitRejected, redis.RedisError)):
            return SubmitRejected(what)
        return err  # Ctrl-C and the like: the batch is cancelled all the same, the error stays what it was

    def abandon(self, batch_id: str, reason: str) -> Batch:
        """End a batch whose progressive staging stopped part-way (its submit failed): record why, then cancel
        it (:meth:`cancel`: never-visible jobs deleted, every request no visible job holds answered
        ``cancelled``). Idempotent."""
        with self._refusals("the batch is left part-staged"):
            vis = self.records.hashes.fields(batch_id, [F.visible_jobs.value])[0]
            if vis is not None:  # first what frees memory: Redis may be full (the very reason staging stopped)
                self._drop_invisible(self.get(batch_id), int(vis))
            self.staging.mark_failed(batch_id, reason[:2000])
        return self.cancel(batch_id)

    def _commit_landed(self, batch: Batch, err: BaseException) -> bool:
        """After a failure: did the commit run anyway (a connection dropped after it executed)?"""
        if not isinstance(err, (redis.ConnectionError, redis.TimeoutError)):
            return False
        try:
            return self.committed(batch.id)
        except redis.RedisError:
            return False

    def _rollback_quietly(self, batch: Batch) -> None:
        """Roll back without masking the error that caused it (a failed rollback is logged)."""
        try:
            self.rollback(batch)
        except redis.RedisError as e:
            self._log.error("rollback incomplete: staged keys may remain until their TTL", batch=batch.id,
                            error=str(e))

    # ---- cancel -----------------------------------------------------------------------------
    def cancel(self, batch_id: str) -> Batch:
        """Cancel a batch: pull its queued jobs off the queues, abort what workers hold.

        Queued jobs' requests get ``cancelled`` results right here, so counts are right even when no
        worker is running; in-flight requests are aborted by their workers, which watch the
        cancelled set. Results are written BEFORE the jobs leave the queue: if Redis refuses the
        writes midway (out of memory), the jobs are still queued and a worker cancels them, instead
        of being gone with no result. A job on the queue that is not this batch's lmdq job is
        refused (recorded as failed in RQ), never decoded further.
        """
        batch = self.get(batch_id)
        if batch.status.terminal:
            return batch
        staging = self.records.hashes.fields(batch_id, [F.visible_jobs.value, F.staged_at.value,
                                                        F.unstaged_answered.value])
        with self._refusals("the cancel did not finish; run it again once Redis accepts writes"):
            self.store.batches.transition(
                batch_id,
                [BatchStatus.validating, BatchStatus.queued, BatchStatus.in_progress, BatchStatus.paused],
                BatchStatus.cancelling,
                F.cancelling_at,
            )
            self.records.hashes.mark_cancelled(batch_id)
            if staging[0] is not None and staging[1] is None:  # part-staged: its never-staged requests too
                # cancelling: its submit's next commit is refused, so the visible jobs are fixed from here
                self.staging.mark_failed(batch_id, "cancelled while it was being staged")
                if staging[2] is None:
                    self.answer_unstaged(batch, ResultStatus.cancelled)
                self.staging.release(batch_id)
            now = time.time()
            prefix = job_id_prefix(batch_id)
            for q in self._queues(batch):
                qkey = rq_queue_key(q)
                done = {jid: self._write_cancelled(batch, jid, now) for jid in self.batch_jobs.queued(qkey, prefix)}
                for jid in self.batch_jobs.dequeue(qkey, prefix):
                    job = done[jid] if jid in done else self._write_cancelled(batch, jid, now)  # re-queued since
                    if job is not None:
                        self.batch_jobs.mark_canceled(job.id)
            self._cancel_unheld(batch, now)
            b = self.get(batch_id)
            if b.request_counts.done >= b.request_counts.total and b.status is BatchStatus.cancelling:
                self.store.batches.transition(batch_id, [BatchStatus.cancelling], BatchStatus.cancelled, F.cancelled_at)
        return self.get(batch_id)

    def in_flight(self, batch: Batch) -> int:
        """Jobs of ``batch`` that something will still answer: on one of its model's queues, or held under a
        live lease. 0 for a batch that has not ended means it is stuck (nothing will ever end it)."""
        prefix = job_id_prefix(batch.id)
        queued = sum(len(self.batch_jobs.queued(rq_queue_key(q), prefix)) for q in self._queues(batch))
        job_ids = self.batch_jobs.job_ids(batch.id)
        server_now = self.jobs.lease_now()
        live = sum(1 for x in self.batch_jobs.lease_deadlines(job_ids) if x is not None and x > server_now)
        return queued + live

    def _cancel_unheld(self, batch: Batch, now: float) -> None:
        """``cancelled`` results for the requests of every job of the batch that no live lease holds and no
        queue lists (those were handled above): a job a worker refused, one whose worker died with no
        worker left to reap it. Without this, such a batch stayed ``cancelling`` for good. A job under a
        live lease is left to its worker (it watches the cancelled set); a request that has a result keeps
        it (the results script writes each request once)."""
        job_ids = self.batch_jobs.job_ids(batch.id)
        server_now = self.jobs.lease_now()
        # a job's model from the queue it was staged for (its hash's origin): a batch over several models
        models = {q: m for m in batch.models for q in queue_names(m, self.keys.prefix)}
        for start in range(0, len(job_ids), _FETCH_CHUNK):
            chunk = job_ids[start : start + _FETCH_CHUNK]
            held = self.batch_jobs.leases_and_fields(chunk, [REQUESTS_FIELD, "origin"])
            for jid, (lease, (raw, origin)) in zip(chunk, held):
                if lease is not None and lease > server_now:
                    continue  # its worker aborts it and answers its requests
                requests = _manifest(raw, batch.request_counts.total)
                if requests is None:  # a job staged by an older lmdq: its payload says which requests
                    job = self._write_cancelled(batch, jid, now)
                    if job is not None:
                        self.batch_jobs.mark_canceled(job.id)
                    continue
                self.store.write_results(
                    Result(batch_id=batch.id, custom_id=cid, index=i, status=ResultStatus.cancelled,
                           model=models.get(reply_text(origin), batch.model) if origin is not None else batch.model,
                           timings=Timings(enqueued_at=batch.created_at, finished_at=now))
                    for i, cid in requests
                )

    def _write_cancelled(self, batch: Batch, job_id: str, now: float) -> Job | None:
        """Write ``cancelled`` results for a queued job's requests; returns the job, or None when it is
        not this batch's lmdq job (refused and recorded as failed) or has no job hash."""
        try:
            job, payload = decode_job(self.client, self.jobs, job_id, outputs=None)
            if payload.batch_id != batch.id:
                raise JobRefused(f"refusing job {job_id}: it names batch {payload.batch_id!r}, not {batch.id!r}")
        except NoSuchJobError:
            self._log.warning("queued job has no job hash (expired?)", batch=batch.id, job=job_id)
            return None
        except JobRefused as e:
            self._log.warning("refused a queued job while cancelling", batch=batch.id, job=job_id, reason=str(e))
            self.jobs.mark_refused(job_id, str(e), ttl_s=self.ttl_s)
            return None
        self.store.write_results(
            Result(
                batch_id=batch.id,
                custom_id=r.custom_id,
                index=r.index,
                status=ResultStatus.cancelled,
                model=payload.model,
                endpoint=r.endpoint,
                error=None,
                timings=Timings(enqueued_at=batch.created_at, finished_at=now),
            )
            for r in payload.requests
            if 0 <= r.index < batch.request_counts.total
        )
        return job

    # ---- purge ------------------------------------------------------------------------------
    def purge(self, batch_id: str, *, force: bool = False) -> Purged:
        """Delete everything Redis holds for ``batch_id`` now, instead of at its TTL.

        A batch that has not ended is refused (:class:`PurgeRefused`) unless ``force``: its queued
        jobs are then taken off the queues and the batch is added to the cancelled set, so workers
        abort what they hold; what they write afterwards is refused (the results script writes nothing
        for a batch without a record). Shards in the batch's results URL are not touched: the sink's
        files are the user's (``results --delete`` has just exported them).
        """
        batch = self.get(batch_id)
        running = not batch.status.terminal
        if running and not force:
            raise PurgeRefused(
                f"batch {batch_id} is {batch.status.value}: purging it now would drop the work workers hold; "
                f"cancel it first (`lmdq-producer cancel {batch_id}`) or pass --force"
            )
        dequeued = 0
        with self._refusals("the purge did not finish; run it again"):
            if running:
                self.records.hashes.mark_cancelled(batch_id)
                for q in self._queues(batch):
                    dequeued += len(self.batch_jobs.dequeue(rq_queue_key(q), job_id_prefix(batch_id)))
            listed = set(self.batch_jobs.job_ids(batch_id))
            prefix = job_id_prefix(batch_id)
            job_ids = sorted({job_id_for(batch_id, n) for n in range(batch.num_jobs)}
                             | {j for j in listed if j.startswith(prefix)})
            k = self.keys
            own = [k.batch(batch_id), k.results(batch_id), k.partials(batch_id), k.shards(batch_id),
                   k.sealed(batch_id), k.batch_jobs(batch_id), k.staging_lease(batch_id), k.request_ids(batch_id)]
            if batch.idempotency_key and self.idempotency.bound(batch.idempotency_key) == batch_id:
                own.append(k.idempotency(batch.idempotency_key))
            # one round trip: the batch's keys, its job hashes, its listing entry, RQ's records of its jobs on
            # each of its queues (rq info), and its cancelled-set member once it has ended
            self.staging.release(batch_id)  # out of the staging set (its keys go with ``own``)
            got = self.records.hashes.delete_batch(batch_id, own=own, job_keys=[Job.key_for(j) for j in job_ids],
                                                   queues=self._queues(batch), job_ids=job_ids, uncancel=not running)
        return Purged(batch_id=batch_id, status=batch.status, keys=got.keys + got.jobs, jobs=got.jobs,
                      dequeued=dequeued)

    # ---- retry's sources ------------------------------------------------------------------------
    def indices_with(self, batch: Batch, statuses: set[ResultStatus]) -> list[int]:
        """Indices of the batch's final results whose status is in ``statuses``, in input order."""
        from lmdq.results.reader import ResultReader

        wanted = {s.value for s in statuses}
        out = []
        # Jobs in a results shard: only the shards whose index entry counts a wanted status are read.
        reader = ResultReader.of(self.store, batch)
        for index, raw in reader.records(partial=False, need=lambda e: e.has_any(statuses)):
            if raw is None:
                continue
            try:
                record = json.loads(raw)
            except ValueError:  # not a result record: nothing to retry from it
                continue
            if isinstance(record, dict) and record.get("status") in wanted:
                out.append(index)
        return out

    def source_requests(self, batch: Batch, indices: list[int]) -> Iterator[Request]:
        """The accepted requests at ``indices`` (sorted), read back from the batch's own job
        payloads (the job list, in job order), so a retry needs no input file. A batch formed by
        prefix groups holds its indices in any job: its jobs are scanned in job order instead (and its
        requests come back in that order, which keeps their groups together for the retry)."""
        if batch.prefix_groups:
            yield from self._scan_requests(batch, indices)
            return
        bs = batch.batch_size
        by_job: dict[int, set[int]] = {}
        for i in indices:
            by_job.setdefault(i // bs, set()).add(i)
        job_ids = self.batch_jobs.job_ids(batch.id)
        needed = sorted(by_job)
        if needed and needed[-1] >= len(job_ids):
            raise RetryRejected(
                f"batch {batch.id!r}: its job list has {len(job_ids)} jobs, request index {indices[-1]} needs "
                f"job {needed[-1]} (jobs expire with the batch's results)"
            )
        for start in range(0, len(needed), _FETCH_CHUNK):
            chunk = needed[start : start + _FETCH_CHUNK]
            for job_no in chunk:
                try:  # bounded read (LMDQ_MAX_JOB_BYTES), never RQ's unbounded Job.fetch: a job is untrusted input
                    job = self.jobs.fetch_job(job_ids[job_no])
                    payload = JobQueue.payload_of(job)
                except ValueError as e:  # JobRefused: gone (expired), oversized or not lmdq's
                    raise RetryRejected(
                        f"batch {batch.id!r}: job {job_ids[job_no]} is not a readable lmdq job: {e}"
                    ) from e
                want = by_job[job_no]
                found = [r for r in payload.requests if r.index in want]
                if len(found) != len(want):
                    missing = sorted(want - {r.index for r in found})
                    raise RetryRejected(f"batch {batch.id!r}: job {job.id} lacks request indices {missing[:5]}")
                yield from found

    def _scan_requests(self, batch: Batch, indices: list[int]) -> Iterator[Request]:
        """:meth:`source_requests` for a batch whose jobs hold any indices: every job read in order."""
        want = set(indices)
        job_ids = self.batch_jobs.job_ids(batch.id)
        for job_id in job_ids:
            if not want:
                return
            try:
                payload = JobQueue.payload_of(self.jobs.fetch_job(job_id))
            except ValueError as e:
                raise RetryRejected(f"batch {batch.id!r}: job {job_id} is not a readable lmdq job: {e}") from e
            for r in payload.requests:
                if r.index in want:
                    want.discard(r.index)
                    yield r
        if want:
            raise RetryRejected(f"batch {batch.id!r}: its jobs lack request indices {sorted(want)[:5]}")
