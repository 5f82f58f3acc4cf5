"""Reading the queue's state for the exporter: models, queue depths, jobs running, live workers, batch
statuses, in bounded SCAN walks and two pipelined round trips.

The metrics' store: the reads :mod:`lmdq.metrics.exporter` (which keeps the collector thread, the series
and the HTTP server) serves; a concept's Redis commands live in its store modules
(tests/test_redis_boundary.py). Redis
content is untrusted: names are decoded with replacement, counts that are not integers count 0, and
the number of models, workers and batches read is capped.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from lmdq.contract import BatchStatus
from lmdq.plan.deadlines import DeadlineBatch, Outlook, outlook, workers_needed
from lmdq.plan.store import PlanStore
from lmdq.redis.keys import BATCH_COUNT_FIELDS, PRIORITY_ORDER, BatchField, Keys, model_slug, queue_name, rq_queue_key
from lmdq.redis.replies import reply_text

__all__ = ["MAX_MODELS", "MAX_WORKERS", "SCAN_CALLS", "SCAN_COUNT", "ModelStats", "ReadTimedOut", "Snapshot",
           "read_snapshot"]


MAX_MODELS = 1000
"""Models read per scrape at most (a Redis filled with junk names must not blow up a scrape)."""

MAX_WORKERS = 10_000

_RQ_QUEUES = "rq:queues"

_STATUSES = tuple(s.value for s in BatchStatus)

@dataclass(frozen=True)
class ModelStats:
    model: str
    #: priority -> jobs waiting
    depth: dict[str, int]
    running: int
    workers: int

@dataclass(frozen=True)
class Snapshot:
    models: list[ModelStats]
    batches: dict[str, int] = field(default_factory=dict)
    #: the read stopped at its SCAN budget or the model cap: some models may be missing
    truncated: bool = False
    #: model -> workers needed to meet every open deadline (issue 46; models with no deadline batch: absent)
    workers_needed: dict[str, int] = field(default_factory=dict)
    #: each open deadline batch's projected finish
    outlooks: list[Outlook] = field(default_factory=list)

def _int(raw: Any) -> int:
    try:
        n = int(raw)
    except (TypeError, ValueError):
        return 0
    return max(0, n)

def _slugs_of_queues(members: Any, prefix: str) -> set[str]:
    """Model slugs of RQ queues named ``<prefix>:<slug>:<priority>`` (RQ's queue set holds
    ``rq:queue:<name>``): a batch submitted for a model no worker has served yet still counts."""
    head = rq_queue_key(f"{prefix}:")
    prios = {p.value for p in PRIORITY_ORDER}
    out: set[str] = set()
    for m in members:
        name = reply_text(m)
        if not name.startswith(head):
            continue
        slug, _, prio = name[len(head):].rpartition(":")
        if slug and prio in prios and ":" not in slug:
            out.add(slug)
    return out

SCAN_COUNT = 500
"""Elements asked of Redis per HSCAN/SSCAN call: each call is short, so the exporter never holds Redis
for long, however many (junk) names it holds."""

SCAN_CALLS = 20
"""SCAN calls per key and collection at most (the SCAN budget): a set too large to walk in that many
calls is read partially (``lmdq_exporter_truncated`` says so), never at the cost of Redis' time."""

class ReadTimedOut(redis.TimeoutError):
    """One collection's Redis time ran past its budget (``LMDQ_EXPORTER_READ_TIMEOUT_S``)."""

def _scan(client: redis.Redis, kind: str, key: str, budget: Callable[[], None]) -> tuple[list[Any], bool]:
    """Members of a hash (``kind='hscan'``: its fields) or set (``'sscan'``) in at most
    :data:`SCAN_CALLS` short calls; returns them and whether the walk was cut short."""
    out: list[Any] = []
    cursor: int = 0
    for _ in range(SCAN_CALLS):
        if kind == "hscan":
            cursor, fields = client.hscan(key, cursor, count=SCAN_COUNT)  # no NOVALUES: Redis < 7.4
            out.extend(fields)
        else:
            cursor, got = client.sscan(key, cursor, count=SCAN_COUNT)
            out.extend(got)
        budget()
        if int(cursor) == 0:
            return out, False
    return out, True

def read_snapshot(client: redis.Redis, keys: Keys, *, max_batches: int = 1000,
                  timeout_s: float | None = None) -> Snapshot:
    """Everything the exporter serves: SCAN walks within :data:`SCAN_CALLS` calls, then two pipelined
    round trips whatever the number of models. With ``timeout_s``, a read whose Redis time passes it
    raises :class:`ReadTimedOut` between two calls (each call is bounded by the client's socket
    timeout)."""
    started = time.monotonic()

    def budget() -> None:
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            raise ReadTimedOut(f"reading Redis took longer than {timeout_s:g} s")

    served, cut_models = _scan(client, "hscan", keys.models(), budget)
    queues, cut_queues = _scan(client, "sscan", _RQ_QUEUES, budget)
    with client.pipeline(transaction=False) as p:
        p.srandmember(keys.workers(), MAX_WORKERS)
        if max_batches > 0:
            p.zrevrange(keys.batches(), 0, max_batches - 1)
        workers, *newest = p.execute()
    budget()
    names: dict[str, str] = {}  # slug -> served name (the label workers use)
    for raw in sorted(set(served))[:MAX_MODELS]:
        name = reply_text(raw)
        names.setdefault(model_slug(name), name)
    for slug in sorted(_slugs_of_queues(queues, keys.prefix)):
        if len(names) >= MAX_MODELS:
            break
        names.setdefault(slug, slug)
    slugs = sorted(names)
    worker_names = [reply_text(w) for w in workers]
    batch_ids = [reply_text(b) for b in newest[0]] if newest else []
    with client.pipeline(transaction=False) as p:
        for slug in slugs:
            for prio in PRIORITY_ORDER:
                p.llen(rq_queue_key(queue_name(slug, prio, keys.prefix)))
            p.llen(keys.inflight(slug))
        for w in worker_names:
            p.hget(keys.worker(w), "model")
        for b in batch_ids:
            p.hmget(keys.batch(b), [BatchField.status.value, BatchField.deadline.value])
        out = p.execute()
    budget()
    n_prio = len(PRIORITY_ORDER)
    per_model = n_prio + 1
    live: Counter[str] = Counter()
    for raw in out[len(slugs) * per_model: len(slugs) * per_model + len(worker_names)]:
        if raw is not None:
            live[model_slug(reply_text(raw))] += 1
    statuses: Counter[str] = Counter()
    with_deadline: list[str] = []
    for b, (raw, deadline) in zip(batch_ids, out[len(slugs) * per_model + len(worker_names):]):
        if raw is not None and reply_text(raw) in _STATUSES:
            statuses[reply_text(raw)] += 1
            if deadline is not None and not BatchStatus(reply_text(raw)).terminal:
                with_deadline.append(b)
    models = []
    for i, slug in enumerate(slugs):
        row = out[i * per_model: (i + 1) * per_model]
        models.append(ModelStats(
            model=names[slug],
            depth={prio.value: _int(row[j]) for j, prio in enumerate(PRIORITY_ORDER)},
            running=_int(row[n_prio]),
            workers=live[slug],
        ))
    needed, outlooks = _deadlines(client, keys, with_deadline, {m.model: m.workers for m in models}, budget)
    return Snapshot(models=models, batches={s: statuses[s] for s in _STATUSES},
                    truncated=cut_models or cut_queues or len(served) > MAX_MODELS,
                    workers_needed=needed, outlooks=outlooks)


_DEADLINE_FIELDS = [BatchField.meta, BatchField.deadline, BatchField.total, *BATCH_COUNT_FIELDS,
                    BatchField.in_progress_at]


def _deadlines(client: redis.Redis, keys: Keys, batch_ids: list[str], live: dict[str, int],
               budget: Callable[[], None]) -> tuple[dict[str, int], list[Outlook]]:
    """Per model, the workers its open deadline batches need, and each one's outlook (issue 46): one more
    round trip for the batches' records and the models' histories, only when a batch has a deadline."""
    if not batch_ids:
        return {}, []
    with client.pipeline(transaction=False) as p:
        p.time()
        for b in batch_ids:
            p.hmget(keys.batch(b), [f.value for f in _DEADLINE_FIELDS])
        (sec, usec), *rows = p.execute()
    budget()
    now = float(sec) + float(usec) / 1e6
    per_model: dict[str, list[DeadlineBatch]] = {}
    for b, row in zip(batch_ids, rows):
        try:
            model = json.loads(reply_text(row[0]))["model"]
            deadline = float(row[1])
            answered = sum(_int(v) for v in row[3:3 + len(BATCH_COUNT_FIELDS)])
            started = row[-1]
            batch = DeadlineBatch(id=b, model=str(model), deadline=deadline, total=_int(row[2]),
                                  answered=answered, started_at=float(started) if started is not None else None)
        except (ValueError, TypeError, KeyError):
            continue
        per_model.setdefault(batch.model, []).append(batch)
    plans = PlanStore(client, keys=keys)
    needed: dict[str, int] = {}
    outlooks: list[Outlook] = []
    for model, batches in sorted(per_model.items()):
        history = plans.history(model)
        needed[model] = workers_needed(batches, history=history, live_workers=live.get(model, 0), now=now)
        outlooks.extend(outlook(b, history=history, live_workers=live.get(model, 0), now=now) for b in batches)
    budget()
    return needed, outlooks
