"""Submit's options, declared once: :meth:`lmdq.Client.submit` takes them as keywords and
``lmdq-producer submit`` derives its flags from the same declarations (:data:`SUBMIT_FLAGS`).

Three groups, each with one home:

* the batch's own options (:class:`BatchOptions`, here: batch size, priority, metadata,
  idempotency key, results URL, TTL, completion window, guided-decoding shorthands ...);
* the generation parameters (:class:`lmdq.contract.GenerationParams`, one keyword or flag per field);
* job formation (``prefix_groups``, ``prefix_group_bytes``: :class:`ProducerSettings` fields, whose
  ``LMDQ_*`` values are the defaults).

:func:`resolve` turns the values a caller gave into what the submit pipeline takes
(:class:`lmdq.submission.submit.SubmitOptions` and the TTL), with every rule the CLI had: one of
``json_schema`` / ``regex`` / ``response_format``, a TTL of at least a minute that covers the
completion window, results/blob URLs made absolute. A bad value raises :class:`SubmitRejected`
(exit 2) naming the option as the caller spells it (``--result-ttl`` on the command line,
``result_ttl`` from Python).
"""

from __future__ import annotations

import json
import textwrap
import types
from collections.abc import Callable, Mapping
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from lmdq.contract import MAX_JOB_REQUESTS, MAX_REUSE_TTL_S, GenerationParams, Priority
from lmdq.errors import InputProblem, SubmitRejected
from lmdq.flags import FlagSpec, option_name
from lmdq.logs.redaction import redact_url
from lmdq.settings import DEFAULT_RESULT_TTL_S, default_of
from lmdq.submission.settings import ProducerSettings
from lmdq.webhooks.allow import AllowList, WebhookRefused

__all__ = [
    "BatchOptions",
    "GENERATION_FLAGS",
    "GROUPING_FLAGS",
    "SUBMIT_FLAGS",
    "Spell",
    "option_fields",
    "option_names",
    "parse_deadline",
    "parse_duration",
    "parse_window",
    "render_submit_kwargs",
    "resolve",
]

#: How an option is named in a message: ``--result-ttl`` for the CLI, ``result_ttl`` for Python.
Spell = Callable[[str], str]


def _python_name(name: str) -> str:
    return name


def _days(seconds: int) -> str:
    """``604800`` → ``7 days`` (a default in help text, from its declaration)."""
    return f"{seconds // 86400} days" if seconds % 86400 == 0 else f"{seconds} s"


_BATCH_SIZE = default_of(ProducerSettings, "batch_size")


class BatchOptions(BaseModel):
    """The batch's options (besides the model and the generation parameters). Unset is None: the
    producer's settings (``LMDQ_*``) decide then."""

    # defer_build: built by the first submit, not at import (--help reads the fields only; issue 49)
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, defer_build=True)

    batch_size: Annotated[int, Field(ge=1, le=MAX_JOB_REQUESTS)] | None = Field(
        default=None, description=f"requests per job (default LMDQ_BATCH_SIZE, {_BATCH_SIZE})")
    priority: Priority = Field(default=Priority.normal, description="queue priority")
    metadata: dict[str, str] | None = Field(default=None, description="k=v, repeatable")
    json_schema: dict[str, Any] | None = Field(
        default=None, description="constrain every answer to this JSON schema (a .json file); shorthand for "
        "--response-format")
    regex: str | None = Field(default=None, description="constrain every answer to this regex; shorthand for "
                              "--response-format")
    idempotency_key: str | None = Field(default=None, description="same key → same batch, never enqueued twice")
    completion_window: str | float | None = Field(
        default=None, description="with its unit, e.g. 24h, 90m, 2d: requests not started by then expire")
    deadline: str | float | None = Field(
        default=None, description="when the batch should be done, ISO 8601 with its zone (2026-12-06T07:00Z) or "
        "Unix time: claimed earliest-deadline-first, the fleet sized for it, a warning once it is projected to miss")
    allow_unknown_model: bool = Field(
        default=False, description="queue even if MODEL is neither registered (`models add`) nor served by a worker")
    results_url: str | None = Field(
        default=None, description="folder or s3://bucket/prefix: full results go to JSONL shards there, Redis "
        "keeps counts and a small index (default LMDQ_RESULTS_URL; 'none': results stay in Redis)")
    result_ttl: str | float | None = Field(
        default=None, description="how long the batch and its results are kept once it has ENDED: e.g. 7d, "
        f"12h, 3600 (default LMDQ_RESULT_TTL_S, {_days(DEFAULT_RESULT_TTL_S)})")
    blob_url: str | None = Field(
        default=None, description="folder or s3://bucket/prefix for tensors (default: the worker's LMDQ_BLOB_URL)")
    canary: str | float | None = Field(
        default=None, description="run a sample spread over the file first, e.g. 2% or 50 (requests); the rest "
        "runs only if it passes the quality gates, else the batch is paused (docs/plan-deadline-canary.md)")
    gate: list[str] | None = Field(
        default=None, description="a quality gate KEY=VALUE, repeatable: failed=0.1 empty=0.1 length=0.5 json=0 "
        "(shares of results allowed to fail), match=REGEX, not-match=REGEX, regex=0, tokens=MIN..MAX (mean)")
    gate_window: Annotated[int, Field(ge=1, le=100_000)] | None = Field(
        default=None, description="judge the gates on every N newest results while the batch runs: a batch "
        "that goes bad part-way is paused")
    reuse: bool | None = Field(
        default=None, description="never pay twice: a greedy (or seeded, where the engine repeats seeds) request "
        "identical to one already completed on the same weights and engine settings is answered from its stored "
        "result (reused_from says which), and this batch's answers are kept for later batches (default LMDQ_REUSE, "
        "off)")
    reuse_ttl: str | float | None = Field(
        default=None, description="with reuse: how long this batch's answers stay reusable, e.g. 30d, 12h "
        f"(default LMDQ_REUSE_TTL_S, {_days(default_of(ProducerSettings, 'reuse_ttl_s'))})")
    webhook: str | None = Field(
        default=None, description="http(s) URL sent a signed POST when the batch ends or pauses (batch.completed, "
        "batch.failed, batch.expired, batch.cancelled, batch.paused; docs/webhooks.md); must be in "
        "LMDQ_WEBHOOK_ALLOW")


def _parse_metadata(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for it in items:
        if "=" not in it:
            raise SubmitRejected(f"--metadata: expected k=v, got {it!r}")
        k, v = it.split("=", 1)
        out[k] = v
    return out


def _read_schema(path: Path) -> dict[str, Any]:
    try:
        schema = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deeply to parse
        raise SubmitRejected(f"--json-schema: {path}: expected a readable JSON file ({e})") from e
    if not isinstance(schema, dict):
        raise SubmitRejected(f"--json-schema: {path}: expected a JSON object (a schema)")
    return schema


_CLI_TYPES: dict[str, tuple[Any, Callable[[Any], Any] | None]] = {
    "metadata": (list[str], _parse_metadata),
    "json_schema": (Path, _read_schema),
    "completion_window": (str, None),
    "deadline": (str, None),
    "result_ttl": (str, None),
    "canary": (str, None),
    "gate": (list[str], None),
    "reuse_ttl": (str, None),
}

#: Second spellings of some generation flags beside the derived ``--<field>``: the OpenAI API's names
#: (``--seed``, ``--stop``), the singular of a repeated flag, and the negative of a bool in words (``--greedy``).
_GENERATION_ALIASES: dict[str, tuple[str, ...]] = {
    "random_seed": ("--seed",),
    "stop_words": ("--stop",),
    "stop_token_ids": ("--stop-token-id",),
    "do_sample": (" /--greedy",),
    "skip_special_tokens": (" /--keep-special-tokens",),
}
#: One flag per GenerationParams field (name, type, help from its declaration in src/lmdq/contract.py).
GENERATION_FLAGS = [FlagSpec(key=name, flat=name, info=info, aliases=_GENERATION_ALIASES.get(name, ()))
                    for name, info in GenerationParams.model_fields.items()]
#: Job formation flags (--prefix-groups/--no-prefix-groups, --prefix-group-bytes), from ProducerSettings.
GROUPING_FLAGS = [FlagSpec(key=name, flat=name, info=ProducerSettings.model_fields[name])
                  for name in ("prefix_groups", "prefix_group_bytes")]
#: One flag per BatchOptions field.
SUBMIT_FLAGS = [FlagSpec(key=name, flat=name, info=info, cli_type=_CLI_TYPES.get(name, (None, None))[0],
                         parse=_CLI_TYPES.get(name, (None, None))[1])
                for name, info in BatchOptions.model_fields.items()]


def option_aliases() -> dict[str, str]:
    """The OpenAI / LMDeploy names a file's params accept (``max_tokens``, ``seed``, ``stop``), taken by
    ``submit`` too: alias -> the option it sets. One table, the file formats'
    (:data:`lmdq.submission.formats.jsonl.PARAM_ALIASES`)."""
    from lmdq.submission.formats.jsonl import PARAM_ALIASES

    keys = {s.key for s in (*SUBMIT_FLAGS, *GENERATION_FLAGS, *GROUPING_FLAGS)}
    return {alias: name for alias, name in PARAM_ALIASES.items() if name in keys and alias not in keys}


def option_names() -> set[str]:
    """Every keyword :meth:`lmdq.Client.submit` takes as an option (each one flag of the CLI), and the
    aliases a file's params take (:func:`option_aliases`)."""
    return {s.key for s in (*SUBMIT_FLAGS, *GENERATION_FLAGS, *GROUPING_FLAGS)} | set(option_aliases())


def option_fields() -> dict[str, FieldInfo]:
    """Each option's declaration (its type, constraints and help), in the order the groups above list them."""
    return {s.key: s.info for s in (*SUBMIT_FLAGS, *GENERATION_FLAGS, *GROUPING_FLAGS)}


SUBMIT_KWARGS_PATH = Path(__file__).with_name("submit_kwargs.py")
"""The generated :class:`lmdq.client.submit_kwargs.SubmitKwargs` (a TypedDict mypy and IDEs read)."""


def _type_source(tp: Any, imports: set[type]) -> list[str]:
    """The members of the union a caller may pass for ``tp``, as Python source (constraints are checked at
    run time; a type checker sees the types). An enum also takes its values, a model its dict."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is type(None):
        return ["None"]
    if tp is Any:
        return ["Any"]
    if origin is Annotated:
        return _type_source(args[0], imports)
    if origin in (Union, types.UnionType):
        return [m for a in args for m in _type_source(a, imports)]
    if origin is Literal:
        return [f"Literal[{', '.join(repr(a) for a in args)}]"]
    if origin in (list, dict, tuple):
        return [f"{origin.__name__}[{', '.join(' | '.join(_type_source(a, imports)) for a in args)}]"]
    if isinstance(tp, type) and issubclass(tp, Enum):
        imports.add(tp)
        return [tp.__name__, f"Literal[{', '.join(repr(m.value) for m in tp)}]"]
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        imports.add(tp)
        return [tp.__name__, "dict[str, Any]"]
    if tp in (bool, int, float, str):
        return [tp.__name__]
    raise TypeError(f"no source form for the option type {tp!r}: teach options._type_source it")


def render_submit_kwargs() -> str:
    """The source of ``submit_kwargs.py``: one TypedDict key per option, typed from its declaration
    (BatchOptions, GenerationParams, ProducerSettings); every option also takes None (unset).
    ``tests/test_client_typing.py`` checks the committed file is this text;
    ``python -m lmdq.client.options`` rewrites it."""
    imports: set[type] = set()
    body: list[str] = []
    for name, info in option_fields().items():
        members = list(dict.fromkeys([*_type_source(info.annotation, imports), "None"]))
        if info.description:
            body.extend(textwrap.wrap(info.description, 112, initial_indent="    #: ", subsequent_indent="    #: "))
        body.append(f"    {name}: {' | '.join(members)}")
    fields = option_fields()
    for alias, name in sorted(option_aliases().items()):
        members = list(dict.fromkeys([*_type_source(fields[name].annotation, imports), "None"]))
        body.append(f"    #: the same as {name} (its name in OpenAI and LMDeploy, as a file's params take it)")
        body.append(f"    {alias}: {' | '.join(members)}")
    from_contract = sorted(t.__name__ for t in imports if t.__module__ == "lmdq.contract")
    if any(t.__module__ != "lmdq.contract" for t in imports):
        raise TypeError(f"option types outside lmdq.contract: {sorted(map(repr, imports))}")
    head = [
        '"""GENERATED by ``python -m lmdq.client.options`` from the options\' declarations',
        "(:mod:`lmdq.client.options`): do not edit. ``Client.submit(**options: Unpack[SubmitKwargs])`` lets",
        'mypy and IDEs check each option\'s name and type in the caller\'s code."""',
        "",
        "from __future__ import annotations",
        "",
        "from typing import Any, Literal, TypedDict",
        "",
        f"from lmdq.contract import {', '.join(from_contract)}",
        "",
        '__all__ = ["SubmitKwargs"]',
        "",
        "",
        "class SubmitKwargs(TypedDict, total=False):",
        '    """``lmdq.Client.submit``\'s options (``lmdq-producer submit``\'s flags by their Python names); all',
        '    optional, None meaning unset (the producer\'s ``LMDQ_*`` settings or the engine decide)."""',
        "",
    ]
    return "\n".join([*head, *body]) + "\n"


def parse_duration(value: str | float | None, name: str) -> float | None:
    """``24h``, ``90m``, ``7d``, ``30s`` or plain seconds (a number from Python); None when not given."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        v = float(value)
    else:
        s = str(value).strip()
        units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
        try:
            v = float(s[:-1]) * units[s[-1]] if s and s[-1] in units else float(s)
        except ValueError as e:
            raise _rejected(name, f"expected e.g. 7d, 24h, 90m, 3600; got {value!r}", value) from e
    if not v > 0:
        raise _rejected(name, f"expected a positive duration, got {value!r}", value)
    return v


def parse_deadline(value: str | float | None, name: str, *, now: float | None = None) -> float | None:
    """``--deadline`` / ``deadline=`` as Unix time (:func:`lmdq.plan.deadlines.parse_deadline`); a bad one
    is SubmitRejected naming the option."""
    from lmdq.plan.deadlines import parse_deadline as parse

    try:
        return parse(value, now=now)
    except ValueError as e:
        raise _rejected(name, str(e), value) from None


def parse_window(value: str | float | None, name: str) -> float | None:
    """``completion_window`` as text takes a unit (``24h``, as OpenAI's ``completion_window``): a bare
    ``2`` could mean 2 hours as easily as 2 seconds, and a window that is silently 2 s expires everything.
    A number from Python is seconds (its type says so)."""
    if isinstance(value, str) and value.strip() and value.strip()[-1:] not in ("s", "m", "h", "d"):
        raise _rejected(name, f"expected a duration with its unit (e.g. 24h, 90m, 2d, 3600s), got {value!r}", value)
    return parse_duration(value, name)


def _check_url(url: str | None, name: str) -> str | None:
    """A results/blob URL: a folder (made absolute: workers may run elsewhere but share it) or s3://."""
    if not url:
        return None
    if "://" in url:
        scheme = url.split("://", 1)[0]
        if scheme not in ("file", "s3", "s3a"):
            raise _rejected(name, f"expected a folder, file:// or s3:// URL, got {redact_url(url)!r}", redact_url(url))
        return url.rstrip("/")
    return str(Path(url).expanduser().resolve())


def _sink_url(given: str | None, cluster: str | None, spell: Spell) -> str | None:
    """``results_url`` wins over LMDQ_RESULTS_URL (already None when set to ``none``); ``none`` keeps this
    batch's results in Redis although the cluster has a sink."""
    if given is not None:
        return None if given.strip().lower() in ("", "none") else _check_url(given, spell("results_url"))
    return _check_url(cluster, "LMDQ_RESULTS_URL")


def _webhook(url: str | None, allow: str, spell: Spell) -> str | None:
    """The batch's webhook, refused in one line unless LMDQ_WEBHOOK_ALLOW admits it (lmdq.webhooks.allow)."""
    if not url:
        return None
    try:
        return AllowList(allow).check(url)
    except WebhookRefused as e:
        raise _rejected(spell("webhook"), str(e), redact_url(url)) from e


def _python_option(spelled: str) -> str:
    """``--result-ttl`` / ``--do-sample/--greedy`` / ``result_ttl`` → ``result_ttl``."""
    return spelled.split("/", 1)[0].removeprefix("--").replace("-", "_") if spelled.startswith("--") else spelled


def _rejected(where: str, message: str, value: Any = None) -> SubmitRejected:
    """An option's bad value: ``where: message`` as text, the option (Python name) and value as data."""
    return SubmitRejected(f"{where}: {message}",
                          problems=[InputProblem(message=message, field=_python_option(where), value=value)])


def _first_error(e: ValidationError, spell: Spell) -> SubmitRejected:
    first = e.errors(include_url=False)[0]
    where = spell(str(first["loc"][0])) if first["loc"] else "options"
    return _rejected(where, first["msg"].removeprefix("Value error, "), first.get("input"))


def resolve(
    given: Mapping[str, Any], settings: ProducerSettings, *, model: str | None, spell: Spell = _python_name,
    on_note: Callable[[str], None] | None = None, on_warning: Callable[[str], None] | None = None,
) -> tuple[Any, int]:
    """(SubmitOptions, ttl_s) from the options a caller gave (unset ones absent or None).

    An unknown option raises TypeError, like any unknown keyword; a bad value SubmitRejected."""
    from lmdq.guided import check as check_response_format
    from lmdq.submission.formats import InputLimits
    from lmdq.submission.formats.records import Sampling
    from lmdq.submission.formats.validation import imply_sampling
    from lmdq.submission.submit import SubmitOptions

    given = dict(given)
    for alias, name in option_aliases().items():
        if given.get(alias) is not None:
            if given.get(name) is not None:
                raise SubmitRejected(f"{spell(alias)}: the same option as {spell(name)}; pass only one of them")
            given[name] = given.pop(alias)
        else:
            given.pop(alias, None)
    unknown = set(given) - option_names()
    if unknown:
        if unknown <= set(_lmdeploy_defaults()):  # submit(**asdict(gen_config)): say what takes it (issue 45)
            raise TypeError(f"submit() got LMDeploy GenerationConfig fields as keywords {sorted(unknown)}; pass the "
                            "config itself: gen_config=GenerationConfig(...) or gen_config=dataclasses.asdict(...)")
        raise TypeError(f"submit() got unexpected option(s) {sorted(unknown)}; expected some of "
                        f"{sorted(option_names())}")
    values = {k: v for k, v in given.items() if v is not None}
    batch_fields = {k: v for k, v in values.items() if k in BatchOptions.model_fields}
    try:
        b = BatchOptions.model_validate(batch_fields)
    except ValidationError as e:
        raise _first_error(e, spell) from None
    raw = {k: v for k, v in values.items() if k in GenerationParams.model_fields}
    if sum(x is not None for x in (b.json_schema, b.regex, raw.get("response_format"))) > 1:
        raise SubmitRejected(f"{spell('json_schema')}, {spell('regex')} and {spell('response_format')}: "
                             "pass one of them")
    if b.json_schema is not None:
        name = str(b.json_schema.get("title") or "schema")
        raw["response_format"] = {"type": "json_schema", "json_schema": {"name": name, "schema": b.json_schema}}
    elif b.regex is not None:
        raw["response_format"] = {"type": "regex", "regex": b.regex}
    if imply_sampling(raw) is Sampling.implied and on_note is not None:  # the same rule as a file's params
        on_note(f"{spell('temperature')} {raw['temperature']} without {spell('do_sample')}: "
                f"{'sampling' if raw['do_sample'] else 'greedy'} (temperature > 0 samples)")
    try:
        params = GenerationParams.model_validate(raw)
    except ValidationError as e:
        raise _first_error(e, spell) from None
    if params.response_format is not None:
        try:
            check_response_format(params.response_format)
        except ValueError as e:
            which = ("json_schema" if b.json_schema is not None else "regex" if b.regex is not None
                     else "response_format")
            raise _rejected(spell(which), str(e), getattr(b, which, None) if which != "response_format"
                                else raw.get("response_format")) from e
    grouping: dict[str, Any] = {}
    for name in ("prefix_groups", "prefix_group_bytes"):
        info = ProducerSettings.model_fields[name]
        if name in values:
            try:
                adapter: TypeAdapter[Any] = TypeAdapter(Annotated[info.annotation, info])  # type: ignore[arg-type]
                grouping[name] = adapter.validate_python(values[name])
            except ValidationError as e:
                raise _rejected(spell(name), e.errors()[0]["msg"], values[name]) from None
        else:
            grouping[name] = getattr(settings, name)
    gates = _gates(b, spell)
    window_s = parse_window(b.completion_window, spell("completion_window"))
    deadline = parse_deadline(b.deadline, spell("deadline"))
    ttl = parse_duration(b.result_ttl, spell("result_ttl"))
    ttl_s = settings.result_ttl_s if ttl is None else int(ttl)
    # every key of the batch expires this long after the batch ENDS (lmdq.results.store): any TTL covers the run,
    # however long it takes or its completion window is
    if ttl_s < 60:
        given_ttl = values.get("result_ttl", b.result_ttl)  # as the caller wrote it (5, not pydantic's 5.0)
        raise _rejected(spell("result_ttl"), f"expected at least 60 seconds, got {given_ttl!r}", given_ttl)
    reuse = settings.reuse if b.reuse is None else b.reuse
    reuse_ttl = parse_duration(b.reuse_ttl, spell("reuse_ttl"))
    reuse_ttl_s = settings.reuse_ttl_s if reuse_ttl is None else int(reuse_ttl)
    if not 60 <= reuse_ttl_s <= MAX_REUSE_TTL_S:
        raise _rejected(spell("reuse_ttl"), f"expected 60 seconds to {MAX_REUSE_TTL_S // 86400} days, got "
                        f"{values.get('reuse_ttl', reuse_ttl_s)!r}", values.get("reuse_ttl", reuse_ttl_s))
    opts = SubmitOptions(
        model=model,
        batch_size=b.batch_size or settings.batch_size,
        params=params,
        priority=b.priority,
        metadata=dict(b.metadata or {}),
        idempotency_key=b.idempotency_key,
        completion_window_s=window_s,
        allow_unknown_model=b.allow_unknown_model,
        known_models=settings.known_models,
        limits=InputLimits.of(settings),
        results_url=_sink_url(b.results_url, settings.results_url, spell),
        blob_url=_check_url(b.blob_url, spell("blob_url")),
        prefix_groups=grouping["prefix_groups"],
        prefix_group_bytes=grouping["prefix_group_bytes"],
        memory_fraction=settings.memory_headroom_fraction,
        on_warning=on_warning,
        gates=gates,
        reuse_ttl_s=reuse_ttl_s if reuse else None,
        webhook=_webhook(b.webhook, settings.webhook_allow, spell),
    )
    opts.deadline = deadline
    if gates is not None and gates.canary is not None:
        opts.first_jobs = None  # the canary is spread over the whole file: it is staged before anything runs
    return opts, ttl_s


def _gates(b: BatchOptions, spell: Spell) -> Any:
    """The batch's GateConfig (lmdq.gates.config) from ``canary`` / ``gate`` / ``gate_window``; None without."""
    from lmdq.gates.config import from_options

    try:
        return from_options(b.canary, b.gate, b.gate_window)
    except ValueError as e:
        which = "canary" if str(e).startswith("--canary") else "gate"
        msg = str(e).split(": ", 1)[-1].replace("--canary", spell("canary")).replace("--gate-window",
                                                                                   spell("gate_window"))
        raise _rejected(spell(which), msg, getattr(b, which)) from None


#: keywords whose CLI flag is not ``--`` + the keyword with dashes
_CLI_FLAGS = {"params_columns": "--params-column"}


def cli_spell(name: str) -> str:
    """An option as the CLI names it (a bool flag with its negative spelling: ``--do-sample/--greedy``)."""
    if name in _CLI_FLAGS:
        return _CLI_FLAGS[name]
    negative = [a.strip(" /") for a in _GENERATION_ALIASES.get(name, ()) if a.startswith(" /")]
    return option_name(name) + (f"/{negative[0]}" if negative else "")


if __name__ == "__main__":  # rewrite submit_kwargs.py after an option's declaration changed
    SUBMIT_KWARGS_PATH.write_text(render_submit_kwargs())
    print(f"wrote {SUBMIT_KWARGS_PATH}")


def _lmdeploy_defaults() -> dict[str, Any]:
    """LMDeploy's ``GenerationConfig()`` field values, or nothing where LMDeploy is not installed."""
    import dataclasses

    try:
        from lmdeploy import GenerationConfig
    except Exception:  # not installed (a CPU-only client), or broken: every field counts as given
        return {}
    fresh = GenerationConfig()
    return {f.name: getattr(fresh, f.name) for f in dataclasses.fields(fresh)}


def from_gen_config(gen_config: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` with the fields of an LMDeploy ``GenerationConfig`` (or a dict of its fields) added as
    submit options (issue 45: LMDeploy users pass ``gen_config=``). A dataclass's fields still at their
    defaults are not passed (lmdq's own defaults apply, as documented); every other field must be an
    option lmdq has, else InvalidArgument naming it; a field also given as a keyword is refused by name."""
    import dataclasses

    from lmdq.errors import InvalidArgument

    if isinstance(gen_config, Mapping):
        # a dict of the fields (``dataclasses.asdict(gen_config)``, issue 45): those at LMDeploy's defaults are
        # not passed either, where LMDeploy is installed to say what its defaults are
        items, defaults = dict(gen_config), _lmdeploy_defaults()
    elif dataclasses.is_dataclass(gen_config) and not isinstance(gen_config, type):
        items = {f.name: getattr(gen_config, f.name) for f in dataclasses.fields(gen_config)}
        try:
            fresh = type(gen_config)()
            defaults = {k: getattr(fresh, k) for k in items}
        except TypeError:  # a class without defaults for every field: everything is given
            defaults = {}
    else:
        raise InvalidArgument(f"gen_config: expected LMDeploy's GenerationConfig or a dict of its fields, got "
                              f"{type(gen_config).__name__}", field="gen_config", value=gen_config)
    params = set(GenerationParams.model_fields) | set(option_aliases())
    out = dict(given)
    for key, value in items.items():
        if key in defaults and value == defaults[key]:
            continue
        if key not in params:
            raise InvalidArgument(f"gen_config.{key}: lmdq does not support this GenerationConfig field (it "
                                  f"supports {', '.join(sorted(GenerationParams.model_fields))})",
                                  field=f"gen_config.{key}", value=value)
        if out.get(key) is not None:
            raise InvalidArgument(f"gen_config.{key}: also given as {key}=; pass it once",
                                  field=f"gen_config.{key}", value=value)
        out[key] = value
    return out
