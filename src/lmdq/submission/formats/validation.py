"""Field checks shared by the JSON formats, worded as 'expected X, got Y' with the user's field path.

Limits and vocabularies are read from :mod:`lmdq.contract` so the parser cannot drift from the
wire format; pydantic's errors are reworded so a bad line names the offending field precisely.
"""

from __future__ import annotations

from typing import Annotated, Any, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from lmdq.contract import ChatMessage, GenerationParams, Request
from lmdq.guided import check as check_response_format
from lmdq.images.parts import part_problem
from lmdq.submission.formats.records import Sampling, _got, _join, _LineError

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


# --------------------------------------------------------------------------------------------
# Pydantic errors reworded with the user's field names.


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


# --------------------------------------------------------------------------------------------
# Sampling: what temperature means without do_sample.

#: knobs that only matter when sampling (LMDeploy ignores them when greedy)
SAMPLING_KNOBS = ("temperature", "top_p", "top_k", "min_p")


def imply_sampling(params: dict[str, Any]) -> Sampling | None:
    """Decide ``do_sample`` where the params set sampling knobs but not ``do_sample`` (in place).

    lmdq's decision, the one OpenAI and vLLM users expect: ``temperature`` > 0 samples and
    ``temperature`` 0 is greedy, unless ``do_sample`` says otherwise. ``top_p``/``top_k``/``min_p``
    alone decide nothing (the batch's ``do_sample`` stands, greedy by default, where they have no
    effect): returned as :attr:`Sampling.inert` so the caller can warn. An explicit ``do_sample``
    always wins, and a value that is not a number is left for validation to refuse.
    """
    if params.get("do_sample") is not None:
        return None
    t = params.get("temperature")
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        params["do_sample"] = t > 0
        return Sampling.implied
    if any(params.get(k) is not None for k in SAMPLING_KNOBS):
        return Sampling.inert
    return None


# --------------------------------------------------------------------------------------------
# Checks of the request fields both JSON formats share.


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
    if prompt.isspace():
        raise _LineError(field, f"expected some text, got only whitespace ({_got(prompt)})")
    return prompt


def _check_messages(messages: Any, field: str) -> list[dict[str, Any]]:
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
        if content is None:
            got = "nothing (the key is missing)" if "content" not in msg else "null"
            hint = " (lmdq serves no tools, so tool_calls cannot stand in for it)" if "tool_calls" in msg else ""
            raise _LineError(f"{field}[{i}].content", f"expected a string or a list of text parts, got {got}{hint}")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise _LineError(f"{field}[{i}].content", f"expected a string or a list of text parts, got {_got(content)}")
        if not content:
            raise _LineError(f"{field}[{i}].content", "expected at least one text part, got an empty list")
        for j, part in enumerate(content):
            problem = part_problem(part)
            if problem is not None:
                sub, message = problem
                where = f"{field}[{i}].content[{j}]{sub}"
                got = part if sub == "" else part.get("type") if sub == ".type" else _dig(part, sub)
                raise _LineError(where, f"{message}, got {_got(got)}")
    return messages


def _dig(part: dict[str, Any], sub: str) -> Any:
    """The value at ``sub`` (``.image_url.url``) inside a content part, for the error's 'got'."""
    value: Any = part
    for key in sub.strip(".").split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _check_continuations(value: Any, field: str) -> tuple[str, ...]:
    """A score request's continuations: a non-empty list of at most MAX_CONTINUATIONS non-empty strings."""
    from lmdq.contract import MAX_CONTINUATION_CHARS, MAX_CONTINUATIONS

    if not isinstance(value, list):
        raise _LineError(field, f"expected a list of strings (the texts to score), got {_got(value)}")
    if not value:
        raise _LineError(field, "expected at least one continuation, got an empty list")
    if len(value) > MAX_CONTINUATIONS:
        raise _LineError(field, f"expected at most {MAX_CONTINUATIONS} continuations, got {len(value)}")
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise _LineError(f"{field}[{i}]", f"expected a string, got {_got(text)}")
        if not text:
            raise _LineError(f"{field}[{i}]", "expected a non-empty string, got ''")
        if len(text) > MAX_CONTINUATION_CHARS:
            raise _LineError(f"{field}[{i}]", f"expected at most {MAX_CONTINUATION_CHARS} characters, got {len(text)}")
    return tuple(value)
