"""``lmdq.Client`` and ``lmdq.Batch``: lmdq as a Python library (the CLIs are thin clients of it).

::

    import lmdq

    client = lmdq.Client()                        # LMDQ_* settings, as the CLIs read them
    batch = client.submit(df, model="llama-8b", prompt_column="question", id_column="qid",
                          max_new_tokens=256, temperature=0.7)
    for r in batch.as_completed():                # each result as it is stored
        print(r.custom_id, r.text)
    batch.to_parquet("answers.parquet")           # one documented schema (lmdq.results.export)

``submit``'s options are the CLI's flags, declared once in :mod:`lmdq.client.options`; its sources
(paths, iterables, Arrow objects) are described in :mod:`lmdq.client.sources`. Every error is an
:class:`lmdq.errors.LmdqError`; the CLIs turn one into its documented exit code.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from lmdq.client.options import Spell, from_gen_config, resolve
from lmdq.contract import Batch as BatchInfo
from lmdq.contract import BatchStatus, Endpoint, Priority, RequestCounts, Result
from lmdq.errors import BadSetting, InvalidArgument, LmdqError, SubmitRejected, WaitTimeout
from lmdq.registry.store import MAX_NOTE
from lmdq.submission.formats.tabular import ColumnMap
from lmdq.submission.settings import ProducerSettings

if TYPE_CHECKING:
    from typing import TextIO

    import pandas as pd
    import pyarrow as pa
    import redis
    from typing_extensions import Unpack

    from lmdq.client.sources import RowSource
    from lmdq.client.stream import StreamChunk
    from lmdq.client.submit_kwargs import SubmitKwargs
    from lmdq.plan.deadlines import Outlook
    from lmdq.plan.rules import Plan
    from lmdq.redis.keys import Keys
    from lmdq.registry.store import ModelInfo, RemovedModel
    from lmdq.results.store import ResultStore
    from lmdq.reuse.index import ReuseStats
    from lmdq.submission.ledger import BatchLedger, Purged
    from lmdq.submission.progress import BatchProgress

__all__ = ["MAX_NOTE", "Batch", "BatchInfo", "Client", "Source"]

T = TypeVar("T")
Progress = Callable[[int], None]


class _ArrowStream(Protocol):
    """pyarrow Table / RecordBatchReader, pandas (>= 2.2) / polars DataFrame, DuckDB relation ..."""

    def __arrow_c_stream__(self, requested_schema: object | None = None) -> object: ...


class _ArrowArray(Protocol):
    """A pyarrow RecordBatch."""

    def __arrow_c_array__(self, requested_schema: object | None = None) -> tuple[object, object]: ...


Source = (str | os.PathLike[str] | _ArrowStream | _ArrowArray | Iterable[str] | Iterable[Mapping[str, Any]])
"""What :meth:`Client.submit` reads (:mod:`lmdq.client.sources`): a path, an Arrow-speaking object, or an
iterable of prompts (str) or rows (dicts; a Hugging Face Dataset is one)."""


def _python_name(name: str) -> str:
    return name


def load_settings() -> ProducerSettings:
    """The ``LMDQ_*`` settings; a bad one is one line naming the variable (not its value: it may be
    a URL with a password): BadSetting, exit 2."""
    from pydantic import ValidationError

    try:
        return ProducerSettings()
    except ValidationError as e:
        problems = "; ".join(
            f"{_env_name(err['loc'])}: {err['msg']}" for err in e.errors(include_input=False, include_url=False)
        )
        raise BadSetting(f"invalid setting {problems}") from None


def _env_name(loc: tuple[int | str, ...]) -> str:
    name = str(loc[0]) if loc else "?"
    return name if name.upper().startswith("LMDQ_") else f"LMDQ_{name.upper()}"


class Client:
    """A connection to one lmdq deployment (its Redis and key prefix).

    ``redis_url`` None: ``LMDQ_REDIS_URL``, then ``REDIS_URL``, then localhost, as the CLIs do.
    The connection is made at the first call that needs it (with lmdq's timeouts and start-up wait);
    one Client is safe to share between threads."""

    def __init__(self, redis_url: str | None = None, *, settings: ProducerSettings | None = None,
                 on_slow: Callable[[str], None] | None = None) -> None:
        self.settings = settings if settings is not None else load_settings()
        if redis_url:
            self.settings.redis_url = redis_url
        self._on_slow = on_slow
        self._redis: redis.Redis | None = None

    # ---- plumbing ---------------------------------------------------------------------------
    @property
    def redis(self) -> redis.Redis:
        """The redis-py client (made on first use)."""
        if self._redis is None:
            from lmdq.redis.connection import connect

            self._redis = connect(self.settings.redis_url, settings=self.settings, on_slow=self._on_slow)
        return self._redis

    @property
    def keys(self) -> Keys:
        from lmdq.redis.keys import Keys

        return Keys(self.settings.key_prefix)

    def _store(self) -> ResultStore:
        from lmdq.results.store import ResultStore

        return ResultStore(self.redis, keys=self.keys, ttl_s=self.settings.result_ttl_s)

    def _ledger(self) -> BatchLedger:
        from lmdq.submission.ledger import BatchLedger

        return BatchLedger(self.redis, keys=self.keys, ttl_s=self.settings.result_ttl_s,
                           max_job_bytes=self.settings.max_job_bytes, staging_lease_s=self.settings.staging_lease_s)

    # ---- batches ------------------------------------------------------------------------------
    def submit(
        self,
        source: Source,
        *,
        model: str | None = None,
        format: str | None = None,  # noqa: A002 - the word users know (pandas, pyarrow)
        prompt_column: str | None = None,
        messages_column: str | None = None,
        id_column: str | None = None,
        params_columns: Sequence[str] | Mapping[str, str] | None = None,
        template: str | None = None,
        endpoint: Endpoint | Literal["chat", "completion", "score", "reward", "embedding"] | None = None,
        model_column: str | None = None,
        image_column: str | None = None,
        image_dir: str | os.PathLike[str] | None = None,
        on_warning: Callable[[str], None] | None = None,
        validate_progress: Progress | None = None,
        enqueue_progress: Progress | None = None,
        spell: Spell = _python_name,
        input_name: str | None = None,
        gen_config: Mapping[str, Any] | object | None = None,
        **options: Unpack[SubmitKwargs],
    ) -> Batch:
        """Validate ``source`` completely, then enqueue it as one batch (all or nothing).

        ``source``: a path (txt / JSONL / OpenAI Batch JSONL / Parquet / CSV), an iterable of str or
        dict rows, or an Arrow-speaking object (pyarrow Table / RecordBatchReader, pandas / polars
        DataFrame, HF Dataset). ``model``: the served model name (when omitted: each line's ``model`` /
        ``body.model``, or each row's ``model_column``; lines naming several models make one batch over
        them, each request on its own model's queue). The column options map tabular rows to requests
        (:mod:`lmdq.submission.formats.tabular`). ``options``: exactly
        ``lmdq-producer submit``'s flags, by their Python names
        (``max_new_tokens=``, ``temperature=``, ``batch_size=``, ``priority=``, ``metadata=``,
        ``idempotency_key=``, ``results_url=``, ``result_ttl=``, ``completion_window=``, ...).

        Each option is a typed keyword (:class:`lmdq.client.submit_kwargs.SubmitKwargs`): a misspelt one
        or a value of the wrong type is a type checker's error in the caller's code, and a TypeError or
        SubmitRejected at run time.

        ``gen_config``: LMDeploy's ``GenerationConfig`` (or a dict of its fields), mapped to the options
        above; fields left at LMDeploy's defaults are not passed (lmdq's defaults apply), a field lmdq
        does not support is an InvalidArgument naming it.

        ``image_column``: the column holding each row's image (a path or URL, or the image's bytes); ``image_dir``:
        the folder relative image paths resolve against, in a file's ``image_url`` parts and an image column
        alike (issue 48: references are checked at submit, jobs carry them, workers read the bytes).

        ``input_name``: what the batch record calls a file ``source`` (``-`` when it is a copy of stdin).

        Raises SubmitRejected (bad input: the first bad rows named by row and column, as text and as
        ``err.problems`` / ``err.row``, ``err.column``, ``err.field``, ``err.value``; nothing was
        enqueued), UnknownModel, RedisRefused, RedisUnavailable."""
        from lmdq.client.sources import FileSource, classify, spool
        from lmdq.submission import submit as submit_mod
        from lmdq.submission.formats import InputFormat

        notes = on_warning if on_warning is not None else _warn
        given: dict[str, Any] = dict(options)
        if gen_config is not None:
            given = from_gen_config(gen_config, given)
        opts, ttl_s = resolve(given, self.settings, model=model, spell=spell,
                              on_note=lambda m: notes(f"note: {m}"), on_warning=on_warning or _warn)
        opts.staging_lease_s = self.settings.staging_lease_s
        opts.max_image_bytes = self.settings.max_image_bytes
        if image_dir is not None:
            opts.image_dir = os.fspath(Path(image_dir).expanduser().absolute())
        try:
            cmap = ColumnMap(prompt_column=prompt_column, messages_column=messages_column, id_column=id_column,
                             params_columns=params_columns, template=template,
                             endpoint=Endpoint(endpoint) if endpoint is not None else None,
                             model_column=model_column, image_column=image_column)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        src = classify(source, fmt=format, cmap=cmap, spell=spell)
        kw: dict[str, Any] = {"client": self.redis, "keys": self.keys, "ttl_s": ttl_s,
                              "validate_progress": validate_progress, "enqueue_progress": enqueue_progress,
                              "max_job_bytes": self.settings.max_job_bytes}
        if spell("model") != "--model":  # this surface's words in submit's errors (issue 45)
            opts.model_option = f"{spell('model')}="
            opts.allow_unknown_hint = f"{spell('allow_unknown_model')}=True"
        if isinstance(src, FileSource):
            opts.fmt = src.fmt
            opts.input_name = input_name
            opts.endpoint, opts.endpoint_option = cmap.endpoint, spell("endpoint")
            # through the module, so a test's hook on submit_file (edits between the passes) applies
            info, created = submit_mod.submit_file(src.path, opts, **kw)
            return Batch(self, info.id, created=created, info=info)
        if opts.model is None and model_column is None:
            raise InvalidArgument("model: expected the served model name (model=...), or the column naming "
                                  "each row's (model_column=...)", field="model")
        with tempfile.TemporaryDirectory(prefix="lmdq-spool-") as d, submit_mod.Prevalidated(opts, d) as staged:
            path = Path(d) / "rows.jsonl"
            with path.open("wb") as f:
                # issue 49: where the rows allow, spooling also builds submit's pass 1, so the spool is never parsed
                spool(src, cmap, f, max_requests=opts.limits.max_requests, progress=validate_progress,
                      images=opts.image_checker(), staged=staged, max_line_bytes=opts.limits.max_line_bytes)
            opts.fmt = InputFormat.jsonl
            opts.input_name = src.name
            if opts.on_warning is not None:  # the spool is an implementation detail: name the source's rows
                opts.on_warning = _in_rows(opts.on_warning, src, str(path))
            try:
                info, created = submit_mod.submit_file(path, opts, prevalidated=staged, **kw)
            except LmdqError as e:  # the spool is an implementation detail: name the source and its rows
                e.args = (src.reword(str(e), str(path)),)
                if isinstance(e, SubmitRejected):
                    e.problems = tuple(src.relocate(p, str(path)) for p in e.problems)
                raise
        return Batch(self, info.id, created=created, info=info)

    def plan(
        self,
        source: Source,
        *,
        model: str | None = None,
        tokenizer: str | os.PathLike[str] | None = None,
        gpu_hour_price: float | None = None,
        format: str | None = None,  # noqa: A002 - submit's word
        spell: Spell = _python_name,
        **options: Unpack[SubmitKwargs],
    ) -> Plan:
        """What submitting ``source`` for ``model`` would take, making no change in Redis (issue 46):
        requests, input tokens (the model's tokenizer and chat template: ``tokenizer`` a folder holding
        ``tokenizer.json``, else the model's own folder or Hugging Face cache entry, else an estimate),
        expected output tokens (this model's recorded lengths under each request's max_new_tokens),
        shared-prefix savings, GPU-seconds and ETA at the throughput its workers measured, cost at
        ``gpu_hour_price``. Each figure says what it rests on (``plan.*_basis``); ``plan.lines()`` prints
        it, ``plan.as_dict()`` is its JSON. ``options``: submit's (``max_new_tokens=`` ...)."""
        from lmdq.client.planning import plan_source

        return plan_source(self.redis, self.keys, self.settings, source, model=model, tokenizer=tokenizer,
                           gpu_hour_price=gpu_hour_price, fmt=format, spell=spell, options=dict(options))

    def batch(self, batch_id: str) -> Batch:
        """The batch ``batch_id`` (BatchNotFound if there is none, or it expired). A batch whose submit died
        while staging it, and whose staging lease lapsed, is ended first (issue 44)."""
        self._ledger().notice_interrupted([batch_id])
        info = self._store().batches.get(batch_id)
        return Batch(self, batch_id, info=info)

    def batches(self, limit: int = 20) -> list[Batch]:
        """The newest ``limit`` batches, newest first."""
        return [Batch(self, b.id, info=b) for b in self._store().batches.newest(limit)]

    def purge(self, batch_id: str, *, force: bool = False) -> Purged:
        """Delete a batch from Redis now (record, results, jobs); returns what was deleted
        (:class:`lmdq.submission.ledger.Purged`). PurgeRefused for a running batch unless ``force``."""
        return self._ledger().purge(batch_id, force=force)

    # ---- models -------------------------------------------------------------------------------
    def register_models(self, names: Sequence[str], *, note: str | None = None, spell: Spell = _python_name
                        ) -> list[bool]:
        """Register served model names so submit accepts them with no worker running; per name, whether
        it was new (adding one again replaces its note)."""
        from lmdq.registry.store import MAX_NOTE, ModelRegistry, check_model_name

        for name in names:
            try:
                check_model_name(name)
            except ValueError as e:
                raise InvalidArgument(f"{spell('names')}: {e}", field="names", value=name) from e
        if note is not None and len(note) > MAX_NOTE:
            raise InvalidArgument(f"{spell('note')}: expected at most {MAX_NOTE} characters, got {len(note)}",
                                  field="note", value=note)
        registry = ModelRegistry(self.redis, keys=self.keys)
        return [registry.add(name, note=note) for name in names]

    def models(self) -> tuple[list[ModelInfo], float]:
        """(registered and served models as :class:`lmdq.registry.store.ModelInfo`, Redis' clock now)."""
        from lmdq.registry.store import ModelRegistry

        registry = ModelRegistry(self.redis, keys=self.keys)
        return registry.models(), registry.now()

    def webhook_secret(self, tenant: str = "default", *, rotate: bool = False) -> str:
        """The tenant's webhook signing secret (``whsec_...``, issue 48: docs/webhooks.md), made when it has
        none; ``rotate``: a new one, which signs every try from now on (the old one stops verifying)."""
        from lmdq.webhooks.signing import new_secret
        from lmdq.webhooks.store import WebhookStore

        store = WebhookStore(self.redis, keys=self.keys)
        if rotate:
            fresh = new_secret()
            store.set_secret(tenant, fresh)
            return fresh
        return store.ensure_secret(tenant, new_secret())

    def reuse_stats(self, model: str | None = None) -> list[ReuseStats]:
        """The reuse index (issue 47) per model: entries, Redis bytes, lookups, hits and hit rate
        (:class:`lmdq.reuse.index.ReuseStats`); ``model`` None: every model that has an index."""
        from lmdq.reuse.index import ReuseIndex
        from lmdq.reuse.store import ReuseStore

        return ReuseIndex(ReuseStore(self.redis, keys=self.keys)).stats(model)

    def purge_reuse(self, model: str) -> int:
        """Forget every reusable answer of ``model`` (its batches' own results stay); returns how many there were."""
        from lmdq.reuse.index import ReuseIndex
        from lmdq.reuse.store import ReuseStore

        return ReuseIndex(ReuseStore(self.redis, keys=self.keys)).purge(model)

    def remove_model(self, name: str) -> RemovedModel:
        """Forget a model (:class:`lmdq.registry.store.RemovedModel`); LmdqError when it was unknown."""
        from lmdq.registry.store import ModelRegistry

        removed = ModelRegistry(self.redis, keys=self.keys).remove(name)
        if not (removed.registered or removed.seen):
            raise LmdqError(f"unknown model {name!r}: not registered and never served; nothing removed")
        return removed


def _in_rows(warn: Callable[[str], None], src: RowSource, spool: str) -> Callable[[str], None]:
    """``warn`` for a message the file pipeline words about the spool (``/tmp/...: 3 lines ... (first:
    line 1)``), reworded as the source's user counts (:meth:`RowSource.reword`: issue 45)."""
    return lambda message: warn(src.reword(message, spool))


def _warn(message: str) -> None:
    print(f"warning: {message}" if not message.startswith("note: ") else message, file=sys.stderr)


class Batch:
    """A submitted batch: its id and what can be done with it. Cheap: it holds no results."""

    def __init__(self, client: Client, batch_id: str, *, created: bool = True, info: BatchInfo | None = None) -> None:
        self.client = client
        self.id = batch_id
        #: False when an idempotency key matched an existing batch (nothing was enqueued twice; one its first
        #: submit left part-staged was resumed: issue 44)
        self.created = created
        self._info = info

    def __repr__(self) -> str:
        return f"lmdq.Batch({self.id!r})"

    # ---- state --------------------------------------------------------------------------------
    def info(self, *, patient: bool = False, on_retry: Callable[[Exception, float], None] | None = None
             ) -> BatchInfo:
        """The batch record now (status, counts, params, timestamps). ``patient``: a Redis that restarts
        meanwhile is waited for under lmdq's retry policy (about 2 minutes) instead of raising."""
        def get() -> BatchInfo:
            # a batch whose submit died while staging it ends here if its lease lapsed (issue 44): every status,
            # results, export and cancel read of it notices, as workers and the API do
            self.client._ledger().notice_interrupted([self.id])
            info: BatchInfo = self.client._store().batches.get(self.id)
            return info

        if patient:
            from lmdq.redis.connection import with_reconnect

            self._info = with_reconnect(get, on_retry=on_retry)
        else:
            self._info = get()
        return self._info

    def progress(self, *, stream: TextIO, terminal: bool, interval_s: float, quiet: bool = False) -> BatchProgress:
        """A :class:`lmdq.submission.progress.BatchProgress` for this batch (done/total, req/s, tok/s,
        ETA; a hint when no live worker serves its model), drawn on ``stream``."""
        from lmdq.registry.store import ModelRegistry
        from lmdq.submission.progress import BatchProgress

        c = self.client
        return BatchProgress(store=c._store(), models=ModelRegistry(c.redis, keys=c.keys), stream=stream,
                             terminal=terminal, interval_s=interval_s, quiet=quiet)

    def follow(self, emit: Callable[[bool, bytes], None], *, fmt: str = "lmdq", in_order: bool = False,
               progress: BatchProgress | None = None, deadline: float | None = None,
               on_poll: Callable[[], None] | None = None,
               on_retry: Callable[[Exception, float], None] | None = None) -> BatchInfo:
        """Emit each final result as it is stored, as ``(is_error, line)`` in ``fmt`` (``lmdq`` records
        or OpenAI Batch output lines), until the batch ends or ``deadline`` (monotonic) passes: finish
        order, or input order holding back only what waits on a predecessor (``in_order``). Returns the
        last record read (:mod:`lmdq.submission.follow`)."""
        import json

        from lmdq.results.openai import is_openai_error, to_openai
        from lmdq.submission.follow import Follower, follow

        def write(raw: bytes) -> None:
            if fmt == "openai":
                r = Result.model_validate_json(raw)
                emit(is_openai_error(r), json.dumps(to_openai(r), ensure_ascii=False).encode() + b"\n")
            else:
                emit(False, raw + b"\n")

        first = self.info()
        last: BatchInfo = follow(Follower(self.client._store(), first, in_order=in_order), first,
                                 lambda: self.info(patient=True, on_retry=on_retry), write, progress=progress,
                                 deadline=deadline, on_poll=on_poll)
        return last

    @property
    def last_info(self) -> BatchInfo:
        """The record as last read (no Redis call)."""
        return self._info if self._info is not None else self.info()

    def status(self) -> BatchStatus:
        """The batch's status now."""
        return self.info().status

    def counts(self) -> RequestCounts:
        """Request counts now (total, completed, failed, cancelled, expired)."""
        return self.info().request_counts

    def counts_by_model(self) -> dict[str, RequestCounts]:
        """Request counts now, per model the batch runs on (one entry for a batch of one model)."""
        info = self.info()
        return dict(info.model_counts) if info.model_counts else {info.model: info.request_counts}

    def wait(self, timeout: float | None = None, progress: bool = True, *, poll_interval: float = 0.25) -> BatchInfo:
        """Block until the batch ends, or is ``paused`` (a quality gate failed: :meth:`gates` says why,
        :meth:`resume` runs the rest, :meth:`cancel` ends it); returns its record then. A progress bar on a
        terminal or in a notebook when ``progress``, silent otherwise. WaitTimeout (exit 1) after ``timeout``
        seconds."""
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        show = progress and (console.is_terminal or console.is_jupyter)
        deadline = None if timeout is None else time.monotonic() + timeout
        b = self.info()
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, disable=not show, transient=False) as prog:
            task = prog.add_task(b.status.value, total=b.request_counts.total, completed=b.request_counts.done)
            while not b.status.terminal and b.status is not BatchStatus.paused:
                if deadline is not None and time.monotonic() > deadline:
                    raise WaitTimeout(f"batch {self.id} still {b.status.value} after {timeout}s "
                                      f"({b.request_counts.done}/{b.request_counts.total} done)")
                time.sleep(poll_interval)
                b = self.info(patient=True)
                prog.update(task, completed=b.request_counts.done, description=b.status.value)
        return b

    # ---- results ------------------------------------------------------------------------------
    def _raw_records(self, *, partial: bool = False) -> Iterator[bytes]:
        from lmdq.results.reader import ResultReader

        for _, raw in ResultReader.of(self.client._store(), self.info()).records(partial=partial):
            if raw is not None:
                yield raw

    def results(self, *, partial: bool = False) -> Iterator[Result]:
        """The results stored so far, in input order (call :meth:`wait` first for all of them);
        ``partial``: requests still running give their in-progress record."""
        for raw in self._raw_records(partial=partial):
            yield Result.model_validate_json(raw)

    def lines(self, fmt: str = "lmdq") -> Iterator[tuple[bool, bytes]]:
        """Output lines in input order as ``(is_error, line)``: lmdq records (partials included) or
        OpenAI Batch output lines (final results only; is_error as OpenAI's error file takes them)."""
        from lmdq.results.export import iter_lmdq_lines
        from lmdq.results.openai import iter_openai

        store, info = self.client._store(), self.info()
        if fmt == "openai":
            yield from iter_openai(store, info)
        else:
            for line in iter_lmdq_lines(store, info):
                yield False, line

    def as_completed(self, *, timeout: float | None = None, poll_interval: float = 0.05,
                     max_interval: float = 1.0) -> Iterator[Result]:
        """Yield each final result as it is stored, while the batch runs, until every request has one
        (roughly completion order). WaitTimeout after ``timeout`` seconds.

        A poll reads the batch's counters (one Redis call); only when they moved does it look for the
        new records, from the first request not yielded yet and only until it found as many as the
        counters say were added, so a poll costs little however large the batch."""
        from lmdq.client.stream import poll_batch

        yield from poll_batch(self.client._store(), self.info(), lambda: self.info(patient=True),
                              lambda _, raw: Result.model_validate_json(raw), timeout=timeout,
                              poll_interval=poll_interval, max_interval=max_interval)

    def stream(self, *, timeout: float | None = None, poll_interval: float = 0.25,
               max_interval: float = 1.0) -> Iterator[StreamChunk]:
        """Yield each request's text as workers write it: per request whose text grew, a
        :class:`~lmdq.client.stream.StreamChunk` with the text it added (LMDeploy's ``stream_infer``
        counterpart), then one last chunk carrying its final ``Result``; until every request has ended.
        Text arrives at the worker's partial interval (``LMDQ_PARTIAL_INTERVAL_S``, 2 s by default), not
        per token. WaitTimeout after ``timeout`` seconds."""
        from lmdq.client.stream import stream_batch

        return stream_batch(self.client._store(), self.info(), lambda: self.info(patient=True), timeout=timeout,
                            poll_interval=poll_interval, max_interval=max_interval)

    # ---- Arrow / pandas / Parquet ---------------------------------------------------------------
    def to_arrow(self) -> pa.Table:
        """The final results as a pyarrow Table (schema: :data:`lmdq.results.export.RESULT_COLUMNS`)."""
        import pyarrow as pa

        from lmdq.results.export import embedding_schema, record_batches

        schema, chunks = embedding_schema(self._raw_records())  # the vectors' size, read ahead
        batches = list(record_batches(chunks, schema=schema))
        batch_json = self.info().model_dump_json()
        return pa.Table.from_batches(batches, schema=schema.with_metadata({"lmdq.batch": batch_json}))

    def to_pandas(self) -> pd.DataFrame:
        """:meth:`to_arrow` as a pandas DataFrame."""
        return self.to_arrow().to_pandas()

    def to_parquet(self, path: str | Path) -> int:
        """Write the final results to a Parquet file, streamed (one row group per 10,000 results or 8 MiB of
        records, whichever comes first); returns the rows written."""
        from lmdq.results.export import write_parquet

        return write_parquet(Path(path), self._raw_records(), batch_json=self.info().model_dump_json())

    # ---- quality gates (canary) -------------------------------------------------------------------
    def gates(self) -> dict[str, Any] | None:
        """The batch's quality gates (``canary=`` / ``gate=`` / ``gate_window=``): ``config``, ``verdict``
        (None while the canary runs; passed, failed, paused, resumed), ``canary_jobs_left``, ``held_jobs``
        and, once a gate failed, ``report`` (the failed gates, what was seen, example lines). None without
        gates."""
        st = self.client._ledger().gates.state(self.id)
        return None if st is None else st.as_dict()

    def resume(self) -> BatchInfo:
        """Run the rest of a ``paused`` batch (its held jobs are queued; a rolling window starts afresh).
        SubmitRejected when the batch is not paused."""
        self._info = self.client._ledger().resume(self.id)
        return self._info

    # ---- cancel / retry / purge -------------------------------------------------------------------
    def cancel(self) -> BatchInfo:
        """Take the batch's queued jobs off the queue and abort what workers hold; returns the record
        (``cancelled``, or ``cancelling`` until its workers finish)."""
        from lmdq.submission.cancel import cancel_batch

        c = self.client
        c._ledger().notice_interrupted([self.id])
        self._info = cancel_batch(c.redis, c.keys, self.id, ttl_s=c.settings.result_ttl_s)
        return self._info

    def set_deadline(self, when: str | float, *, spell: Spell = _python_name) -> BatchInfo:
        """Move the batch's deadline (ISO 8601 with its zone, or Unix time; issue 46): its waiting jobs take
        their new place in the queue (earliest deadline first) at once. Returns the record."""
        from lmdq.client.planning import set_deadline

        c = self.client
        set_deadline(c.redis, c.keys, self.info(), when, spell=spell)
        return self.info()

    def outlook(self) -> Outlook | None:
        """When the batch is projected to finish against its deadline (``outlook.misses``,
        ``outlook.warning()``), from its measured rate and what remains; None without a deadline or ended."""
        from lmdq.client.planning import outlook_of

        c = self.client
        return outlook_of(c.redis, c.keys, self.info())

    def retry(self, *, include_cancelled: bool = False, include_expired: bool = False,
              priority: Priority | str | None = None, idempotency_key: str | None = None) -> Batch:
        """Resubmit the failed requests (and optionally cancelled/expired ones) as a NEW batch, same
        custom_ids and params. RetryRejected when there is nothing to retry."""
        from lmdq.submission.retry import retry_batch

        c = self.client
        info, created = retry_batch(
            c.redis, c.keys, self.id, ttl_s=c.settings.result_ttl_s, max_job_bytes=c.settings.max_job_bytes,
            include_cancelled=include_cancelled, include_expired=include_expired,
            priority=Priority(priority) if priority is not None else None, idempotency_key=idempotency_key)
        return Batch(c, info.id, created=created, info=info)

    def purge(self, *, force: bool = False) -> Purged:
        """:meth:`Client.purge` of this batch."""
        return self.client.purge(self.id, force=force)
