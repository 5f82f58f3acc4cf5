"""``lmdq-producer``: submit prompt files, watch batches, export results."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Any, BinaryIO, TypeVar

import typer
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lmdq.cli_options import FlagSpec, model_options
from lmdq.connection import connect, redact_url, with_reconnect
from lmdq.contract import Batch, BatchStatus, GenerationParams, Priority, Result
from lmdq.errors import EXIT_CODES_HELP, BadSetting, LmdqError, run_cli
from lmdq.exporter import EXPORTER_FLAGS
from lmdq.keys import Keys
from lmdq.logs import configure_logging
from lmdq.producer.export import is_openai_error, to_openai
from lmdq.producer.progress import DEFAULT_INTERVAL_S, POLL_S, BatchProgress
from lmdq.producer.settings import ProducerSettings
from lmdq.registry import MAX_NOTE, ModelRegistry, check_model_name
from lmdq.store import ResultStore

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Submit prompt files to lmdq and read results.",
    epilog=EXIT_CODES_HELP,
    # click's plain help, not rich's panels: rich's option table cuts long option names
    # ("--repetition-pen…", "--no-skip-special-tokens,--k…") at 80 columns and even at 140; click's
    # puts a long name on its own line and wraps only the help text.
    rich_markup_mode=None,
    context_settings={"max_content_width": 120},
)
err = Console(stderr=True)
T = TypeVar("T")

_STATE: dict[str, Any] = {}


def _settings() -> ProducerSettings:
    return _STATE["settings"]


def _say_waiting(line: str) -> None:
    """A slow first contact with Redis (restarting, frozen, a black hole) says what it waits for."""
    sys.stderr.write(line + "\n")  # one write: a line never interleaves with another thread's output
    sys.stderr.flush()


def _patiently(poll: Callable[[], T]) -> T:
    """One poll of a long wait (``--watch``, ``--wait``): a Redis that restarts meanwhile is waited
    for under the one retry policy (about 2 minutes), saying so once, instead of ending the wait."""
    said: list[bool] = []

    def note(e: Exception, _delay: float) -> None:
        if not said:
            said.append(True)
            _say_waiting(f"lost Redis ({type(e).__name__}); waiting for it to come back ...")

    return with_reconnect(poll, on_retry=note)


def _client() -> Any:
    if "client" not in _STATE:
        s = _settings()
        _STATE["client"] = connect(s.redis_url, settings=s, on_slow=_say_waiting)
    return _STATE["client"]


def _store() -> ResultStore:
    s = _settings()
    return ResultStore(_client(), keys=Keys(s.key_prefix), ttl_s=s.result_ttl_s)


@app.callback()
def _main(
    redis_url: Annotated[str | None, typer.Option(help="Redis URL (env LMDQ_REDIS_URL, then REDIS_URL)")] = None,
) -> None:
    s = _load_settings()
    if redis_url:
        s.redis_url = redis_url
    _STATE["settings"] = s
    configure_logging(s.log_format, s.log_level)


def _load_settings() -> ProducerSettings:
    """The ``LMDQ_*`` settings; a bad one is one line naming the variable (not its value: it may be
    a URL with a password) and exit 2."""
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


def _parse_metadata(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for it in items:
        if "=" not in it:
            raise typer.BadParameter(f"expected k=v, got {it!r}", param_hint="--metadata")
        k, v = it.split("=", 1)
        out[k] = v
    return out


def _parse_duration(s: str | None, flag: str) -> float | None:
    """``24h``, ``90m``, ``7d``, ``30s`` or plain seconds; None when not given."""
    if not s:
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        v = float(s[:-1]) * units[s[-1]] if s[-1] in units else float(s)
    except ValueError as e:
        raise typer.BadParameter(f"expected e.g. 7d, 24h, 90m, 3600; got {s!r}", param_hint=flag) from e
    if v <= 0:
        raise typer.BadParameter(f"expected a positive duration, got {s!r}", param_hint=flag)
    return v


def _parse_window(s: str | None) -> float | None:
    """``--completion-window`` takes a unit (``24h``, as OpenAI's ``completion_window``): a bare ``2``
    could mean 2 hours as easily as 2 seconds, and a window that is silently 2 s expires everything."""
    if s and s.strip()[-1:] not in ("s", "m", "h", "d"):
        raise typer.BadParameter(f"expected a duration with its unit (e.g. 24h, 90m, 2d, 3600s), got {s!r}",
                                 param_hint="--completion-window")
    return _parse_duration(s, "--completion-window")


def _result_ttl(flag: str | None, default_s: int, window_s: float | None) -> int:
    """``--result-ttl`` (else LMDQ_RESULT_TTL_S): every key of the batch expires this long after the batch
    ENDS (lmdq.store), so any TTL covers the run, however long it takes or its completion window is."""
    ttl = _parse_duration(flag, "--result-ttl")
    ttl_s = default_s if ttl is None else int(ttl)
    if ttl_s < 60:
        raise typer.BadParameter(f"expected at least 60 seconds, got {flag!r}", param_hint="--result-ttl")
    return ttl_s


def _sink_url(flag: str | None, cluster: str | None) -> str | None:
    """``--results-url`` wins over LMDQ_RESULTS_URL (already None when set to ``none``); ``--results-url
    none`` keeps this batch's results in Redis although the cluster has a sink."""
    if flag is not None:
        return None if flag.strip().lower() in ("", "none") else _check_url(flag, "--results-url")
    return _check_url(cluster, "LMDQ_RESULTS_URL")


def _check_url(url: str | None, flag: str) -> str | None:
    """A results/blob URL: a folder (made absolute: workers may run elsewhere but share it) or s3://."""
    if not url:
        return None
    if "://" in url:
        scheme = url.split("://", 1)[0]
        if scheme not in ("file", "s3", "s3a"):
            raise typer.BadParameter(f"expected a folder, file:// or s3:// URL, got {redact_url(url)!r}",
                                     param_hint=flag)
        return url.rstrip("/")
    return str(Path(url).expanduser().resolve())


def _print_batch(b: Batch, as_json: bool) -> None:
    b = _redacted(b)
    if as_json:
        typer.echo(b.model_dump_json())
        return
    c = b.request_counts
    typer.echo(
        f"{b.id}  {b.status.value}  model={b.model}  total={c.total} completed={c.completed} "
        f"failed={c.failed} cancelled={c.cancelled} expired={c.expired}"
    )


def _redacted(b: Batch) -> Batch:
    """The batch with its output URLs as they may be shown (lmdq.output_urls.shown_output_url)."""
    from lmdq.output_urls import shown_output_url

    return b.model_copy(update={"results_url": shown_output_url(b.results_url),
                                "blob_url": shown_output_url(b.blob_url)})


def _print_submitted(batch: Batch, created: bool, as_json: bool) -> None:
    """The batch id (or the batch as JSON, with ``created``) for submit and retry."""
    batch = _redacted(batch)
    if as_json:
        out = json.loads(batch.model_dump_json())
        out["created"] = created
        typer.echo(json.dumps(out))
        return
    if not created:
        err.print("idempotency key matched an existing batch; nothing enqueued")
    typer.echo(batch.id)


#: The producer's older spellings of some generation flags, kept working beside the derived ``--<field>``.
_GENERATION_ALIASES: dict[str, tuple[str, ...]] = {
    "random_seed": ("--seed",),
    "stop_words": ("--stop",),
    "stop_token_ids": ("--stop-token-id",),
    "do_sample": (" /--greedy",),
    "skip_special_tokens": (" /--keep-special-tokens",),
}
#: One flag per GenerationParams field (name, type, help from its declaration in lmdq/contract.py).
GENERATION_FLAGS = [FlagSpec(key=name, flat=name, info=info, aliases=_GENERATION_ALIASES.get(name, ()))
                    for name, info in GenerationParams.model_fields.items()]


#: Job formation flags (--prefix-groups/--no-prefix-groups, --prefix-group-bytes), from ProducerSettings.
GROUPING_FLAGS = [FlagSpec(key=name, flat=name, info=ProducerSettings.model_fields[name])
                  for name in ("prefix_groups", "prefix_group_bytes")]


@app.command()
@model_options(GENERATION_FLAGS, into="generation")
@model_options(GROUPING_FLAGS, into="grouping")
def submit(
    generation: dict[str, Any],
    grouping: dict[str, Any],
    file: Annotated[Path, typer.Argument(help=".txt (one prompt a line), JSONL, or OpenAI Batch JSONL; - reads "
                                              "stdin")],
    model: Annotated[
        str | None,
        typer.Option(envvar="LMDQ_MODEL", help="served model name (queue); wins over an OpenAI file's body.model"),
    ] = None,
    batch_size: Annotated[int | None, typer.Option(min=1, help="requests per job (default 32)")] = None,
    priority: Annotated[Priority, typer.Option(help="queue priority")] = Priority.normal,
    metadata: Annotated[list[str] | None, typer.Option(help="k=v, repeatable")] = None,
    json_schema: Annotated[
        Path | None, typer.Option(help="constrain every answer to this JSON schema (a .json file); "
                                       "shorthand for --response-format")
    ] = None,
    regex: Annotated[
        str | None, typer.Option(help="constrain every answer to this regex; shorthand for --response-format")
    ] = None,
    idempotency_key: Annotated[str | None, typer.Option(help="same key → same batch, never enqueued twice")] = None,
    completion_window: Annotated[str | None, typer.Option(
        help="with its unit, e.g. 24h, 90m, 2d: requests not started by then expire")] = None,
    allow_unknown_model: Annotated[
        bool, typer.Option(help="queue even if MODEL is neither registered (`models add`) nor served by a worker")
    ] = False,
    results_url: Annotated[
        str | None,
        typer.Option(help="folder or s3://bucket/prefix: full results go to JSONL shards there, Redis keeps "
                          "counts and a small index (default LMDQ_RESULTS_URL; 'none': results stay in Redis)"),
    ] = None,
    result_ttl: Annotated[
        str | None,
        typer.Option(help="how long the batch and its results are kept once it has ENDED: e.g. 7d, 12h, 3600 "
                          "(default LMDQ_RESULT_TTL_S, 7 days)"),
    ] = None,
    blob_url: Annotated[
        str | None, typer.Option(help="folder or s3://bucket/prefix for tensors (default: the worker's LMDQ_BLOB_URL)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the batch as a JSON object")] = False,
) -> None:
    """Validate FILE completely, then enqueue it as one batch; prints the batch id."""
    from pydantic import ValidationError

    from lmdq.producer.formats import InputLimits
    from lmdq.producer.formats.records import Sampling
    from lmdq.producer.formats.validation import imply_sampling
    from lmdq.producer.stdin_input import is_stdin, spooled_stdin
    from lmdq.producer.submit import SubmitOptions, submit_file

    s = _settings()
    raw_params: dict[str, Any] = dict(generation)
    if sum(x is not None for x in (json_schema, regex, raw_params.get("response_format"))) > 1:
        print("error: --json-schema, --regex and --response-format: pass one of them", file=sys.stderr)
        raise typer.Exit(2)
    if json_schema is not None:
        try:
            schema = json.loads(json_schema.read_text())
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deeply to parse
            print(f"error: --json-schema: {json_schema}: expected a readable JSON file ({e})", file=sys.stderr)
            raise typer.Exit(2) from e
        raw_params["response_format"] = {"type": "json_schema", "json_schema": {"name": json_schema.stem,
                                                                                "schema": schema}}
    elif regex is not None:
        raw_params["response_format"] = {"type": "regex", "regex": regex}
    given = {k: v for k, v in raw_params.items() if v is not None}
    if imply_sampling(given) is Sampling.implied:  # the same rule as a file's params
        print(f"note: --temperature {given['temperature']} without --do-sample/--greedy: "
              f"{'sampling' if given['do_sample'] else 'greedy'} (temperature > 0 samples)", file=sys.stderr)
    try:
        params = GenerationParams.model_validate(given)
    except ValidationError as e:
        first = e.errors()[0]
        flag = "--" + str(first["loc"][0]).replace("_", "-") if first["loc"] else "params"
        print(f"error: {flag}: {first['msg']}", file=sys.stderr)
        raise typer.Exit(2) from e
    if params.response_format is not None:
        from lmdq.guided import check as check_response_format

        try:
            check_response_format(params.response_format)
        except ValueError as e:
            flag = "--json-schema" if json_schema else "--regex" if regex is not None else "--response-format"
            print(f"error: {flag}: {e}", file=sys.stderr)
            raise typer.Exit(2) from e
    window_s = _parse_window(completion_window)
    ttl_s = _result_ttl(result_ttl, s.result_ttl_s, window_s)
    opts = SubmitOptions(
        model=model,
        batch_size=batch_size or s.batch_size,
        params=params,
        priority=priority,
        metadata=_parse_metadata(metadata or []),
        idempotency_key=idempotency_key,
        completion_window_s=window_s,
        allow_unknown_model=allow_unknown_model,
        known_models=s.known_models,
        limits=InputLimits(max_line_bytes=s.max_line_bytes, max_requests=s.max_requests),
        results_url=_sink_url(results_url, s.results_url),
        blob_url=_check_url(blob_url, "--blob-url"),
        prefix_groups=grouping.get("prefix_groups", s.prefix_groups),
        prefix_group_bytes=grouping.get("prefix_group_bytes", s.prefix_group_bytes),
        memory_fraction=s.memory_headroom_fraction,
        on_warning=lambda w: print(f"warning: {w}", file=sys.stderr),
    )
    client = _client()
    show = sys.stderr.isatty() and not as_json
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:,}"),
        TimeElapsedColumn(),
        console=err,
        disable=not show,
        transient=True,
    ) as prog:
        t1 = prog.add_task("validating lines", total=None)
        t2 = prog.add_task("staging jobs", total=None, visible=False)

        def vprog(n: int) -> None:
            if n % 5000 == 0:
                prog.update(t1, completed=n)

        def eprog(n: int) -> None:
            prog.update(t2, completed=n, visible=True)

        with ExitStack() as stack:
            path = stack.enter_context(spooled_stdin()) if is_stdin(file) else file
            opts.input_name = "-" if is_stdin(file) else None
            batch, created = submit_file(path, opts, client=client, keys=Keys(s.key_prefix), ttl_s=ttl_s,
                                         validate_progress=vprog if show else None,
                                         enqueue_progress=eprog if show else None, max_job_bytes=s.max_job_bytes)
    _print_submitted(batch, created, as_json)


@app.command()
def status(
    batch_id: Annotated[str, typer.Argument()],
    as_json: Annotated[bool, typer.Option("--json")] = False,
    watch: Annotated[bool, typer.Option(help="show progress (done/total, rate, ETA) until the batch ends")] = False,
    interval: Annotated[float, typer.Option(min=0.01, help="with --watch and stderr not a terminal: seconds "
                                            "between progress lines (a status change prints at once)")
                        ] = DEFAULT_INTERVAL_S,
) -> None:
    """Show a batch's status and request counts."""
    store = _store()
    b = store.get_batch(batch_id)
    if watch:
        from lmdq.producer.progress import watch as watch_batch

        with _progress(store, interval) as prog:
            b = watch_batch(lambda: _patiently(lambda: store.get_batch(batch_id)), prog, b,
                            poll_s=min(POLL_S, interval))
    _print_batch(b, as_json)


def _progress(store: ResultStore, interval: float, *, show: bool = True) -> BatchProgress:
    """Progress on stderr: a live bar on a terminal, a line per change or ``interval`` elsewhere
    (``show`` False: stdout is the terminal and shows the results themselves: nothing drawn)."""
    return BatchProgress(store=store, models=_models(), stream=sys.stderr, terminal=err.is_terminal,
                    interval_s=interval if show else float("inf"), quiet=not show)


def _open_output(path: Path | None, flag: str) -> BinaryIO | None:
    """Open ``-o``/``--errors-file`` before any waiting, so a bad path fails at once, in one line."""
    if path is None:
        return None
    try:
        return path.open("wb")
    except OSError as e:
        print(f"error: {flag}: cannot write {str(path)!r}: {e.strerror or e}", file=sys.stderr)
        raise typer.Exit(2) from e


@app.command()
def results(
    batch_id: Annotated[str, typer.Argument()],
    output: Annotated[Path | None, typer.Option("-o", "--output", help="write here instead of stdout")] = None,
    fmt: Annotated[str, typer.Option("--format", help="lmdq | openai")] = "lmdq",
    wait: Annotated[bool, typer.Option(help="wait until the batch ends (progress on stderr), then write")] = False,
    follow: Annotated[bool, typer.Option(help="write each result as it is stored (finish order) until the batch "
                                              "ends")] = False,
    in_order: Annotated[bool, typer.Option(help="with --follow: input order, holding back only results whose "
                                                "predecessors are not in yet")] = False,
    timeout: Annotated[float | None, typer.Option(help="give up waiting after S seconds (exit 1)")] = None,
    interval: Annotated[float, typer.Option(min=0.01, help="with --wait/--follow and stderr not a terminal: "
                                            "seconds between progress lines")] = DEFAULT_INTERVAL_S,
    errors_file: Annotated[
        Path | None,
        typer.Option(help="with --format openai: failed/cancelled/expired lines go here, successes to -o/stdout"),
    ] = None,
    delete: Annotated[
        bool, typer.Option("--delete", help="once every line is written, delete the batch from Redis (an ended "
                                            "batch only; shards in its results URL stay)")
    ] = False,
) -> None:
    """One JSON line per request, in input order (with --follow: as they finish)."""
    from lmdq.producer.export import iter_lmdq_lines, iter_openai
    from lmdq.producer.follow import Follower
    from lmdq.producer.follow import follow as follow_batch
    from lmdq.producer.progress import watch as watch_batch

    fmt = fmt.lower()
    if fmt not in ("lmdq", "openai"):
        raise typer.BadParameter(f"expected lmdq or openai, got {fmt!r}", param_hint="--format")
    if errors_file is not None and fmt != "openai":
        print("error: --errors-file: expected --format openai (lmdq records carry their status)", file=sys.stderr)
        raise typer.Exit(2)
    if errors_file is not None and output is not None and errors_file.resolve() == output.resolve():
        print(f"error: --errors-file: expected a file other than --output ({output})", file=sys.stderr)
        raise typer.Exit(2)
    if in_order and not follow:
        print("error: --in-order: expected --follow (without it results are always in input order)", file=sys.stderr)
        raise typer.Exit(2)
    store = _store()
    b = store.get_batch(batch_id)
    out_file = _open_output(output, "--output")
    err_file = _open_output(errors_file, "--errors-file")
    out = out_file or sys.stdout.buffer
    errs = err_file or out
    deadline = None if timeout is None else time.monotonic() + timeout
    # no progress when the results on a terminal are the progress, or there is nothing left to wait for
    show = (out_file is not None or not sys.stdout.isatty()) and not b.status.terminal
    try:
        if follow:
            def write(raw: bytes) -> None:
                if fmt == "openai":
                    r = Result.model_validate_json(raw)
                    (errs if is_openai_error(r) else out).write(
                        json.dumps(to_openai(r), ensure_ascii=False).encode() + b"\n")
                else:
                    out.write(raw + b"\n")

            with _progress(store, interval, show=show) as prog:
                b = follow_batch(Follower(store, b, in_order=in_order), b,
                                 lambda: _patiently(lambda: store.get_batch(batch_id)), write,
                                 progress=prog, deadline=deadline, on_poll=lambda: _flush(out, errs))
            _timed_out(b, batch_id, timeout)
        else:
            if wait and not b.status.terminal:
                with _progress(store, interval, show=show) as prog:
                    b = watch_batch(lambda: _patiently(lambda: store.get_batch(batch_id)), prog, b,
                                    deadline=deadline, poll_s=min(0.25, interval))
                _timed_out(b, batch_id, timeout)
            if delete and not b.status.terminal:
                from lmdq.errors import PurgeRefused

                raise PurgeRefused(f"--delete: batch {batch_id} is {b.status.value}, its results are not all in "
                                   "yet; nothing was deleted (add --wait, or leave out --delete)")
            lines = iter_openai(store, b) if fmt == "openai" else ((False, x) for x in iter_lmdq_lines(store, b))
            for is_error, line in lines:
                (errs if is_error else out).write(line)
    finally:
        if err_file:
            err_file.close()
        if out_file:
            out_file.close()
        else:
            out.flush()
    if delete:  # only reached when every line was written: an error above leaves the batch in Redis
        from lmdq.ledger import BatchLedger

        s = _settings()
        done = BatchLedger(_client(), keys=Keys(s.key_prefix), ttl_s=s.result_ttl_s).purge(batch_id)
        err.print(str(done), highlight=False, soft_wrap=True)


def _flush(*files: BinaryIO) -> None:
    for f in files:
        f.flush()


def _timed_out(b: Batch, batch_id: str, timeout: float | None) -> None:
    """A wait that ended before the batch did: one line, exit 1."""
    if not b.status.terminal:
        print(f"error: batch {batch_id} still {b.status.value} after {timeout}s "
              f"({b.request_counts.done}/{b.request_counts.total} done)", file=sys.stderr)
        raise typer.Exit(1)


@app.command("list")
def list_(
    limit: Annotated[int, typer.Option(help="how many recent batches")] = 20,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Recent batches with status and counts."""
    batches = _store().list_batches(limit)
    if as_json:
        for b in batches:
            typer.echo(_redacted(b).model_dump_json())
        return
    out = Console()
    table = _batches_table(batches)
    # measured without the terminal's limit: Measurement.get clamps to it, which would hide a table too wide
    if Measurement.get(out, out.options.update_width(10_000), table).minimum <= out.width:
        out.print(table)
        return
    # Too narrow for the table (lmdq ids are 30 characters: an 80-column terminal is): rich would cut
    # the ids ("batch_a1…"), which then cannot be copied. Two lines per batch instead: the id, status
    # and created time (63 columns: never wrapped at 80), then the model and every count by its name.
    for b in batches:
        head = f"{b.id}  {b.status.value:<13s}{_created(b)}"
        typer.echo(head if len(head) <= out.width else _fill([b.id, b.status.value, _created(b)], out.width, ""))
        typer.echo(_fill([f"model={b.model}", *_counts(b)], width=out.width, indent="  ", sep=" "))


def _counts(b: Batch) -> list[str]:
    """Every request count under its own name, as ``status`` prints them."""
    c = b.request_counts
    return [f"total={c.total}", f"completed={c.completed}", f"failed={c.failed}", f"cancelled={c.cancelled}",
            f"expired={c.expired}"]


def _fill(fields: list[str], width: int, indent: str = "  ", sep: str = "  ") -> str:
    """Fields two spaces apart (the first two; then ``sep``), indented, a new line where the next would
    pass ``width``: a line breaks between fields, never inside one (a model name, a date and its time
    stay whole)."""
    lines = [indent + fields[0]]
    for n, f in enumerate(fields[1:]):
        gap = "  " if n == 0 else sep
        if len(lines[-1]) + len(gap) + len(f) <= width:
            lines[-1] += gap + f
        else:
            lines.append(indent + "  " + f)
    return "\n".join(lines)


def _created(b: Batch) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b.created_at))


def _batches_table(batches: list[Batch]) -> Table:
    """``list``'s table. Only the model may wrap: ids, statuses, counts and times are never cut or
    folded (a table that cannot fit them is not printed at all, see :func:`list_`). Every count is
    under its own name; cancelled and expired get a column only when some batch shown has any."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("batch", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("model", overflow="fold", min_width=12, max_width=24)
    counts = ["total", "completed", "failed"]
    counts += [k for k in ("cancelled", "expired") if any(getattr(b.request_counts, k) for b in batches)]
    for head in counts:
        table.add_column(head, justify="right", no_wrap=True)
    table.add_column("created", no_wrap=True)
    for b in batches:
        c = b.request_counts
        table.add_row(b.id, b.status.value, b.model, *(str(getattr(c, k)) for k in counts),
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(b.created_at)))
    return table


@app.command()
def cancel(
    batch_id: Annotated[str, typer.Argument()],
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Remove the batch's queued jobs and abort its in-flight requests."""
    from lmdq.producer.cancel import cancel_batch

    s = _settings()
    b = cancel_batch(_client(), Keys(s.key_prefix), batch_id, ttl_s=s.result_ttl_s)
    _print_batch(b, as_json)


@app.command()
def purge(
    batch_id: Annotated[str, typer.Argument()],
    force: Annotated[bool, typer.Option(help="also a batch that has not ended: its queued jobs are dropped and "
                                             "workers abort what they hold")] = False,
) -> None:
    """Delete a batch from Redis now (record, results, jobs), instead of at its TTL; says what it deleted."""
    from lmdq.ledger import BatchLedger

    s = _settings()
    done = BatchLedger(_client(), keys=Keys(s.key_prefix), ttl_s=s.result_ttl_s).purge(batch_id, force=force)
    typer.echo(str(done))


@app.command()
def retry(
    batch_id: Annotated[str, typer.Argument(help="an ended batch")],
    include_cancelled: Annotated[bool, typer.Option(help="also resubmit cancelled requests")] = False,
    include_expired: Annotated[bool, typer.Option(help="also resubmit expired requests")] = False,
    priority: Annotated[Priority | None, typer.Option(help="queue priority (default: the batch's)")] = None,
    idempotency_key: Annotated[str | None, typer.Option(help="same key → same retry batch")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the new batch as a JSON object")] = False,
) -> None:
    """Resubmit BATCH's failed requests as a new batch (same custom_ids and params); prints its id."""
    from lmdq.producer.retry import retry_batch

    s = _settings()
    batch, created = retry_batch(
        _client(),
        Keys(s.key_prefix),
        batch_id,
        ttl_s=s.result_ttl_s,
        max_job_bytes=s.max_job_bytes,
        include_cancelled=include_cancelled,
        include_expired=include_expired,
        priority=priority,
        idempotency_key=idempotency_key,
    )
    _print_submitted(batch, created, as_json)


models_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings={"max_content_width": 120},
    help="Register, list and remove the models submit accepts.\n\nSubmit accepts a model an operator "
    "registered or one a worker has served. Register the deployment's model so a submit is accepted while no "
    "worker runs (autoscaling from zero replicas).",
)
app.add_typer(models_app, name="models")


def _models() -> ModelRegistry:
    return ModelRegistry(_client(), keys=Keys(_settings().key_prefix))


@models_app.command("add")
def models_add(
    names: Annotated[list[str], typer.Argument(metavar="NAME", help="served model names (submit --model)")],
    note: Annotated[
        str | None, typer.Option(help=f"a reminder shown by `models list` (at most {MAX_NOTE} characters)")
    ] = None,
) -> None:
    """Register models so submit accepts them with no worker running.

    Idempotent: adding a registered model again replaces its note. Deployments run it once per apply
    (deploy/base/register-model.yaml, the compose service `register-model`)."""
    for name in names:
        try:
            check_model_name(name)
        except ValueError as e:
            print(f"error: NAME: {e}", file=sys.stderr)
            raise typer.Exit(2) from e
    if note is not None and len(note) > MAX_NOTE:
        print(f"error: --note: expected at most {MAX_NOTE} characters, got {len(note)}", file=sys.stderr)
        raise typer.Exit(2)
    registry = _models()
    for name in names:
        new = registry.add(name, note=note)
        typer.echo(f"{'registered' if new else 'already registered (updated)'}: {name}")


@models_app.command("list")
def models_list(
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per model")] = False,
) -> None:
    """List registered and worker-served models, with live workers.

    Times are ages on the Redis server's clock: `registered` is the latest `models add`, `last seen` a
    worker's latest heartbeat for the model; `workers` counts workers alive now."""
    from lmdq.producer.models import model_lines, models_table

    registry = _models()
    models, now = registry.models(), registry.now()
    if as_json:
        for m in models:
            typer.echo(json.dumps(m.as_dict()))
        return
    if not models:
        err.print("no models: register one with `lmdq-producer models add NAME`, or start a worker")
        return
    out = Console()
    table = models_table(models, now)
    if Measurement.get(out, out.options.update_width(10_000), table).minimum <= out.width:
        out.print(table)
        return
    for name, fields in model_lines(models, now):  # too narrow: never cut a name (see list_)
        typer.echo(name)
        typer.echo(_fill(fields, width=out.width))


@models_app.command("remove")
def models_remove(
    name: Annotated[str, typer.Argument(metavar="NAME", help="a registered or served model name")],
) -> None:
    """Forget a model: submit refuses it again.

    Deletes its registration and its last-seen record; a live worker serving it records it again at
    its next heartbeat."""
    removed = _models().remove(name)
    if not (removed.registered or removed.seen):
        raise LmdqError(f"unknown model {name!r}: not registered and never served; nothing removed")
    what = " and ".join(w for w, on in (("registration", removed.registered), ("last-seen record", removed.seen))
                        if on)
    typer.echo(f"removed: {name} ({what})")
    if removed.live_workers:
        err.print(f"note: {removed.live_workers} live worker(s) serve {name!r}: their next heartbeat "
                  "records it as served again; stop them to retire it", markup=False, highlight=False)


@app.command()
@model_options(EXPORTER_FLAGS, into="flags")
def exporter(flags: dict[str, Any]) -> None:
    """Serve queue metrics (depth, running jobs, live workers, batches per model) on /metrics for
    Prometheus, read from Redis every --interval-s by one collector (scrapes never wait on Redis). Run
    ONE per Redis: it needs no GPU and works at zero workers (deploy/base/exporter.yaml)."""
    from lmdq.exporter import load_settings, run

    run(load_settings(**flags, redis_url=_settings().redis_url))


def main() -> None:
    run_cli(app)


_ = BatchStatus  # re-exported for type checkers of callers
