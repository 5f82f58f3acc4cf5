"""Streaming parsers for prompt files: plain text, lmdq JSONL and OpenAI Batch JSONL.

Prompt files can be many GB, so everything here streams: the file is read in binary one line at a
time through bounded ``readline`` calls, an over-long line is skipped chunk by chunk (never held
whole), and each line is decoded, parsed and validated on its own.  A bad line becomes an
:class:`InputError` naming ``file:line`` and the offending field, and parsing carries on, so the
caller can show the first N problems of a file in one go instead of one per run.

Formats (see :func:`detect_format`):

* ``text`` (``*.txt``): one prompt per line, chat endpoint.
* ``jsonl``: ``{"custom_id", "prompt" | "messages", "params", "endpoint"}`` objects.
* ``openai``: OpenAI Batch API lines ``{"custom_id", "method", "url", "body"}``.

Decisions worth knowing:

* ``custom_id`` defaults to the 1-based line number; JSON integers are accepted and turned into
  strings (``7`` -> ``"7"``); booleans, floats and empty strings are refused.
* ``null`` means "absent" for every optional key.
* Values are checked strictly: ``"temperature": "0.7"`` is an error, not silently coerced.
* An empty ``prompt`` string is refused (a model given nothing is almost always a file bug).
* Whitespace-only lines are blank: skipped, but still counted for line numbers.
* A UTF-8 byte-order mark at the start of the file is ignored.
* OpenAI lines without ``temperature`` keep the batch default (lmdq's default is greedy), unlike
  OpenAI's own default of 1.0; ``temperature`` > 0 turns sampling on, 0 means greedy.
* OpenAI ``logprobs``: chat ``logprobs: true`` maps to ``max(top_logprobs, 1)`` (1 when no count);
  completions ``logprobs: N`` maps to ``max(N, 1)``; lmdq always includes the chosen token.
* OpenAI ``response_format`` (chat): ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict", "description"}}``, ``{"type": "json_object"}``, LMDeploy's ``{"type": "regex_schema",
  "regex_schema": "..."}``, or ``{"type": "text"}`` (no constraint). Any ``response_format`` (also
  lmdq JSONL ``params.response_format``) is checked by :func:`lmdq.guided.check`: compiled with
  xgrammar when the producer has it, else a meta-schema / ``re`` check (see that module).
* ``output_logits`` / ``output_last_hidden_state`` ``'all'`` can't be checked here: LMDeploy refuses
  them with prefix caching on, which only the worker knows; such a worker fails the request with
  ``unsupported_feature``.
* Duplicate ``custom_id`` values are NOT checked here (the caller does that over the whole file).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import IO, Annotated, Any, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from lmdq.contract import ChatMessage, Endpoint, GenerationParams, Request
from lmdq.guided import check as check_response_format

__all__ = ["InputError", "InputFormat", "InputLimits", "ParsedLine", "detect_format", "iter_lines"]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _stdlib_loads(data: bytes | str) -> Any:
    """Stdlib fallback; refuses NaN/Infinity like orjson so both give the same answers."""
    return json.loads(data, parse_constant=_reject_constant)


_loads: Callable[[bytes | str], Any]
try:  # orjson is ~2x faster than the stdlib parser here
    import orjson

    _loads = orjson.loads
except ImportError:  # pragma: no cover - exercised only where orjson is absent
    _loads = _stdlib_loads


class InputFormat(str, Enum):
    """The three prompt-file formats lmdq reads."""

    text = "text"
    jsonl = "jsonl"
    openai = "openai"


@dataclass(frozen=True)
class InputLimits:
    """Per-file guards so one bad file cannot exhaust producer memory or Redis."""

    max_line_bytes: int = 10 * 1024 * 1024
    max_requests: int = 10_000_000


@dataclass(frozen=True)
class InputError:
    """One problem in a prompt file; ``line`` is 1-based, 0 for whole-file problems."""

    path: str
    line: int
    field: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line > 0 else self.path
        if self.field:
            return f"{where}: field '{self.field}': {self.message}"
        return f"{where}: {self.message}"


@dataclass(frozen=True)
class ParsedLine:
    """One valid request line; ``messages`` are the file's own dicts, already checked."""

    line_no: int
    custom_id: str
    prompt: str | None
    messages: list[dict] | None
    endpoint: Endpoint
    params: GenerationParams | None
    model: str | None


# --------------------------------------------------------------------------------------------
# Limits and vocabularies taken from the contract, so the parser cannot drift from the wire format.


def _annotated_metadata(info: FieldInfo) -> tuple[type | None, list[Any]]:
    """The base type and constraint objects of a field declared as ``Annotated[T, Field(...)] | None``."""
    base: type | None = None
    metas: list[Any] = list(info.metadata)
    for arg in (info.annotation, *get_args(info.annotation)):
        if get_origin(arg) is Annotated:
            base, *extra = get_args(arg)
            for m in extra:
                metas.extend(m.metadata if isinstance(m, FieldInfo) else [m])
        elif arg in (int, float, str, bool) and base is None:
            base = arg
    return base, metas


def _bound(metas: list[Any], name: str) -> Any:
    for m in metas:
        if hasattr(m, name):
            return getattr(m, name)
    return None


def _describe_range(info: FieldInfo) -> str | None:
    """Human wording of a numeric field's range, e.g. 'a number from 0.0 to 2.0'."""
    base, metas = _annotated_metadata(info)
    if base not in (int, float):
        return None
    kind = "an integer" if base is int else "a number"
    ge, gt, le, lt = (_bound(metas, n) for n in ("ge", "gt", "le", "lt"))
    if ge is not None and le is not None:
        return f"{kind} from {ge} to {le}"
    lower = f"at least {ge}" if ge is not None else f"above {gt}" if gt is not None else None
    upper = f"at most {le}" if le is not None else f"below {lt}" if lt is not None else None
    return " and ".join([kind + (" " + lower if lower else "")] + ([upper] if upper else []))


_PARAM_FIELDS: tuple[str, ...] = tuple(GenerationParams.model_fields)
_PARAM_RANGES: dict[str, str] = {
    name: desc for name, info in GenerationParams.model_fields.items() if (desc := _describe_range(info))
}
_ROLES: tuple[str, ...] = get_args(ChatMessage.model_fields["role"].annotation)
_ROLE_SET = frozenset(_ROLES)
_MAX_MESSAGES: int = _bound(_annotated_metadata(Request.model_fields["messages"])[1], "max_length") or 10_000
_MAX_CUSTOM_ID: int = _bound(_annotated_metadata(Request.model_fields["custom_id"])[1], "max_length") or 512

_JSONL_KEYS = ("custom_id", "prompt", "messages", "params", "endpoint")
_JSONL_KEY_SET = frozenset(_JSONL_KEYS)
_OPENAI_LINE_KEYS = ("custom_id", "method", "url", "body")
_OPENAI_LINE_KEY_SET = frozenset(_OPENAI_LINE_KEYS)
_OPENAI_URLS = {"/v1/chat/completions": Endpoint.chat, "/v1/completions": Endpoint.completion}
_ENDPOINTS = {e.value: e for e in Endpoint}

# OpenAI/vLLM body key -> GenerationParams field, where the value carries over unchanged.
_BODY_DIRECT = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "random_seed",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "min_tokens": "min_new_tokens",
    "stop_token_ids": "stop_token_ids",
    "skip_special_tokens": "skip_special_tokens",
}
_BODY_SPECIAL = ("model", "stop", "n", "logprobs", "stream")
_BODY_IGNORED = frozenset({"user", "metadata", "store", "service_tier", "stream_options"})
_BODY_ZERO_ONLY = frozenset({"frequency_penalty", "presence_penalty"})
_BODY_KEYS = {
    Endpoint.chat: frozenset({"messages", "top_logprobs", "response_format", *_BODY_DIRECT, *_BODY_SPECIAL}),
    Endpoint.completion: frozenset({"prompt", *_BODY_DIRECT, *_BODY_SPECIAL}),
}

_CHUNK = 1 << 20  # readline granularity: bounds memory while skipping an over-long line
_BOM = b"\xef\xbb\xbf"


# --------------------------------------------------------------------------------------------
# Small helpers


class _LineError(Exception):
    """Internal: the first problem found on a line (turned into an InputError by the caller)."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def _got(value: Any) -> str:
    """A short, JSON-flavoured description of a user value for 'got ...' (never a 10 MB dump)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...")
    if isinstance(value, (int, float)):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    if isinstance(value, list):
        return f"a list of {len(value)} item{'s' if len(value) != 1 else ''}"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _join(names: tuple[str, ...] | list[str]) -> str:
    return "|".join(names)


def _loc_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for item in loc:
        out += f"[{item}]" if isinstance(item, int) else (f".{item}" if out else str(item))
    return out


_TYPE_EXPECT = {
    "string_type": "a string",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}
_RANGE_TYPES = frozenset({"greater_than_equal", "greater_than", "less_than_equal", "less_than"})
_RANGE_WORDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _explain(err: Any, param: str | None) -> str:
    """Turn one pydantic error into 'expected X, got Y' wording."""
    kind = err["type"]
    ctx = err.get("ctx") or {}
    got = _got(err.get("input"))
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return f"unknown parameter; expected one of {_join(_PARAM_FIELDS)}"
    if kind in _RANGE_TYPES:
        if param in _PARAM_RANGES and len(err["loc"]) == 1:
            return f"expected {_PARAM_RANGES[param]}, got {got}"
        key = next(iter(ctx), "")
        return f"expected a value {_RANGE_WORDS[kind]} {ctx.get(key)}, got {got}"
    if kind in _TYPE_EXPECT:
        return f"expected {_TYPE_EXPECT[kind]}, got {got}"
    if kind == "string_too_short":
        return "expected a non-empty string, got ''"
    if kind == "string_too_long":
        return f"expected a string of at most {ctx.get('max_length')} characters, got {len(err['input'])}"
    if kind == "too_short":
        return f"expected at least {ctx.get('min_length')} items, got {got}"
    if kind == "too_long":
        return f"expected at most {ctx.get('max_length')} items, got {ctx.get('actual_length')}"
    msg = str(err.get("msg", "invalid value"))
    return msg.removeprefix("Value error, ")


def _validate_params(
    data: dict[str, Any], src: dict[str, str] | None, prefix: str, wrapped_scalars: frozenset[str] = frozenset()
) -> GenerationParams | None:
    """Validate params into the contract type; ``src`` maps field names back to the user's keys."""
    if not data:
        return None
    lo, hi = data.get("min_new_tokens"), data.get("max_new_tokens")
    if type(lo) is int and type(hi) is int and lo > hi:  # the contract's cross-field rule, with user key names
        lo_name = src["min_new_tokens"] if src else f"{prefix}.min_new_tokens"
        hi_name = src["max_new_tokens"] if src else f"{prefix}.max_new_tokens"
        raise _LineError(lo_name, f"expected at most {hi_name} ({hi}), got {lo}")
    try:
        params = GenerationParams.model_validate(data, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        err = errors[0]
        loc = err["loc"]
        name = loc[0] if loc and isinstance(loc[0], str) else None
        if src is None:
            field = _loc_path((prefix, *loc)) if prefix else _loc_path(loc)
        elif name is not None and name in src:
            wrapped = name in wrapped_scalars  # e.g. "stop": "x" became ["x"]: no [0] in the path
            field = src[name] + (_loc_path(loc[1:]) if len(loc) > 1 and not wrapped else "")
        else:
            field = prefix
        message = _explain(err, name)
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''} in the parameters)"
        raise _LineError(field, message) from None
    if params.response_format is not None:
        try:
            check_response_format(params.response_format)
        except ValueError as exc:
            if src is not None and "response_format" in src:
                field = src["response_format"]
            else:
                field = f"{prefix}.response_format" if prefix else "response_format"
            raise _LineError(field, str(exc)) from None
    return params if params.model_fields_set else None


_RF_WRAPPER_KEYS = ("name", "schema", "strict", "description")


def _openai_response_format(rf: Any) -> dict[str, Any] | None:
    """OpenAI's chat ``response_format`` → lmdq's ResponseFormat data (None for ``text``)."""
    name = "body.response_format"
    if not isinstance(rf, dict):
        raise _LineError(name, f"expected an object, got {_got(rf)}")
    kind = rf.get("type")
    allowed = {"text": ("type",), "json_object": ("type",), "json_schema": ("type", "json_schema"),
               "regex_schema": ("type", "regex_schema")}
    if kind not in allowed:
        raise _LineError(f"{name}.type", f"expected one of {_join(tuple(allowed))}, got {_got(kind)}")
    for key in rf:
        if key not in allowed[kind]:
            raise _LineError(f"{name}.{key}", f"unknown key for type {kind!r}; expected only {_join(allowed[kind])}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "regex_schema":
        regex = rf.get("regex_schema")
        if not isinstance(regex, str) or not regex:
            raise _LineError(f"{name}.regex_schema", f"expected a non-empty string, got {_got(regex)}")
        return {"type": "regex", "regex": regex}
    wrapper = rf.get("json_schema")
    if not isinstance(wrapper, dict):
        raise _LineError(f"{name}.json_schema", f"expected an object with 'name' and 'schema', got {_got(wrapper)}")
    for key in wrapper:
        if key not in _RF_WRAPPER_KEYS:
            raise _LineError(f"{name}.json_schema.{key}", f"unknown key; expected only {_join(_RF_WRAPPER_KEYS)}")
    if not isinstance(wrapper.get("schema"), dict):
        got = _got(wrapper.get("schema"))
        raise _LineError(f"{name}.json_schema.schema", f"expected a JSON schema object, got {got}")
    if "name" in wrapper and not isinstance(wrapper["name"], str):
        raise _LineError(f"{name}.json_schema.name", f"expected a string, got {_got(wrapper['name'])}")
    if wrapper.get("strict") is not None and not isinstance(wrapper["strict"], bool):
        raise _LineError(f"{name}.json_schema.strict", f"expected true or false, got {_got(wrapper['strict'])}")
    return {"type": "json_schema", "json_schema": dict(wrapper)}


def _custom_id(value: Any, line_no: int, field: str = "custom_id") -> str:
    if value is None:
        return str(line_no)
    if isinstance(value, str):
        if not value:
            raise _LineError(field, "expected a non-empty string, got ''")
        if len(value) > _MAX_CUSTOM_ID:
            raise _LineError(field, f"expected a string of at most {_MAX_CUSTOM_ID} characters, got {len(value)}")
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise _LineError(field, f"expected a string or an integer, got {_got(value)}")


def _check_prompt(prompt: Any, field: str) -> str:
    if not isinstance(prompt, str):
        raise _LineError(field, f"expected a string, got {_got(prompt)}")
    if not prompt:
        raise _LineError(field, "expected a non-empty string, got ''")
    return prompt


def _check_messages(messages: Any, field: str) -> list[dict]:
    """Check an OpenAI chat list against ChatMessage's rules with precise field paths."""
    if not isinstance(messages, list):
        raise _LineError(field, f"expected a list of chat messages, got {_got(messages)}")
    if not messages:
        raise _LineError(field, "expected at least one message, got an empty list")
    if len(messages) > _MAX_MESSAGES:
        raise _LineError(field, f"expected at most {_MAX_MESSAGES} messages, got {len(messages)}")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _LineError(f"{field}[{i}]", f"expected a message object with 'role' and 'content', got {_got(msg)}")
        role = msg.get("role")
        if not isinstance(role, str) or role not in _ROLE_SET:
            got = "nothing (the key is missing)" if "role" not in msg else _got(role)
            raise _LineError(f"{field}[{i}].role", f"expected one of {_join(_ROLES)}, got {got}")
        content = msg.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise _LineError(f"{field}[{i}].content", f"expected a string or a list of text parts, got {_got(content)}")
        for j, part in enumerate(content):
            where = f"{field}[{i}].content[{j}]"
            if not isinstance(part, dict):
                raise _LineError(where, f"expected a content part object {{'type': 'text', ...}}, got {_got(part)}")
            if part.get("type") != "text":
                raise _LineError(
                    f"{where}.type", f"expected 'text' (lmdq serves text-only models), got {_got(part.get('type'))}"
                )
            if not isinstance(part.get("text"), str):
                raise _LineError(f"{where}.text", f"expected a string, got {_got(part.get('text'))}")
    return messages


# --------------------------------------------------------------------------------------------
# Per-format line parsers: dict in, ParsedLine out, _LineError on the first problem.


def _parse_jsonl(obj: dict[str, Any], line_no: int) -> ParsedLine:
    for key in obj:
        if key not in _JSONL_KEY_SET:
            hint = ""
            if key in ("url", "body", "method"):
                hint = " (this looks like an OpenAI batch line; the file's first request line decides the format)"
            raise _LineError(key, f"unknown key; expected only {_join(_JSONL_KEYS)}{hint}")
    custom_id = _custom_id(obj.get("custom_id"), line_no)
    raw_endpoint = obj.get("endpoint")
    if raw_endpoint is None:
        endpoint = Endpoint.chat
    elif isinstance(raw_endpoint, str) and raw_endpoint in _ENDPOINTS:
        endpoint = _ENDPOINTS[raw_endpoint]
    else:
        raise _LineError("endpoint", f"expected one of {_join(tuple(_ENDPOINTS))}, got {_got(raw_endpoint)}")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if prompt is None and messages is None:
        raise _LineError("prompt", "expected a 'prompt' string or a 'messages' list, got neither")
    if prompt is not None and messages is not None:
        raise _LineError("messages", "expected exactly one of 'prompt' or 'messages', got both")
    if prompt is not None:
        prompt = _check_prompt(prompt, "prompt")
    else:
        if endpoint is Endpoint.completion:
            raise _LineError("messages", "expected 'prompt' for endpoint 'completion' (messages need 'chat')")
        messages = _check_messages(messages, "messages")
    raw_params = obj.get("params")
    params = None
    if raw_params is not None:
        if not isinstance(raw_params, dict):
            raise _LineError("params", f"expected an object of generation parameters, got {_got(raw_params)}")
        params = _validate_params(raw_params, None, "params")
    return ParsedLine(line_no, custom_id, prompt, messages, endpoint, params, None)


def _parse_openai(obj: dict[str, Any], line_no: int) -> ParsedLine:
    for key in obj:
        if key not in _OPENAI_LINE_KEY_SET:
            raise _LineError(key, f"unknown key; expected only {_join(_OPENAI_LINE_KEYS)} (OpenAI batch format)")
    if "url" not in obj or "body" not in obj:
        missing = "url" if "url" not in obj else "body"
        raise _LineError(
            missing, "required field is missing; every line of an OpenAI batch file needs 'url' and 'body'"
        )
    custom_id = _custom_id(obj.get("custom_id"), line_no)
    method = obj.get("method")
    if method is not None and method != "POST":
        raise _LineError("method", f"expected 'POST', got {_got(method)}")
    url = obj["url"]
    endpoint = _OPENAI_URLS.get(url) if isinstance(url, str) else None
    if endpoint is None:
        raise _LineError("url", f"expected one of {_join(tuple(_OPENAI_URLS))}, got {_got(url)}")
    body = obj["body"]
    if not isinstance(body, dict):
        raise _LineError("body", f"expected an object, got {_got(body)}")

    allowed = _BODY_KEYS[endpoint]
    params: dict[str, Any] = {}
    src: dict[str, str] = {}
    for key, value in body.items():
        if key in allowed:
            continue
        if key in _BODY_IGNORED:
            continue
        if key in _BODY_ZERO_ONLY:
            if value is None or (type(value) in (int, float) and value == 0):
                continue
            raise _LineError(
                f"body.{key}",
                f"expected 0 or null, got {_got(value)}: {key} is unsupported by lmdq (use repetition_penalty)",
            )
        if key == "messages" or key == "prompt":
            other = "/v1/chat/completions" if key == "messages" else "/v1/completions"
            raise _LineError(f"body.{key}", f"'{key}' belongs to url {other}, not {url}")
        raise _LineError(
            f"body.{key}",
            f"unsupported key; expected only {_join(sorted(allowed | _BODY_IGNORED | _BODY_ZERO_ONLY))}",
        )

    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _LineError("body.model", f"expected a string, got {_got(model)}")

    prompt: str | None = None
    messages: list[dict] | None = None
    if endpoint is Endpoint.chat:
        if body.get("messages") is None:
            raise _LineError("body.messages", "required field is missing; expected a list of chat messages")
        messages = _check_messages(body["messages"], "body.messages")
    else:
        raw_prompt = body.get("prompt")
        if raw_prompt is None:
            raise _LineError("body.prompt", "required field is missing; expected a string")
        if isinstance(raw_prompt, list):
            raise _LineError(
                "body.prompt",
                f"expected a single string, got {_got(raw_prompt)}: list prompts are not supported, "
                "put one prompt per line",
            )
        prompt = _check_prompt(raw_prompt, "body.prompt")

    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            raise _LineError(
                "body.n", f"expected 1, got {n}: lmdq generates one completion per request; repeat the line instead"
            )
        raise _LineError("body.n", f"expected 1, got {_got(n)}")

    for key, field in _BODY_DIRECT.items():
        value = body.get(key)
        if value is None:
            continue
        if field in params and params[field] != value:
            raise _LineError(f"body.{key}", f"conflicts with body.{src[field][5:]}; set only one of them")
        params[field] = value
        src[field] = f"body.{key}"
    temperature = params.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
        params["do_sample"] = temperature > 0
        src["do_sample"] = "body.temperature"

    stop = body.get("stop")
    wrapped: frozenset[str] = frozenset()
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        elif not isinstance(stop, list):
            raise _LineError("body.stop", f"expected a string or a list of strings, got {_got(stop)}")
        params["stop_words"] = stop
        src["stop_words"] = "body.stop"
        wrapped = frozenset({"stop_words"}) if isinstance(body["stop"], str) else frozenset()

    logprobs = body.get("logprobs")
    top_logprobs = body.get("top_logprobs")
    if endpoint is Endpoint.chat:
        if logprobs is not None and not isinstance(logprobs, bool):
            raise _LineError("body.logprobs", f"expected true or false, got {_got(logprobs)}")
        if top_logprobs is not None:
            if not logprobs:
                raise _LineError("body.top_logprobs", 'requires "logprobs": true')
            if not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool):
                raise _LineError("body.top_logprobs", f"expected an integer, got {_got(top_logprobs)}")
        if logprobs:
            params["logprobs"] = max(top_logprobs or 0, 1)
            src["logprobs"] = "body.top_logprobs" if top_logprobs is not None else "body.logprobs"
    elif logprobs is not None:
        if not isinstance(logprobs, int) or isinstance(logprobs, bool):
            raise _LineError("body.logprobs", f"expected an integer, got {_got(logprobs)}")
        params["logprobs"] = max(logprobs, 1)
        src["logprobs"] = "body.logprobs"

    response_format = body.get("response_format")
    if response_format is not None:
        mapped = _openai_response_format(response_format)
        if mapped is not None:
            params["response_format"] = mapped
            # where a schema/regex that does not compile is reported
            src["response_format"] = {"json_schema": "body.response_format.json_schema.schema",
                                      "regex": "body.response_format.regex_schema"}.get(
                                          mapped["type"], "body.response_format")

    validated = _validate_params(params, src, "body", wrapped)
    return ParsedLine(line_no, custom_id, prompt, messages, endpoint, validated, model)


# --------------------------------------------------------------------------------------------
# Streaming


def _read_lines(f: IO[bytes], max_bytes: int) -> Iterator[tuple[int, int, bytes | None, int]]:
    """Yield ``(line_no, file_offset, content, size)`` per line, newline and one '\\r' stripped.

    ``content`` is None when the line exceeds ``max_bytes``; such a line is read and dropped in
    bounded chunks, so memory stays near ``max_bytes`` however long the line is.
    """
    chunk = min(max_bytes + 2, _CHUNK)
    readline = f.readline
    line_no = 0
    offset = 0
    while True:
        raw = readline(chunk)
        if not raw:
            return
        line_no += 1
        start = offset
        offset += len(raw)
        if raw[-1:] != b"\n" and len(raw) == chunk:  # the line continues past this chunk
            parts: list[bytes] | None = [raw]
            total = len(raw)
            last = raw
            while True:
                more = readline(chunk)
                if not more:
                    break
                last = more
                offset += len(more)
                total += len(more)
                if parts is not None:
                    if total > max_bytes + 2:  # cannot fit even without its '\r\n': stop keeping it
                        parts = None
                    else:
                        parts.append(more)
                if more[-1:] == b"\n" or len(more) < chunk:
                    break
            if parts is None:
                ending = 2 if last[-2:] == b"\r\n" else 1 if last[-1:] in (b"\n", b"\r") else 0
                yield line_no, start, None, total - ending
                continue
            raw = b"".join(parts)
        if raw[-1:] == b"\n":
            raw = raw[:-2] if raw[-2:-1] == b"\r" else raw[:-1]
        elif raw[-1:] == b"\r":
            raw = raw[:-1]
        if len(raw) > max_bytes:
            yield line_no, start, None, len(raw)
        else:
            yield line_no, start, raw, len(raw)


def detect_format(path: Path) -> InputFormat:
    """Pick the format: ``*.txt`` is text; otherwise OpenAI if the first request line has url+body.

    Anything undecidable (unparseable first line, empty file) is ``jsonl``, whose parser then
    reports the real problem with a line number.
    """
    path = Path(path)
    if path.suffix.lower() == ".txt":
        return InputFormat.text
    with open(path, "rb") as f:
        for line_no, _start, data, _size in _read_lines(f, InputLimits().max_line_bytes):
            if data is None:
                return InputFormat.jsonl
            if line_no == 1 and data.startswith(_BOM):
                data = data[len(_BOM) :]
            if not data or data.isspace():
                continue
            try:
                obj = _loads(data)
            except (ValueError, RecursionError):
                return InputFormat.jsonl
            if isinstance(obj, dict) and "url" in obj and "body" in obj:
                return InputFormat.openai
            return InputFormat.jsonl
    return InputFormat.jsonl


def _json_error(exc: Exception) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON at column {exc.colno}: {exc.msg}; expected one JSON object per line"
    if isinstance(exc, RecursionError):
        return "invalid JSON: nested too deeply; expected one JSON object per line"
    return f"invalid JSON: {exc}; expected one JSON object per line"


def iter_lines(
    path: Path, *, fmt: InputFormat | None = None, limits: InputLimits = InputLimits()
) -> Iterator[ParsedLine | InputError]:
    """Stream ``path``, yielding a ParsedLine per valid request and an InputError per bad line.

    Parsing continues after errors; the caller decides how many to show.  Memory stays flat:
    one line (at most ``limits.max_line_bytes``) is held at a time.  ``OSError`` from opening
    the file propagates.
    """
    path = Path(path)
    if fmt is None:
        fmt = detect_format(path)
    name = str(path)
    parse = _parse_openai if fmt is InputFormat.openai else _parse_jsonl
    is_text = fmt is InputFormat.text
    count = 0
    max_requests = limits.max_requests
    max_bytes = limits.max_line_bytes
    loads = _loads
    chat = Endpoint.chat
    with open(path, "rb", buffering=256 * 1024) as f:
        for line_no, start, data, size in _read_lines(f, max_bytes):
            bom = 0
            if line_no == 1 and data is not None and data.startswith(_BOM):
                data = data[len(_BOM) :]
                bom = len(_BOM)
            if data is not None and (not data or data.isspace()):
                continue
            count += 1
            if count > max_requests:
                yield InputError(name, line_no, None, f"too many requests: the limit is {max_requests:,} per file")
                return
            if data is None:
                yield InputError(
                    name, line_no, None, f"line is {size:,} bytes, over the limit of {max_bytes:,} bytes per line"
                )
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                hint = ""
                if line_no == 1 and data[:2] in (b"\xff\xfe", b"\xfe\xff"):
                    hint = " (the file looks like UTF-16; save it as UTF-8)"
                yield InputError(
                    name,
                    line_no,
                    None,
                    f"invalid UTF-8 at byte {exc.start + bom} of the line (file offset {start + bom + exc.start}); "
                    f"expected UTF-8 text{hint}",
                )
                continue
            if is_text:
                yield ParsedLine(line_no, str(line_no), text, None, chat, None, None)
                continue
            try:
                obj = loads(text)
            except (ValueError, RecursionError) as exc:
                yield InputError(name, line_no, None, _json_error(exc))
                continue
            if not isinstance(obj, dict):
                hint = " (for one plain prompt per line use a .txt file)" if isinstance(obj, str) else ""
                yield InputError(name, line_no, None, f"expected a JSON object, got {_got(obj)}{hint}")
                continue
            try:
                yield parse(obj, line_no)
            except _LineError as exc:
                yield InputError(name, line_no, exc.field, exc.message)
    if count == 0:
        yield InputError(name, 0, None, "file has no requests (expected at least one non-blank line)")
