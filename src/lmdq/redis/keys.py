"""Every Redis key lmdq uses is built here, so the layout is visible (and greppable) in one place.

RQ owns ``rq:*`` (queues, job hashes, registries): lmdq's queues are ordinary RQ queues named
``lmdq:<model>:<priority>``, so ``rq info`` and rq-dashboard show them. ``<model>`` is the model name
itself: :data:`MODEL_NAME_RULE` admits only characters that are safe in a key, so the name is its own
key and two names can never share a queue (:func:`model_slug`). lmdq's own state
(batches, results, leases) lives under ``LMDQ_KEY_PREFIX`` (default ``lmdq``).
"""

from __future__ import annotations

import re
from enum import Enum

from rq.executions import WORKER_EXECUTIONS_KEY_TEMPLATE
from rq.worker import Worker as _RqWorker
from rq.worker_registration import REDIS_WORKER_KEYS, WORKERS_BY_QUEUE_KEY

from lmdq.contract import Priority
from lmdq.errors import ExitCode, LmdqError

__all__ = [
    "BATCH_COUNT_FIELDS",
    "BATCH_TIME_FIELDS",
    "BatchField",
    "MAX_MODEL_NAME",
    "MODEL_COUNT_PREFIX",
    "MODEL_NAME_RULE",
    "InvalidModelName",
    "check_model_name",
    "model_count_field",
    "Keys",
    "model_slug",
    "queue_name",
    "queue_names",
    "rq_queue_key",
    "rq_worker_executions_key",
    "rq_worker_key",
    "rq_workers_by_queue_key",
    "rq_workers_key",
]

MAX_MODEL_NAME = 128
"""A model name is at most this long (HF ids are ``org/name``, both halves at most 96 characters)."""

MODEL_NAME_RULE = "1-128 of A-Z a-z 0-9 . _ / -, starting with a letter or digit, case kept"
"""The one rule for model names, as error messages and docs state it (:func:`check_model_name`)."""

_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
_KEY_SAFE = re.compile(r"[A-Za-z0-9._/-]")

PRIORITY_ORDER = (Priority.high, Priority.normal, Priority.low)


class BatchField(str, Enum):
    """The fields of a batch hash (``Keys.batch``): declared once, so the producer, the store's Lua
    scripts and the worker cannot drift apart on a spelling.

    ``meta`` holds the immutable :class:`~lmdq.contract.Batch` JSON; everything that changes after
    submit (status, counters, timestamps) is a field of its own, so it can be bumped atomically
    without rewriting the JSON. ``str(field)`` is the field name, so f-strings (and Lua built
    from them) read naturally.
    """

    meta = "meta"
    status = "status"
    total = "total"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"
    expired = "expired"
    queued_at = "queued_at"
    in_progress_at = "in_progress_at"
    finalizing_at = "finalizing_at"
    completed_at = "completed_at"
    cancelling_at = "cancelling_at"
    cancelled_at = "cancelled_at"
    expired_at = "expired_at"
    expires_at = "expires_at"
    #: what an idempotency key is bound to besides the batch (the file's bytes and the options)
    fingerprint = "fingerprint"
    #: seconds the batch's keys are kept once it has ended (``submit --result-ttl``)
    ttl = "ttl"
    #: the Redis key of the batch's idempotency binding (its TTL follows the batch's)
    idempotency = "idempotency"
    #: progressive staging (BatchLedger.enqueue with first_jobs): jobs / requests visible so far, when the
    #: last job became visible, and why staging was abandoned part-way (then the batch is cancelled)
    visible_jobs = "visible_jobs"
    visible_requests = "visible_requests"
    staged_at = "staged_at"
    staging_failed = "staging_failed"
    #: the requests no job ever held were answered (``cancelled`` or ``failed``/``submit_interrupted``): set
    #: once, by whoever ended the part-staged batch (lmdq.submission.ledger.BatchLedger.answer_unstaged)
    unstaged_answered = "unstaged_answered"
    #: ``--reuse`` (issue 47): requests the reuse index could answer when the batch was submitted
    reusable = "reusable"
    #: generated tokens of the batch's final results so far (progress' tokens/s; absent before the first)
    output_tokens = "output_tokens"
    #: Unix time the batch should be done by (issue 46; absent: none): a live field, so it can be moved
    #: (``Batch.set_deadline``) and the commit script reads it to place the jobs earliest-deadline-first
    deadline = "deadline"

    def __str__(self) -> str:
        return self.value


BATCH_COUNT_FIELDS = (BatchField.completed, BatchField.failed, BatchField.cancelled, BatchField.expired)
"""Per-outcome request counters; a batch is done when they add up to ``total``."""

BATCH_TIME_FIELDS = (
    BatchField.queued_at,
    BatchField.in_progress_at,
    BatchField.finalizing_at,
    BatchField.completed_at,
    BatchField.cancelling_at,
    BatchField.cancelled_at,
    BatchField.expired_at,
    BatchField.expires_at,
)
"""Unix-time fields kept outside ``meta`` (set as the batch moves on)."""




class InvalidModelName(LmdqError, ValueError):
    """A model name outside :data:`MODEL_NAME_RULE`; the message is one line naming it and the rule."""

    exit_code = ExitCode.bad_input


def check_model_name(name: str) -> str:
    """``name`` if it follows :data:`MODEL_NAME_RULE`, else :class:`InvalidModelName` saying why.

    Why so narrow: the name is part of Redis keys (queues, in-flight and wake lists), KEDA trigger
    list names and Prometheus labels. ``:`` is the key separator, ``*?[]`` are SCAN patterns, blanks
    and control characters are typos; non-ASCII names (``通义千问``) are refused rather than escaped so
    the name an operator types is exactly the key KEDA counts. Serve such a model under an ASCII
    ``--served-model-name``."""
    if not isinstance(name, str) or not name:
        raise InvalidModelName(f"model name: expected {MODEL_NAME_RULE}; got an empty one")
    if len(name) > MAX_MODEL_NAME:
        raise InvalidModelName(f"model name {name[:40]!r}...: expected {MODEL_NAME_RULE}; got {len(name)} characters")
    if not _MODEL_NAME.fullmatch(name):
        bad = next((c for c in name if not _KEY_SAFE.fullmatch(c)), name[0])
        raise InvalidModelName(f"model name {name!r}: expected {MODEL_NAME_RULE}; got {bad!r}")
    return name


def model_slug(model: str) -> str:
    """The model's part of its Redis keys: the name itself when it follows :data:`MODEL_NAME_RULE`.

    Total and injective for ANY string, so a name that bypassed the check (a record written by an
    older lmdq) still cannot share a queue with another: every character outside the rule, ``%``
    included, is percent-encoded (UTF-8), and a valid name never holds a ``%``
    ('org/model-x' and 'org_model-x' stay apart; 'a:b' -> 'a%3Ab')."""
    if _MODEL_NAME.fullmatch(model):
        return model
    return "".join(c if _KEY_SAFE.fullmatch(c) else "".join(f"%{b:02X}" for b in c.encode("utf-8", "surrogatepass"))
                   for c in model)


MODEL_COUNT_PREFIX = "by_model:"
"""Batch hash fields ``by_model:<model>:<counter>``: a batch's result counters per model (a model name
has no ``:``), bumped by the results script beside the batch-wide counter."""


def model_count_field(model: str, counter: str) -> str:
    """The batch hash field counting ``counter`` (completed, failed, ...) results of ``model``."""
    return f"{MODEL_COUNT_PREFIX}{model}:{counter}"


def queue_name(model: str, priority: Priority | str = Priority.normal, prefix: str = "lmdq") -> str:
    """RQ queue name for one model and priority."""
    return f"{prefix}:{model_slug(model)}:{Priority(priority).value}"


def queue_names(model: str, prefix: str = "lmdq") -> list[str]:
    """The model's queues in the order workers drain them."""
    return [queue_name(model, p, prefix) for p in PRIORITY_ORDER]


def rq_queue_key(name: str) -> str:
    """The Redis list RQ keeps a queue in (what KEDA's redis scaler counts)."""
    return f"rq:queue:{name}"


# RQ's worker registry, spelled by the installed rq's own constants so a new rq cannot drift from it.
# lmdq workers write these records too (lmdq.registry.store), so `rq info` and rq-dashboard list them.


def rq_worker_key(name: str) -> str:
    """RQ's worker hash (``rq:worker:<name>``: birth, last_heartbeat, queues, state, ...)."""
    return f"{_RqWorker.redis_worker_namespace_prefix}{name}"


def rq_workers_key() -> str:
    """RQ's set of every worker's hash key (``rq:workers``)."""
    return REDIS_WORKER_KEYS


def rq_workers_by_queue_key(queue: str) -> str:
    """RQ's set of the worker hash keys serving one queue (``rq:workers:<queue>``)."""
    return WORKERS_BY_QUEUE_KEY % queue


def rq_worker_executions_key(name: str) -> str:
    """RQ's set of a worker's running executions (what rq shows as its current job)."""
    return WORKER_EXECUTIONS_KEY_TEMPLATE.format(name)


class Keys:
    """lmdq's own keys under one prefix."""

    def __init__(self, prefix: str = "lmdq") -> None:
        self.prefix = prefix

    # batches
    def batch(self, batch_id: str) -> str:
        """Hash: 'meta' (Batch JSON) plus live fields (status, counters, timestamps): :class:`BatchField`."""
        return f"{self.prefix}:batch:{batch_id}"

    def results(self, batch_id: str) -> str:
        """Hash: request index -> final Result JSON (written once, HSETNX)."""
        return f"{self.prefix}:batch:{batch_id}:results"

    def partials(self, batch_id: str) -> str:
        """Hash: request index -> in-progress Result JSON, deleted when the final one lands."""
        return f"{self.prefix}:batch:{batch_id}:partials"

    def shards(self, batch_id: str) -> str:
        """Hash: job number -> :class:`lmdq.results.shards.ShardEntry` JSON, one field per job whose results went to
        its shard in the batch's results URL (the per-request records are deleted from ``results``)."""
        return f"{self.prefix}:batch:{batch_id}:shards"

    def sealed(self, batch_id: str) -> str:
        """Bitmap: bit ``index`` set once that request's final result is in a shard. The results script
        refuses a write for a sealed index, so a re-run after the trim cannot write it twice."""
        return f"{self.prefix}:batch:{batch_id}:sealed"

    def batch_jobs(self, batch_id: str) -> str:
        """List of the batch's RQ job ids in job order."""
        return f"{self.prefix}:batch:{batch_id}:jobs"

    def gates(self, batch_id: str) -> str:
        """Hash: the batch's quality gates (lmdq.gates.store): config, where its held jobs go, the canary's
        jobs left to judge, the verdict and the report of a pause."""
        return f"{self.prefix}:batch:{batch_id}:gates"

    def gates_canary(self, batch_id: str) -> str:
        """Set: the job ids of the batch's canary (the commit queues only these; the rest are held)."""
        return f"{self.prefix}:batch:{batch_id}:gates:canary"

    def gates_held(self, batch_id: str) -> str:
        """List: job ids held off the queue until the canary passes or the batch resumes."""
        return f"{self.prefix}:batch:{batch_id}:gates:held"

    def gates_seen(self, batch_id: str) -> str:
        """List: one JSON entry per judged result (the canary's, then the rolling window's, newest first)."""
        return f"{self.prefix}:batch:{batch_id}:gates:seen"

    def gates_jobs(self, batch_id: str) -> str:
        """Set: the job numbers whose results were judged already (a job judged twice counts once)."""
        return f"{self.prefix}:batch:{batch_id}:gates:jobs"

    def batches(self) -> str:
        """Sorted set of batch ids by creation time (for ``list``)."""
        return f"{self.prefix}:batches"

    def staging_lease(self, batch_id: str) -> str:
        """String with a TTL: the token of the submit staging the batch (progressive staging); it renews it
        while it stages. Gone before the batch is staged: the submit died (docs/reliability.md)."""
        return f"{self.prefix}:batch:{batch_id}:staging"

    def request_ids(self, batch_id: str) -> str:
        """List of JSON arrays of the batch's custom_ids in input order (1,000 a chunk), written before
        any job is visible, while the batch is being staged: what answers requests no job ever held."""
        return f"{self.prefix}:batch:{batch_id}:ids"

    def staging(self) -> str:
        """Set of batch ids being staged progressively (their leases are checked by whoever notices)."""
        return f"{self.prefix}:staging"

    # webhooks (lmdq.webhooks.store): the outbox of batch events and its delivery state. The batch-end Lua
    # builds the first two from a batch key's prefix (``lmdq_webhook_event``), so they keep this spelling.
    def webhook_events(self) -> str:
        """Hash: event id -> the event's JSON (url, tenant, body), from its creation until it is delivered
        or given up on."""
        return f"{self.prefix}:webhooks:events"

    def webhook_due(self) -> str:
        """Sorted set: event id -> when it may be tried next (server ms); a claim moves it a lease ahead."""
        return f"{self.prefix}:webhooks:due"

    def webhook_leases(self) -> str:
        """Hash: event id -> the token of the deliverer holding it (its result counts only with the token)."""
        return f"{self.prefix}:webhooks:leases"

    def webhook_tries(self) -> str:
        """Hash: event id -> delivery attempts so far (counted at claim: a killed deliverer's try counts)."""
        return f"{self.prefix}:webhooks:tries"

    def webhook_dead(self) -> str:
        """Hash: event id -> the event's JSON plus its last error, once its tries ran out (kept for an operator)."""
        return f"{self.prefix}:webhooks:dead"

    def webhook_secrets(self) -> str:
        """Hash: tenant -> its signing secret (``whsec_...``). Never logged."""
        return f"{self.prefix}:webhooks:secrets"

    # reuse (lmdq.reuse.store): the content-addressed index of completed results (issue 47)
    def reuse_workers(self) -> str:
        """Hash: served model name -> the worker key (hex) its newest worker published (``status`` counts)."""
        return f"{self.prefix}:reuse:fp"

    def reuse_models(self) -> str:
        """Set of the model names that have a reuse index (``reuse stats`` lists them)."""
        return f"{self.prefix}:reuse:models"

    def reuse_bucket(self, model: str, kind: str, bucket: int) -> str:
        """Hash: identity tail (binary) -> a compact location (``kind`` ``p``) or copy (``c``) of a result;
        one of the model's hash buckets (:data:`lmdq.reuse.store.BUCKETS`)."""
        return f"{self.prefix}:reuse:{model_slug(model)}:{kind}:{bucket:04x}"

    def reuse_sources(self, model: str) -> str:
        """Hash: the batches the model's index entries point into: batch id -> number, ``#n`` -> where it is."""
        return f"{self.prefix}:reuse:{model_slug(model)}:src"

    def reuse_stats(self, model: str) -> str:
        """Hash: the model's index counters (entries, lookups, hits)."""
        return f"{self.prefix}:reuse:{model_slug(model)}:stats"

    def idempotency(self, key: str) -> str:
        """String: the batch id an idempotency key is bound to (with the results' TTL)."""
        return f"{self.prefix}:idem:{key}"

    def cancelled(self) -> str:
        """Set of batch ids being cancelled; workers poll it to abort in-flight requests."""
        return f"{self.prefix}:cancelled"

    # workers and leases
    def leases(self) -> str:
        """Sorted set job_id -> lease expiry (unix s); expired leases are re-queued by any worker."""
        return f"{self.prefix}:leases"

    def lease_clock(self) -> str:
        """Hash raw/offset: the last Redis TIME the lease scripts read and the offset that keeps lease time
        monotonic across a server clock stepping back. The scripts derive the same name from their first
        key (``<leases>:clock``); this is its one spelling on the Python side."""
        return f"{self.leases()}:clock"

    def sink_pending(self) -> tuple[str, str]:
        """The sink retry schedule: a zset member -> due time and a hash member -> its data (fleet-wide,
        one pair per key prefix)."""
        return f"{self.prefix}:sink:pending", f"{self.prefix}:sink:pending-data"

    def lease_owner(self) -> str:
        """Hash job_id -> worker name holding the lease."""
        return f"{self.prefix}:lease-owner"

    def attempts(self) -> str:
        """Hash job_id -> CHARGED attempts: runs the engine failed (what ``max_attempts`` limits)."""
        return f"{self.prefix}:attempts"

    def runs(self) -> str:
        """Hash job_id -> times a worker has claimed the job, whatever ended the run (observability,
        and a safety cap so a job that can never finish still ends)."""
        return f"{self.prefix}:runs"

    def crashes(self) -> str:
        """Hash job_id -> engine deaths while the job ran; ``<job_id>:killer`` -> the request index
        that was alone in the engine when it died (poison-prompt isolation)."""
        return f"{self.prefix}:crashes"

    def inflight(self, model: str) -> str:
        """List of job ids claimed by workers of ``model``: KEDA adds it to queue depth so a busy
        worker is not scaled away."""
        return f"{self.prefix}:inflight:{model_slug(model)}"

    def wake(self, model: str) -> str:
        """List: at most one wake-up token, meaning "the model's queues may have work". Pushed when
        jobs become visible (commit, re-queue, reap); an idle worker BLPOPs it instead of polling
        (:mod:`lmdq.jobs.wakeup`)."""
        return f"{self.prefix}:wake:{model_slug(model)}"

    def idle(self, model: str) -> str:
        """Sorted set worker name -> until when (Redis TIME) it counts as idle: the model's workers with
        nothing to do, so a worker claiming a small batch takes only its fair share
        (:mod:`lmdq.jobs.idle_roster`)."""
        return f"{self.prefix}:idle:{model_slug(model)}"

    def plan_lengths(self, model: str) -> str:
        """Hash output length (``"L"``, or ``"L+"`` for one cut at its max_new_tokens) -> requests of
        ``model`` that generated it: the length history a plan's expected output rests on
        (:mod:`lmdq.plan.store`)."""
        return f"{self.prefix}:plan:lengths:{model_slug(model)}"

    def plan_rates(self, model: str) -> str:
        """Hash worker name -> JSON of its measured busy seconds and prefill/decode tokens (totals and
        recent windows): the throughput a plan's GPU-seconds rest on (:mod:`lmdq.plan.store`)."""
        return f"{self.prefix}:plan:rates:{model_slug(model)}"

    def worker(self, name: str) -> str:
        """Worker heartbeat hash with a TTL."""
        return f"{self.prefix}:worker:{name}"

    def workers(self) -> str:
        return f"{self.prefix}:workers"

    def models(self) -> str:
        """Hash served model name -> last-seen timestamp: models a worker has ever served."""
        return f"{self.prefix}:models"

    def registered_models(self) -> str:
        """Hash model name -> JSON ``{"added_at", "note"}``: models an operator registered
        (``lmdq-producer models add``), so ``submit`` accepts them before any worker has started."""
        return f"{self.prefix}:models:registered"

    # the HTTP API (lmdq.api): its own records, beside the lmdq batches they stand for
    def api_file(self, file_id: str) -> str:
        """Hash: one uploaded or output file's record (owner tenant, name, size, purpose, expiry; key TTL)."""
        return f"{self.prefix}:api:file:{file_id}"

    def api_files(self, tenant: str) -> str:
        """Sorted set: the tenant's file ids by creation time (its file list; :mod:`lmdq.api.paging`)."""
        return f"{self.prefix}:api:tenant:{tenant}:files"

    def api_batch(self, batch_id: str) -> str:
        """Hash: one API batch (owner tenant, input file, state, the lmdq batch behind it; key TTL)."""
        return f"{self.prefix}:api:batch:{batch_id}"

    def api_batches(self, tenant: str) -> str:
        """Sorted set: the tenant's API batch ids by creation time (its batch list)."""
        return f"{self.prefix}:api:tenant:{tenant}:batches"

    def api_open(self) -> str:
        """Set of API batch ids not yet final (validating, or submitted with output files not written):
        what every replica's sweep looks at."""
        return f"{self.prefix}:api:open"

    def api_lease(self, batch_id: str) -> str:
        """String with a TTL: the token of the one replica submitting or finalizing the API batch now."""
        return f"{self.prefix}:api:lease:{batch_id}"
