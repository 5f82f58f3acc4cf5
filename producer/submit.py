"""Submit a prompt file as one batch: validate the WHOLE file, then stage and commit its jobs.

Two streaming passes keep memory flat however large the file is: pass 1 validates every line
and keeps only an 8-byte hash per custom_id (duplicates are confirmed by a targeted re-scan);
pass 2 re-reads the file, stages job hashes in pipelined chunks, and one Lua script makes all
of them visible on the queue at once. A failure before that commit deletes what was staged, so
a batch is either fully enqueued or not at all.
"""

from __future__ import annotations

import hashlib
import heapq
import time
import uuid
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from lmdq.producer.formats import InputError, InputFormat, InputLimits, ParsedLine, detect_format, iter_lines
from pydantic import ValidationError

from lmdq.contract import Batch, BatchStatus, GenerationParams, Priority, RequestCounts
from lmdq.errors import SubmitRejected, UnknownModel
from lmdq.jobs import JobQueue
from lmdq.keys import Keys, queue_name
from lmdq.store import ResultStore

__all__ = [
    "SubmitOptions",
    "claim_idempotency_key",
    "enqueue_batch",
    "job_payloads",
    "known_models",
    "new_batch_id",
    "submit_file",
]

Progress = Callable[[int], None]


@dataclass
class SubmitOptions:
    model: str | None
    batch_size: int = 32
    params: GenerationParams = field(default_factory=GenerationParams)
    priority: Priority = Priority.normal
    metadata: dict[str, str] = field(default_factory=dict)
    idempotency_key: str | None = None
    completion_window_s: float | None = None
    allow_unknown_model: bool = False
    known_models: tuple[str, ...] = ()
    limits: InputLimits = field(default_factory=InputLimits)
    max_errors: int = 20
    fmt: InputFormat | None = None
    results_url: str | None = None
    blob_url: str | None = None


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex[:24]}"


def _h64(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")


def known_models(client: redis.Redis, keys: Keys, extra: tuple[str, ...] = ()) -> set[str]:
    """Model names some worker has served (workers register at start) plus configured ones."""
    return {m.decode() for m in client.hkeys(keys.models())} | set(extra)


def _validate(path: Path, opts: SubmitOptions, progress: Progress | None) -> tuple[int, str]:
    """Pass 1: returns (request count, model) or raises SubmitRejected listing file:line errors."""
    errors: list[str] = []
    hashes = array("Q")
    n = 0
    model = opts.model
    model_line = 0
    for item in iter_lines(path, fmt=opts.fmt, limits=opts.limits):
        if isinstance(item, InputError):
            errors.append(str(item))
            if len(errors) >= opts.max_errors:
                errors.append(f"{path}: stopping after {opts.max_errors} errors")
                break
            continue
        if progress:
            progress(item.line_no)
        if item.model is not None:
            if model is None:
                model, model_line = item.model, item.line_no
            elif item.model != model:
                where = f"--model {opts.model!r}" if opts.model else f"line {model_line}"
                errors.append(
                    f"{path}:{item.line_no}: field 'body.model': expected {model!r} (from {where}), "
                    f"got {item.model!r}"
                )
                continue
        hashes.append(_h64(item.custom_id))
        n += 1
    if not errors:
        errors.extend(_duplicates(path, opts, hashes))
    if model is None and not errors:
        errors.append(f"{path}:0: no model given: pass --model NAME")
    if errors:
        raise SubmitRejected("\n".join(errors))
    assert model is not None
    return n, model


def _duplicate_hashes(hashes: array, run: int = 1 << 16) -> set[int]:
    """Hashes seen more than once, in flat memory: sort the array in runs in place, then merge.

    ``sorted(hashes)`` would build a Python int per line (~40 MB per million lines); sorting
    64k-element runs and merging them through zero-copy memoryviews keeps the extra memory to
    one run, however long the file.
    """
    for s in range(0, len(hashes), run):
        hashes[s : s + run] = array("Q", sorted(hashes[s : s + run]))
    view = memoryview(hashes)
    dup: set[int] = set()
    prev = None
    for h in heapq.merge(*(iter(view[s : s + run]) for s in range(0, len(hashes), run))):
        if h == prev:
            dup.add(h)
        prev = h
    return dup


def _duplicates(path: Path, opts: SubmitOptions, hashes: array) -> list[str]:
    """Find duplicate custom_ids from their hashes; re-scan only to name the lines."""
    dup = _duplicate_hashes(hashes)
    if not dup:
        return []
    first: dict[str, int] = {}
    out: list[str] = []
    for item in iter_lines(path, fmt=opts.fmt, limits=opts.limits):
        if isinstance(item, ParsedLine) and _h64(item.custom_id) in dup:
            if item.custom_id in first:
                out.append(
                    f"{path}:{item.line_no}: field 'custom_id': expected a unique id, "
                    f"{item.custom_id!r} already used on line {first[item.custom_id]}"
                )
                if len(out) >= opts.max_errors:
                    break
            else:
                first[item.custom_id] = item.line_no
    return out


def _request_dict(index: int, item: ParsedLine) -> dict[str, Any]:
    d: dict[str, Any] = {"index": index, "custom_id": item.custom_id, "endpoint": item.endpoint.value}
    if item.messages is not None:
        d["messages"] = item.messages
    else:
        d["prompt"] = item.prompt
    if item.params is not None:
        p = item.params.model_dump(exclude_none=True)
        if p:
            d["params"] = p
    return d


def _file_requests(path: Path, opts: SubmitOptions) -> Iterator[dict[str, Any]]:
    """Pass 2: the file's request dicts, in input order."""
    for index, item in enumerate(iter_lines(path, fmt=opts.fmt, limits=opts.limits)):
        if isinstance(item, InputError):  # the file changed since pass 1
            raise SubmitRejected(f"{item} (the file changed during submit)")
        yield _request_dict(index, item)


def job_payloads(
    requests: Iterable[dict[str, Any]],
    *,
    batch_id: str,
    model: str,
    params: GenerationParams,
    batch_size: int,
    results_url: str | None = None,
    blob_url: str | None = None,
) -> Iterator[dict[str, Any]]:
    """Job payload dicts of ``batch_size`` requests each, in request order."""
    p = params.model_dump(exclude_none=True)
    urls = {k: v for k, v in (("results_url", results_url), ("blob_url", blob_url)) if v}
    def job(job_no: int, reqs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"format_version": 1, "batch_id": batch_id, "model": model, "job_no": job_no, "params": p,
                "requests": reqs, **urls}

    reqs: list[dict[str, Any]] = []
    job_no = 0
    for req in requests:
        reqs.append(req)
        if len(reqs) == batch_size:
            yield job(job_no, reqs)
            job_no += 1
            reqs = []
    if reqs:
        yield job(job_no, reqs)


def claim_idempotency_key(client: redis.Redis, keys: Keys, key: str, batch_id: str, ttl_s: int) -> str | None:
    """Bind ``key`` to ``batch_id`` unless it is bound already; returns the existing batch id then.

    SET NX first, so two concurrent submits with one key cannot both enqueue.
    """
    if client.set(keys.idempotency(key), batch_id, nx=True, ex=ttl_s):
        return None
    existing = client.get(keys.idempotency(key))
    assert existing is not None
    return existing.decode()


def enqueue_batch(
    batch: Batch,
    requests: Iterable[dict[str, Any]],
    *,
    client: redis.Redis,
    keys: Keys,
    ttl_s: int,
    enqueue_progress: Progress | None = None,
    chunk_jobs: int = 256,
) -> Batch:
    """Create ``batch`` (status validating), stage its jobs, and make them all visible at once.

    On any failure before the commit, everything staged is deleted (idempotency key included),
    so a batch is either fully enqueued or not at all.
    """
    store = ResultStore(client, keys=keys, ttl_s=ttl_s)
    jq = JobQueue(client, keys=keys, job_ttl_s=ttl_s)
    queue = queue_name(batch.model, batch.priority, keys.prefix)
    store.create_batch(batch)
    try:
        pipe = client.pipeline(transaction=False)
        staged = 0
        for payload in job_payloads(
            requests,
            batch_id=batch.id,
            model=batch.model,
            params=batch.params,
            batch_size=batch.batch_size,
            results_url=batch.results_url,
            blob_url=batch.blob_url,
        ):
            jq.stage(payload, queue=queue, job_no=payload["job_no"], pipe=pipe)
            staged += 1
            if staged % chunk_jobs == 0:
                pipe.execute()
                if enqueue_progress:
                    enqueue_progress(staged)
        pipe.execute()
        if enqueue_progress:
            enqueue_progress(staged)
        # The moment jobs become visible: what "enqueued" means for timings and benchmarks.
        client.hset(keys.batch(batch.id), "queued_at", time.time())
        jq.commit(batch.id, queue)
    except BaseException:
        jq.discard_staged(batch.id)
        client.delete(keys.batch(batch.id))
        client.zrem(keys.batches(), batch.id)
        if batch.idempotency_key:
            client.delete(keys.idempotency(batch.idempotency_key))
        raise
    store.transition(batch.id, [BatchStatus.validating], BatchStatus.queued)
    return store.get_batch(batch.id)


def submit_file(
    path: Path,
    opts: SubmitOptions,
    *,
    client: redis.Redis,
    keys: Keys,
    ttl_s: int,
    validate_progress: Progress | None = None,
    enqueue_progress: Progress | None = None,
    chunk_jobs: int = 256,
) -> tuple[Batch, bool]:
    """Validate and enqueue ``path``. Returns (batch, created); created is False when an
    idempotency key matched an existing batch."""
    if not path.is_file():
        raise SubmitRejected(f"{path}:0: no such file")
    if opts.batch_size < 1:
        raise SubmitRejected(f"--batch-size: expected >= 1, got {opts.batch_size}")
    store = ResultStore(client, keys=keys, ttl_s=ttl_s)
    if opts.idempotency_key:
        existing = client.get(keys.idempotency(opts.idempotency_key))
        if existing:
            return store.get_batch(existing.decode()), False

    fmt = opts.fmt or detect_format(path)
    opts.fmt = fmt
    total, model = _validate(path, opts, validate_progress)
    if total > opts.limits.max_requests:
        raise SubmitRejected(f"{path}: {total} requests, limit is {opts.limits.max_requests}")
    if not opts.allow_unknown_model:
        known = known_models(client, keys, opts.known_models)
        if model not in known:
            raise UnknownModel(
                f"{path}:0: field 'model': unknown model {model!r}; known: "
                f"{', '.join(sorted(known)) or '(none: no worker has started yet)'}. "
                "Start a worker for it, or pass --allow-unknown-model to queue anyway."
            )

    batch_id = new_batch_id()
    now = time.time()
    num_jobs = (total + opts.batch_size - 1) // opts.batch_size
    try:
        batch = Batch(
            id=batch_id,
            model=model,
            status=BatchStatus.validating,
            input_file=str(path),
            priority=opts.priority,
            batch_size=opts.batch_size,
            num_jobs=num_jobs,
            params=opts.params,
            request_counts=RequestCounts(total=total),
            metadata=opts.metadata,
            idempotency_key=opts.idempotency_key,
            completion_window_s=opts.completion_window_s,
            results_url=opts.results_url,
            blob_url=opts.blob_url,
            created_at=now,
            expires_at=(now + opts.completion_window_s) if opts.completion_window_s else None,
        )
    except ValidationError as e:  # e.g. --metadata over its limits: checked before anything is written
        first = e.errors()[0]
        field_ = ".".join(str(x) for x in first["loc"]) or "batch"
        raise SubmitRejected(f"--{field_}: {first['msg'].removeprefix('Value error, ')}") from e
    if opts.idempotency_key:
        existing_id = claim_idempotency_key(client, keys, opts.idempotency_key, batch_id, ttl_s)
        if existing_id is not None:
            return store.get_batch(existing_id), False
    batch = enqueue_batch(
        batch,
        _file_requests(path, opts),
        client=client,
        keys=keys,
        ttl_s=ttl_s,
        enqueue_progress=enqueue_progress,
        chunk_jobs=chunk_jobs,
    )
    return batch, True
