"""``Client.plan`` and ``lmdq-producer plan``: a source's plan, read-only; a batch's deadline moved and its
projected finish (issue 46).

The source is read exactly as submit reads it (the same formats, the same per-line checks, the same
options: ``max_new_tokens`` and the other generation parameters, prefix grouping), then planned by
:func:`lmdq.plan.rules.make_plan` against the model's history (:class:`lmdq.plan.store.PlanStore`) and
its live workers (:class:`lmdq.registry.store.ModelRegistry`). Redis is only read: no key is written, so
planning a batch is free to repeat. A bad line is refused as submit would refuse it (one line naming
file:line, the field, what was expected; exit 2).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmdq.client.options import Spell, resolve
from lmdq.errors import InputProblem, InvalidArgument, SubmitRejected
from lmdq.plan.rules import Plan, make_plan
from lmdq.plan.store import PlanStore
from lmdq.plan.tokens import load_counter
from lmdq.registry.store import ModelRegistry
from lmdq.submission.formats import InputError, ParsedLine, iter_lines

if TYPE_CHECKING:
    import redis

    from lmdq.client.sources import RowSource
    from lmdq.contract import Batch as BatchInfo
    from lmdq.plan.deadlines import Outlook
    from lmdq.redis.keys import Keys
    from lmdq.submission.settings import ProducerSettings

__all__ = ["outlook_of", "plan_source", "set_deadline"]


def _python_name(name: str) -> str:
    return name


def _lines(path: Path, fmt: Any, limits: Any, src: RowSource | None = None) -> Iterator[ParsedLine]:
    """The file's requests; a bad line is SubmitRejected, named in ``src`` (its rows) when ``path`` is its spool."""
    for item in iter_lines(path, fmt=fmt, limits=limits):
        if isinstance(item, InputError):
            if src is None:
                raise SubmitRejected(str(item))
            spool = str(path)
            problem = src.relocate(InputProblem.parse(str(item)), spool)
            raise SubmitRejected(src.reword(str(item), spool), problems=[problem])
        yield item


def plan_source(
    client: redis.Redis, keys: Keys, settings: ProducerSettings, source: Any, *, model: str | None,
    tokenizer: str | os.PathLike[str] | None = None, gpu_hour_price: float | None = None,
    fmt: str | None = None, cmap: Any = None, spell: Spell = _python_name, options: Mapping[str, Any] | None = None,
    on_warning: Callable[[str], None] | None = None,
) -> Plan:
    """The plan of ``source`` for ``model`` (see the module doc)."""
    from lmdq.client.sources import FileSource, classify, spool
    from lmdq.submission.formats import InputFormat
    from lmdq.submission.formats.tabular import ColumnMap

    if not model:
        raise InvalidArgument(f"{spell('model')}: expected the served model name to plan for", field="model")
    if gpu_hour_price is not None and not gpu_hour_price >= 0:
        raise InvalidArgument(f"{spell('gpu_hour_price')}: expected a price of at least 0, got {gpu_hour_price}",
                              field="gpu_hour_price")
    opts, _ttl = resolve(dict(options or {}), settings, model=model, spell=spell,
                         on_note=on_warning, on_warning=on_warning)
    counter = load_counter(model, tokenizer)
    history = PlanStore(client, keys=keys).history(model)
    live = next((m.live_workers for m in ModelRegistry(client, keys=keys).models() if m.name == model), 0)
    kw: dict[str, Any] = {"model": model, "params": opts.params, "counter": counter, "history": history,
                          "live_workers": live, "gpu_hour_price": gpu_hour_price, "prefix_groups": opts.prefix_groups}
    src = classify(source, fmt=fmt, cmap=cmap if cmap is not None else ColumnMap())
    if isinstance(src, FileSource):
        p = make_plan(_lines(src.path, src.fmt, opts.limits), **kw)
        return _with_reuse(p, client, keys, opts, _lines(src.path, src.fmt, opts.limits))
    with tempfile.TemporaryDirectory(prefix="lmdq-plan-") as d:
        path = Path(d) / "rows.jsonl"
        with path.open("wb") as f:
            spool(src, cmap if cmap is not None else ColumnMap(), f, max_requests=opts.limits.max_requests)
        p = make_plan(_lines(path, InputFormat.jsonl, opts.limits, src), **kw)
        return _with_reuse(p, client, keys, opts, _lines(path, InputFormat.jsonl, opts.limits, src))


def _with_reuse(plan: Plan, client: redis.Redis, keys: Keys, opts: Any, lines: Iterator[ParsedLine]) -> Plan:
    """Issue 47: with ``reuse``, how many of the lines the reuse index answers now (read-only lookups)."""
    if opts.reuse_ttl_s is None:
        return plan
    from lmdq.contract import Request
    from lmdq.reuse.index import ReuseIndex
    from lmdq.reuse.store import ReuseStore

    def requests() -> Iterator[Request]:
        for i, ln in enumerate(lines):
            yield Request.model_validate({
                "index": i, "custom_id": "plan", "prompt": ln.prompt, "messages": ln.messages, "endpoint": ln.endpoint,
                "params": ln.params, "continuations": list(ln.continuations) if ln.continuations else None})

    found = ReuseIndex(ReuseStore(client, keys=keys)).known(plan.model, requests(), opts.params)
    if found is None:
        plan.reuse_basis = f"no worker of {plan.model} has published its weights' fingerprint yet: none counted"
        return plan
    plan.reused_requests = found
    plan.reuse_basis = (f"answered from the reuse index, never reaching the engine (the figures above count every "
                        f"request; {plan.requests - found:,} will run)")
    return plan


def set_deadline(client: redis.Redis, keys: Keys, batch: BatchInfo, when: str | float, *,
                 spell: Spell = _python_name) -> None:
    """Move an open batch's deadline (tighten or relax it): its record's field, and its jobs still waiting
    moved to their new place in their queues (earliest deadline first), in one script call."""
    from lmdq.batches.batch_jobs import BatchJobs
    from lmdq.client.options import parse_deadline
    from lmdq.jobs.queue import job_id_prefix
    from lmdq.redis.keys import queue_name, rq_queue_key

    at = parse_deadline(when, spell("deadline"))
    if at is None:
        raise InvalidArgument(f"{spell('deadline')}: expected a time, got None", field="deadline")
    if batch.status.terminal:
        raise InvalidArgument(f"batch {batch.id} has ended ({batch.status.value}): no deadline to move",
                              field="deadline")
    queues = [rq_queue_key(queue_name(m, batch.priority, keys.prefix)) for m in batch.models]
    BatchJobs(client, keys=keys).reschedule(batch.id, queue_keys=queues, deadline=at,
                                            job_prefix=job_id_prefix(batch.id))


def outlook_of(client: redis.Redis, keys: Keys, batch: BatchInfo) -> Outlook | None:
    """An open deadline batch's projected finish against its deadline (None: no deadline, or ended)."""
    from lmdq.plan.deadlines import DeadlineBatch, outlook

    if batch.deadline is None or batch.status.terminal:
        return None
    c = batch.request_counts
    models = ModelRegistry(client, keys=keys)
    live = next((m.live_workers for m in models.models() if m.name == batch.model), 0)
    b = DeadlineBatch(id=batch.id, model=batch.model, deadline=batch.deadline, total=c.total,
                      answered=c.completed + c.failed + c.cancelled + c.expired, started_at=batch.in_progress_at)
    return outlook(b, history=PlanStore(client, keys=keys).history(batch.model), live_workers=live,
                   now=models.now())
