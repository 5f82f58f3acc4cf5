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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from lmdq.contract import MAX_JOB_REQUESTS, GenerationParams, Priority
from lmdq.errors import SubmitRejected
from lmdq.flags import FlagSpec, option_name
from lmdq.logs.redaction import redact_url
from lmdq.settings import DEFAULT_RESULT_TTL_S, default_of
from lmdq.submission.settings import ProducerSettings

__all__ = [
    "BatchOptions",
    "GENERATION_FLAGS",
    "GROUPING_FLAGS",
    "SUBMIT_FLAGS",
    "Spell",
    "option_names",
    "parse_duration",
    "parse_window",
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

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

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
    "result_ttl": (str, None),
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


def option_names() -> set[str]:
    """Every keyword :meth:`lmdq.Client.submit` takes as an option (each one flag of the CLI)."""
    return {s.key for s in (*SUBMIT_FLAGS, *GENERATION_FLAGS, *GROUPING_FLAGS)}


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
            raise SubmitRejected(f"{name}: expected e.g. 7d, 24h, 90m, 3600; got {value!r}") from e
    if not v > 0:
        raise SubmitRejected(f"{name}: expected a positive duration, got {value!r}")
    return v


def parse_window(value: str | float | None, name: str) -> float | None:
    """``completion_window`` as text takes a unit (``24h``, as OpenAI's ``completion_window``): a bare
    ``2`` could mean 2 hours as easily as 2 seconds, and a window that is silently 2 s expires everything.
    A number from Python is seconds (its type says so)."""
    if isinstance(value, str) and value.strip() and value.strip()[-1:] not in ("s", "m", "h", "d"):
        raise SubmitRejected(f"{name}: expected a duration with its unit (e.g. 24h, 90m, 2d, 3600s), got {value!r}")
    return parse_duration(value, name)


def _check_url(url: str | None, name: str) -> str | None:
    """A results/blob URL: a folder (made absolute: workers may run elsewhere but share it) or s3://."""
    if not url:
        return None
    if "://" in url:
        scheme = url.split("://", 1)[0]
        if scheme not in ("file", "s3", "s3a"):
            raise SubmitRejected(f"{name}: expected a folder, file:// or s3:// URL, got {redact_url(url)!r}")
        return url.rstrip("/")
    return str(Path(url).expanduser().resolve())


def _sink_url(given: str | None, cluster: str | None, spell: Spell) -> str | None:
    """``results_url`` wins over LMDQ_RESULTS_URL (already None when set to ``none``); ``none`` keeps this
    batch's results in Redis although the cluster has a sink."""
    if given is not None:
        return None if given.strip().lower() in ("", "none") else _check_url(given, spell("results_url"))
    return _check_url(cluster, "LMDQ_RESULTS_URL")


def _first_error(e: ValidationError, spell: Spell) -> SubmitRejected:
    first = e.errors(include_url=False)[0]
    where = spell(str(first["loc"][0])) if first["loc"] else "options"
    return SubmitRejected(f"{where}: {first['msg'].removeprefix('Value error, ')}")


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

    unknown = set(given) - option_names()
    if unknown:
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
            raise SubmitRejected(f"{spell(which)}: {e}") from e
    grouping: dict[str, Any] = {}
    for name in ("prefix_groups", "prefix_group_bytes"):
        info = ProducerSettings.model_fields[name]
        if name in values:
            try:
                adapter: TypeAdapter[Any] = TypeAdapter(Annotated[info.annotation, info])  # type: ignore[arg-type]
                grouping[name] = adapter.validate_python(values[name])
            except ValidationError as e:
                raise SubmitRejected(f"{spell(name)}: {e.errors()[0]['msg']}") from None
        else:
            grouping[name] = getattr(settings, name)
    window_s = parse_window(b.completion_window, spell("completion_window"))
    ttl = parse_duration(b.result_ttl, spell("result_ttl"))
    ttl_s = settings.result_ttl_s if ttl is None else int(ttl)
    # every key of the batch expires this long after the batch ENDS (lmdq.results.store): any TTL covers the run,
    # however long it takes or its completion window is
    if ttl_s < 60:
        raise SubmitRejected(f"{spell('result_ttl')}: expected at least 60 seconds, got {b.result_ttl!r}")
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
    )
    return opts, ttl_s


def cli_spell(name: str) -> str:
    """An option as the CLI names it (a bool flag with its negative spelling: ``--do-sample/--greedy``)."""
    negative = [a.strip(" /") for a in _GENERATION_ALIASES.get(name, ()) if a.startswith(" /")]
    return option_name(name) + (f"/{negative[0]}" if negative else "")
