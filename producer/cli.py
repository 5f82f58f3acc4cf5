"""``lmdq-producer``: submit prompt files, watch batches, export results.

Start-up imports only what building the commands' options needs (typer, pydantic, the contract and
the settings): the client (redis-py, rq), rich, structlog and the exporter are imported by the command
that uses them, so ``--help`` and ``status`` start fast (issue 49; tests/test_cli_startup.py,
``lmdq-bench cli-startup``)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, BinaryIO

import typer

from lmdq.cli.options import F, model_options
from lmdq.cli.run import run_cli
from lmdq.client.options import GENERATION_FLAGS, GROUPING_FLAGS, SUBMIT_FLAGS, cli_spell
from lmdq.contract import Batch, BatchStatus, Endpoint, Priority
from lmdq.errors import EXIT_CODES_HELP, PurgeRefused, SubmitRejected
from lmdq.flags import settings_flags
from lmdq.metrics.settings import EXPORTER_FLAGS
from lmdq.registry import MAX_NOTE
from lmdq.submission.progress import DEFAULT_INTERVAL_S, POLL_S, BatchProgress
from lmdq.submission.settings import ProducerSettings

if TYPE_CHECKING:  # imported by the commands that use them (see the module's docstring)
    from rich.console import Console
    from rich.table import Table

    from lmdq.client.client import Batch as ClientBatch
    from lmdq.client.client import Client

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
_STATE: dict[str, Any] = {}


@cache
def _err() -> Console:
    """The command's rich console on stderr (made on first use: rich is not imported at start-up)."""
    from rich.console import Console

    return Console(stderr=True)


def _say_waiting(line: str) -> None:
    """A slow first contact with Redis (restarting, frozen, a black hole) says what it waits for."""
    sys.stderr.write(line + "\n")  # one write: a line never interleaves with another thread's output
    sys.stderr.flush()


def _note_lost(e: Exception, _delay: float, said: list[bool]) -> None:
    if not said:
        said.append(True)
        _say_waiting(f"lost Redis ({type(e).__name__}); waiting for it to come back ...")


def _patiently(b: ClientBatch) -> Batch:
    """One poll of a long wait (``--watch``, ``--wait``): a Redis that restarts meanwhile is waited
    for under the one retry policy (about 2 minutes), saying so once, instead of ending the wait."""
    said: list[bool] = []
    return b.info(patient=True, on_retry=lambda e, d: _note_lost(e, d, said))


def _lmdq() -> Client:
    """The one lmdq.Client of this command (the CLI is a thin client of the Python API), made by the
    command's first use: the ``LMDQ_*`` settings are read (a bad one: one line, exit 2) and logging is
    configured then, so a command's ``--help`` imports neither the client nor structlog (issue 49)."""
    if "client" not in _STATE:
        from lmdq.client.client import Client, load_settings
        from lmdq.logs.config import configure_logging

        s = load_settings()
        _STATE["client"] = Client(_STATE.get("redis_url"), settings=s, on_slow=_say_waiting)
        # structlog itself is imported by the first log record (lmdq.logs.config): status logs nothing
        configure_logging(s.log_format, s.log_level, defer=True)
    return _STATE["client"]  # type: ignore[no-any-return]


@app.callback()
@model_options(settings_flags(ProducerSettings, ["redis_url"]), into="given")
def _main(given: dict[str, Any]) -> None:
    _STATE.pop("client", None)  # a new command line (tests run several in one process): a new client
    _STATE["redis_url"] = given.get("redis_url")


def _print_batch(b: Batch, as_json: bool) -> None:
    b = _redacted(b)
    if as_json:
        typer.echo(b.model_dump_json())
        return
    c = b.request_counts
    _echo_fit(
        f"{b.id}  {b.status.value}  {_model_field(b)}  total={c.total} completed={c.completed} "
        f"failed={c.failed} cancelled={c.cancelled} expired={c.expired}"
        + (f" reusable={b.reusable}" if b.reusable is not None else "")
    )
    if b.deadline is not None:  # issue 46
        import datetime as dt

        _echo_fit(f"  deadline={dt.datetime.fromtimestamp(b.deadline, dt.timezone.utc).isoformat(timespec='seconds')}")
    for m, mc in (b.model_counts or {}).items():  # a batch over several models: a line per model
        _echo_fit(f"  model={m}  total={mc.total} completed={mc.completed} failed={mc.failed} "
                  f"cancelled={mc.cancelled} expired={mc.expired}")


def _echo_fit(line: str) -> None:
    """``line`` as it is for a pipe or a file (one record a line, for scripts); on a terminal, wrapped
    at spaces to its width, continuation lines indented (issue 45: a 122-column status line)."""
    if not sys.stdout.isatty():
        typer.echo(line)
        return
    import shutil
    import textwrap

    width = shutil.get_terminal_size((80, 24)).columns
    indent = " " * (len(line) - len(line.lstrip()))
    typer.echo("\n".join(textwrap.wrap(line, width=max(width, 20), subsequent_indent=indent + "    ",
                                       break_long_words=False, break_on_hyphens=False)))


def _model_field(b: Batch) -> str:
    """``model=NAME``, or ``models=A,B,C`` for a batch over several models."""
    return f"models={','.join(b.models)}" if b.model_counts else f"model={b.model}"


def _redacted(b: Batch) -> Batch:
    """The batch with its output URLs as they may be shown (lmdq.results.output_urls.shown_output_url)."""
    from lmdq.results.output_urls import shown_output_url

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
        # a batch its first submit left part-staged was resumed (the ledger logs it): nothing is ever staged twice
        _err().print("idempotency key matched an existing batch; nothing enqueued twice")
    typer.echo(batch.id)


def _request_options(fn: F) -> F:
    """The options that shape each request, declared once for ``submit`` and ``plan`` (which plans what
    submit would run): the generation parameters into ``generation``, prefix grouping into ``grouping``."""
    return model_options(GENERATION_FLAGS, into="generation")(model_options(GROUPING_FLAGS, into="grouping")(fn))


def _submit_bars(stack: ExitStack) -> tuple[Callable[[int], None], Callable[[int], None]]:
    """Submit's two transient bars on a terminal (lines validated, jobs staged), entered on ``stack``."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    prog = stack.enter_context(Progress(TextColumn("{task.description}"), BarColumn(),
                                        TextColumn("{task.completed:,}"), TimeElapsedColumn(),
                                        console=_err(), transient=True))
    t1 = prog.add_task("validating lines", total=None)
    t2 = prog.add_task("staging jobs", total=None, visible=False)
    validated = [0]

    def vprog(n: int) -> None:
        validated[0] = n
        if n % 5000 == 0:
            prog.update(t1, completed=n)

    def eprog(n: int) -> None:
        # validation is over once staging starts: its count is the file's, not the last multiple of 5,000
        prog.update(t1, completed=validated[0])
        prog.update(t2, completed=n, visible=True)

    return vprog, eprog


@app.command()
@_request_options
@model_options(SUBMIT_FLAGS, into="batch_options")
def submit(
    generation: dict[str, Any],
    grouping: dict[str, Any],
    batch_options: dict[str, Any],
    file: Annotated[Path, typer.Argument(help=".txt (one prompt a line), JSONL, OpenAI Batch JSONL, "
                                              ".parquet or .csv; - reads stdin")],
    model: Annotated[
        str | None,
        typer.Option(envvar="LMDQ_MODEL", help="served model name (queue); wins over an OpenAI file's body.model"),
    ] = None,
    fmt: Annotated[str | None, typer.Option("--format", help="text | jsonl | openai | parquet | csv (default: "
                                                             "from the suffix)")] = None,
    prompt_column: Annotated[str | None, typer.Option(help="Parquet/CSV: the column holding the prompt")] = None,
    messages_column: Annotated[str | None, typer.Option(help="Parquet/CSV: the column holding chat messages")
                               ] = None,
    id_column: Annotated[str | None, typer.Option(help="Parquet/CSV: the column holding each row's custom_id "
                                                       "(default: the row number)")] = None,
    model_column: Annotated[str | None, typer.Option(help="Parquet/CSV: the column naming each row's served "
                                                          "model (one batch over several models)")] = None,
    params_column: Annotated[list[str] | None, typer.Option(help="Parquet/CSV: a column named like a generation "
                                                                 "parameter, per row (repeatable)")] = None,
    template: Annotated[str | None, typer.Option(help="Parquet/CSV: the prompt as a str.format template of "
                                                      "columns, e.g. 'Q: {question}'")] = None,
    endpoint: Annotated[str | None, typer.Option(help="every line's endpoint: chat | completion | score | reward | "
                                                     "embedding (default: each line's own, else chat); a .txt's "
                                                     "lines take chat, completion or embedding")] = None,
    image_column: Annotated[str | None, typer.Option(help="Parquet/CSV: the column holding each row's image (a path "
                                                          "or URL, or its bytes)")] = None,
    image_dir: Annotated[Path | None, typer.Option(help="the folder relative image paths resolve against (image_url "
                                                        "parts, --image-column); workers must see it at the same "
                                                        "path")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the batch as a JSON object")] = False,
    plan: Annotated[bool, typer.Option("--plan", help="print the batch's plan (lmdq-producer plan) on stderr "
                                                      "before enqueueing it")] = False,
    tokenizer: Annotated[str | None, typer.Option(help="with --plan: the model's tokenizer folder")] = None,
) -> None:
    """Validate FILE completely, then enqueue it as one batch; prints the batch id."""
    from lmdq.submission.stdin_input import is_stdin, spooled_stdin

    if plan and not is_stdin(file):
        p = _lmdq().plan(file, model=model, tokenizer=tokenizer, format=fmt, spell=cli_spell, **generation,
                         **grouping, **batch_options)
        for line in p.lines():
            _err().print(line, markup=False, highlight=False, soft_wrap=True)
    elif plan:
        _err().print("--plan: not for stdin (it is read once); plan a file with lmdq-producer plan", markup=False)

    show = sys.stderr.isatty() and not as_json
    with ExitStack() as stack:
        vprog: Callable[[int], None] | None = None
        eprog: Callable[[int], None] | None = None
        if show:  # rich is imported only where a bar is drawn: a piped or scripted submit starts sooner
            vprog, eprog = _submit_bars(stack)
        path = stack.enter_context(spooled_stdin()) if is_stdin(file) else file
        batch = _lmdq().submit(
            path, input_name="-" if is_stdin(file) else None, model=model, format=fmt,
            prompt_column=prompt_column, messages_column=messages_column,
            id_column=id_column, model_column=model_column, params_columns=params_column or None,
            template=template, endpoint=_endpoint(endpoint), image_column=image_column, image_dir=image_dir,
            spell=cli_spell, validate_progress=vprog, enqueue_progress=eprog,
            **generation, **grouping, **batch_options,
        )
    _print_submitted(batch.last_info, batch.created, as_json)


def _endpoint(value: str | None) -> Endpoint | None:
    """``--endpoint``'s value as the contract's Endpoint (one clear line and exit 2 for anything else)."""
    if value is None:
        return None
    try:
        return Endpoint(value)
    except ValueError:
        raise SubmitRejected(f"--endpoint: expected one of {' | '.join(e.value for e in Endpoint)}, "
                             f"got {value!r}") from None


@app.command("plan")
@_request_options
def plan_cmd(
    generation: dict[str, Any],
    grouping: dict[str, Any],
    file: Annotated[Path, typer.Argument(help="the file submit would take (.txt, JSONL, OpenAI Batch JSONL, "
                                              ".parquet, .csv)")],
    model: Annotated[str | None, typer.Option(envvar="LMDQ_MODEL", help="served model name to plan for")] = None,
    fmt: Annotated[str | None, typer.Option("--format", help="as for submit")] = None,
    tokenizer: Annotated[str | None, typer.Option(help="folder holding the model's tokenizer.json (and its "
                                                       "tokenizer_config.json chat template); default: the "
                                                       "model's own folder or Hugging Face cache entry")] = None,
    gpu_hour_price: Annotated[float | None, typer.Option(min=0, help="price of one GPU-hour: the plan's cost")
                              ] = None,
    reuse: Annotated[bool | None, typer.Option("--reuse/--no-reuse", help="as for submit: count the requests the "
                                               "reuse index answers now (default LMDQ_REUSE)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as a JSON object")] = False,
) -> None:
    """What submitting FILE would take: requests, input and output tokens, shared prefixes, GPU-seconds,
    ETA and cost, each with what it rests on. Changes nothing in Redis."""
    p = _lmdq().plan(file, model=model, tokenizer=tokenizer, gpu_hour_price=gpu_hour_price, format=fmt,
                     spell=cli_spell, reuse=reuse, **generation, **grouping)
    if as_json:
        typer.echo(json.dumps(p.as_dict()))
        return
    for line in p.lines():
        typer.echo(line)


@app.command()
def status(
    batch_id: Annotated[str, typer.Argument()],
    as_json: Annotated[bool, typer.Option("--json")] = False,
    watch: Annotated[bool, typer.Option(help="show progress (done/total, rate, ETA) until the batch ends")] = False,
    interval: Annotated[float, typer.Option(min=0.01, help="with --watch and stderr not a terminal: seconds "
                                            "between progress lines (a status change prints at once)")
                        ] = DEFAULT_INTERVAL_S,
) -> None:
    """Show a batch's status and request counts, and its quality gates (a paused batch: what failed)."""
    handle = _lmdq().batch(batch_id)
    b = handle.last_info
    if watch:
        from lmdq.submission.progress import watch as watch_batch

        with _progress(handle, interval) as prog:
            b = watch_batch(lambda: _patiently(handle), prog, b, poll_s=min(POLL_S, interval))
    gates = handle.gates()
    if as_json and gates is not None:  # the batch record with its gates beside it (lmdq's own key)
        typer.echo(json.dumps({**json.loads(_redacted(b).model_dump_json()), "gates": gates}))
    else:
        _print_batch(b, as_json)
        if gates is not None:
            _print_gates(b, gates)
    _warn_deadline(handle)


def _print_gates(b: Batch, gates: dict[str, Any]) -> None:
    """The gates' state in a few lines; a paused batch's report with its example lines."""
    cfg = gates.get("config") or {}
    verdict = gates.get("verdict") or ("canary running" if cfg.get("canary") is not None else "watching")
    typer.echo(f"  gates: {verdict}  canary_jobs_left={gates.get('canary_jobs_left', 0)} "
               f"held_jobs={gates.get('held_jobs', 0)}  " + " ".join(f"{k}={v}" for k, v in cfg.items()))
    report = gates.get("report")
    if not report or b.status is not BatchStatus.paused:
        return
    typer.echo(f"  paused after the {report.get('phase')}: {report.get('judged')} results judged")
    for f in report.get("failures", []):
        typer.echo(f"  FAILED {f.get('gate')}: {f.get('message')}")
        for ex in f.get("examples", []):
            why = f"  ({ex['why']})" if ex.get("why") else ""
            typer.echo(f"    line {int(ex.get('i', 0)) + 1} {ex.get('id', '')}: {ex.get('x', '')!r}{why}")
    typer.echo(f"  resume: lmdq-producer resume {b.id}    cancel: lmdq-producer cancel {b.id}")


def _warn_deadline(handle: ClientBatch) -> None:
    """A batch projected to finish after its deadline says so on stderr (issue 46), before it misses it."""
    o = handle.outlook()
    line = o.warning() if o is not None else None
    if line:
        _err().print(line, markup=False, highlight=False, soft_wrap=True)


@app.command()
def deadline(
    batch_id: Annotated[str, typer.Argument()],
    when: Annotated[str, typer.Argument(help="ISO 8601 with its zone (2026-12-06T07:00Z) or Unix time")],
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Move an open batch's deadline: its waiting jobs take their new place (earliest deadline first)."""
    handle = _lmdq().batch(batch_id)
    value: str | float = float(when) if when.replace(".", "", 1).isdigit() else when
    _print_batch(handle.set_deadline(value, spell=lambda n: f"{cli_spell(n) if n != 'deadline' else 'WHEN'}"),
                 as_json)
    _warn_deadline(handle)


def _progress(handle: ClientBatch, interval: float, *, show: bool = True) -> BatchProgress:
    """Progress on stderr: a live bar on a terminal, a line per change or ``interval`` elsewhere
    (``show`` False: stdout is the terminal and shows the results themselves: nothing drawn)."""
    prog: BatchProgress = handle.progress(stream=sys.stderr, terminal=_err().is_terminal,
                                          interval_s=interval if show else float("inf"), quiet=not show)
    return prog


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
    """One JSON line per request, in input order (with --follow: as they finish; -o FILE.parquet: a
    Parquet file, docs/python-api.md)."""
    from lmdq.submission.progress import watch as watch_batch

    fmt = fmt.lower()
    parquet = output is not None and output.suffix.lower() in (".parquet", ".pq")
    if fmt not in ("lmdq", "openai"):
        raise typer.BadParameter(f"expected lmdq or openai, got {fmt!r}", param_hint="--format")
    if parquet and (fmt != "lmdq" or errors_file is not None or follow):
        print("error: -o FILE.parquet: expected --format lmdq, no --errors-file (the status column tells "
              "failures apart) and no --follow (a Parquet file is written once; use --wait)", file=sys.stderr)
        raise typer.Exit(2)
    if errors_file is not None and fmt != "openai":
        print("error: --errors-file: expected --format openai (lmdq records carry their status)", file=sys.stderr)
        raise typer.Exit(2)
    if errors_file is not None and output is not None and errors_file.resolve() == output.resolve():
        print(f"error: --errors-file: expected a file other than --output ({output})", file=sys.stderr)
        raise typer.Exit(2)
    if in_order and not follow:
        print("error: --in-order: expected --follow (without it results are always in input order)", file=sys.stderr)
        raise typer.Exit(2)
    handle = _lmdq().batch(batch_id)
    b = handle.last_info
    if parquet and output is not None:
        _check_writable(output)  # before any waiting, as for a JSONL -o
        out_file = err_file = None
    else:
        out_file = _open_output(output, "--output")
        err_file = _open_output(errors_file, "--errors-file")
    out = out_file or sys.stdout.buffer
    errs = err_file or out
    deadline = None if timeout is None else time.monotonic() + timeout
    # no progress when the results on a terminal are the progress, or there is nothing left to wait for
    show = (output is not None or not sys.stdout.isatty()) and not b.status.terminal
    try:
        if follow:
            def emit(is_error: bool, line: bytes) -> None:
                (errs if is_error else out).write(line)

            said: list[bool] = []
            with _progress(handle, interval, show=show) as prog:
                b = handle.follow(emit, fmt=fmt, in_order=in_order, progress=prog, deadline=deadline,
                                  on_poll=lambda: _flush(out, errs),
                                  on_retry=lambda e, d: _note_lost(e, d, said))
            _timed_out(b, batch_id, timeout)
        else:
            if wait and not b.status.terminal:
                with _progress(handle, interval, show=show) as prog:
                    b = watch_batch(lambda: _patiently(handle), prog, b, deadline=deadline,
                                    poll_s=min(0.25, interval))
                _timed_out(b, batch_id, timeout)
            if delete and not b.status.terminal:
                raise PurgeRefused(f"--delete: batch {batch_id} is {b.status.value}, its results are not all in "
                                   "yet; nothing was deleted (add --wait, or leave out --delete)")
            if parquet and output is not None:
                handle.to_parquet(output)
            else:
                for is_error, line in handle.lines(fmt):
                    (errs if is_error else out).write(line)
    finally:
        if err_file:
            err_file.close()
        if out_file:
            out_file.close()
        else:
            out.flush()
    if delete:  # only reached when every line was written: an error above leaves the batch in Redis
        done = _lmdq().purge(batch_id)
        _err().print(str(done), highlight=False, soft_wrap=True)


def _check_writable(path: Path) -> None:
    """``-o FILE.parquet`` is written at the end (a temporary file, then renamed): the path is tried
    now, so a bad one fails at once, in one line (as a JSONL ``-o``), not after the wait."""
    existed = path.exists()
    try:
        with path.open("ab"):
            pass
    except OSError as e:
        print(f"error: --output: cannot write {str(path)!r}: {e.strerror or e}", file=sys.stderr)
        raise typer.Exit(2) from e
    if not existed:
        path.unlink(missing_ok=True)


def _flush(*files: BinaryIO) -> None:
    for f in files:
        f.flush()


def _timed_out(b: Batch, batch_id: str, timeout: float | None) -> None:
    """A wait that ended before the batch did: one line, exit 1."""
    if b.status is BatchStatus.paused:
        print(f"error: batch {batch_id} is paused: a quality gate failed ({b.request_counts.done}/"
              f"{b.request_counts.total} done). `lmdq-producer status {batch_id}` shows the report; "
              f"`lmdq-producer resume {batch_id}` runs the rest, `lmdq-producer cancel {batch_id}` ends it",
              file=sys.stderr)
        raise typer.Exit(1)
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
    batches = [b.last_info for b in _lmdq().batches(limit)]
    if as_json:
        for b in batches:
            typer.echo(_redacted(b).model_dump_json())
        return
    from rich.console import Console
    from rich.measure import Measurement

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
        typer.echo(_fill([_model_field(b), *_counts(b)], width=out.width, indent="  ", sep=" "))


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
    from rich import box
    from rich.table import Table

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
        model = f"{b.model} +{len(b.models) - 1}" if b.model_counts else b.model
        table.add_row(b.id, b.status.value, model, *(str(getattr(c, k)) for k in counts),
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(b.created_at)))
    return table


@app.command()
def cancel(
    batch_id: Annotated[str, typer.Argument()],
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Remove the batch's queued jobs and abort its in-flight requests."""
    _print_batch(_lmdq().batch(batch_id).cancel(), as_json)


@app.command()
def resume(
    batch_id: Annotated[str, typer.Argument()],
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Run the rest of a paused batch (a quality gate failed): its held jobs are queued again."""
    _print_batch(_lmdq().batch(batch_id).resume(), as_json)


@app.command()
def purge(
    batch_id: Annotated[str, typer.Argument()],
    force: Annotated[bool, typer.Option(help="also a batch that has not ended: its queued jobs are dropped and "
                                             "workers abort what they hold")] = False,
) -> None:
    """Delete a batch from Redis now (record, results, jobs), instead of at its TTL; says what it deleted."""
    typer.echo(str(_lmdq().purge(batch_id, force=force)))


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
    new = _lmdq().batch(batch_id).retry(include_cancelled=include_cancelled, include_expired=include_expired,
                                        priority=priority, idempotency_key=idempotency_key)
    _print_submitted(new.last_info, new.created, as_json)


models_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings={"max_content_width": 120},
    help="Register, list and remove the models submit accepts.\n\nSubmit accepts a model an operator "
    "registered or one a worker has served. Register the deployment's model so a submit is accepted while no "
    "worker runs (autoscaling from zero replicas).",
)
app.add_typer(models_app, name="models")


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
    spell = {"names": "NAME", "note": "--note"}.__getitem__
    for name, new in zip(names, _lmdq().register_models(names, note=note, spell=spell)):
        typer.echo(f"{'registered' if new else 'already registered (updated)'}: {name}")


@models_app.command("list")
def models_list(
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per model")] = False,
) -> None:
    """List registered and worker-served models, with live workers.

    Times are ages on the Redis server's clock: `registered` is the latest `models add`, `last seen` a
    worker's latest heartbeat for the model; `workers` counts workers alive now."""
    from lmdq.submission.models import model_lines, models_table

    models, now = _lmdq().models()
    if as_json:
        for m in models:
            typer.echo(json.dumps(m.as_dict()))
        return
    if not models:
        _err().print("no models: register one with `lmdq-producer models add NAME`, or start a worker")
        return
    from rich.console import Console
    from rich.measure import Measurement

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
    removed = _lmdq().remove_model(name)
    what = " and ".join(w for w, on in (("registration", removed.registered), ("last-seen record", removed.seen))
                        if on)
    typer.echo(f"removed: {name} ({what})")
    if removed.live_workers:
        _err().print(f"note: {removed.live_workers} live worker(s) serve {name!r}: their next heartbeat "
                  "records it as served again; stop them to retire it", markup=False, highlight=False)


reuse_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings={"max_content_width": 120},
    help="The reuse index (issue 47, submit --reuse): what it holds per model, and forgetting it.\n\nA --reuse "
    "batch's greedy (or seeded) requests identical to completed ones on the same weights and engine settings are "
    "answered from their stored results; the index maps each to where its answer lives.",
)
app.add_typer(reuse_app, name="reuse")


@reuse_app.command("stats")
def reuse_stats(
    model: Annotated[str | None, typer.Option(help="one model (default: every model with an index)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per model")] = False,
) -> None:
    """Entries, Redis bytes (and per entry), lookups, hits and hit rate of each model's reuse index."""
    stats = _lmdq().reuse_stats(model)
    if as_json:
        for st in stats:
            typer.echo(json.dumps(st.as_dict()))
        return
    if not stats:
        _err().print("no reuse index: submit a batch with --reuse")
        return
    for st in stats:
        rate = "n/a" if st.hit_rate is None else f"{st.hit_rate:.1%}"
        per = "n/a" if st.bytes_per_entry is None else f"{st.bytes_per_entry:.1f}"
        _echo_fit(f"model={st.model}  entries={st.entries:,}  bytes={st.bytes:,}  bytes/entry={per}  "
                  f"lookups={st.lookups:,}  hits={st.hits:,}  hit_rate={rate}")


@reuse_app.command("purge")
def reuse_purge(
    model: Annotated[str, typer.Option(help="the served model name whose reusable answers to forget")],
) -> None:
    """Forget every reusable answer of a model (its batches and their results stay): later batches recompute."""
    n = _lmdq().purge_reuse(model)
    typer.echo(f"purged the reuse index of {model}: {n:,} entries")


@app.command("webhook-secret")
def webhook_secret(
    tenant: Annotated[str, typer.Option(help="whose secret (the HTTP API's tenant; submits name 'default')")] =
    "default",
    rotate: Annotated[bool, typer.Option(help="make a new secret: events are signed with it from now on")] = False,
) -> None:
    """Print the secret (whsec_...) that signs this tenant's webhook events, making it if there is none
    (docs/webhooks.md: verifying a request). The one place lmdq shows it: never logged."""
    typer.echo(_lmdq().webhook_secret(tenant, rotate=rotate))


@app.command()
@model_options(EXPORTER_FLAGS, into="flags")
def exporter(flags: dict[str, Any]) -> None:
    """Serve queue metrics (depth, running jobs, live workers, batches per model) on /metrics for
    Prometheus, read from Redis every --interval-s by one collector (scrapes never wait on Redis). Run
    ONE per Redis: it needs no GPU and works at zero workers (deploy/base/exporter.yaml)."""
    from lmdq.logs.config import configure_logging
    from lmdq.metrics.exporter import load_settings, run

    s = _lmdq().settings
    configure_logging(s.log_format, s.log_level)  # not deferred: the exporter logs through structlog itself
    run(load_settings(**flags, redis_url=s.redis_url))


def main() -> None:
    # A CLI run streams Parquet/CSV a record batch at a time: pyarrow's system allocator hands freed
    # batches back, its default (mimalloc) keeps them, ~40 MB more peak RSS over 1 M rows. Set before
    # anything imports pyarrow; an explicit ARROW_DEFAULT_MEMORY_POOL wins.
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    run_cli(app)


_ = BatchStatus  # re-exported for type checkers of callers
