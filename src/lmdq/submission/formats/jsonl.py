"""lmdq's own JSONL lines: ``{"custom_id", "prompt" | "messages", "params", "endpoint", "model",
"continuations"}``.

``model`` (optional) names the served model the line runs on: lines naming different models make one
batch over several models (``submit --model`` still sets every line's).

Endpoint ``score`` takes ``prompt`` or ``messages`` plus ``continuations`` (a list of strings); endpoint
``reward`` takes ``messages``; endpoint ``embedding`` takes ``prompt`` (the text to embed); none of them
takes ``params`` (nothing is sampled).

``params`` are the contract's GenerationParams names (LMDeploy's), checked strictly. The producer's
flag names are accepted too, as aliases: ``stop`` (a string or a list) for ``stop_words``, ``seed``
for ``random_seed``, ``max_tokens`` for ``max_new_tokens``; a line giving both names of one
parameter is refused. ``temperature`` without ``do_sample`` decides sampling (> 0 samples, 0 is
greedy: :func:`~producer.formats.validation.imply_sampling`).
"""

from __future__ import annotations

from typing import Any

from lmdq.contract import Endpoint, GenerationParams
from lmdq.submission.formats.records import ParsedLine, Sampling, _got, _join, _LineError
from lmdq.submission.formats.validation import (
    _check_continuations,
    _check_messages,
    _check_prompt,
    _custom_id,
    _validate_params,
    imply_sampling,
)

_JSONL_KEYS = ("custom_id", "prompt", "messages", "params", "endpoint", "model", "continuations")
_JSONL_KEY_SET = frozenset(_JSONL_KEYS)
_ENDPOINTS = {e.value: e for e in Endpoint}
#: the producer's flag names (--stop, --seed) and OpenAI's max_tokens -> GenerationParams fields
PARAM_ALIASES = {"stop": "stop_words", "seed": "random_seed", "max_tokens": "max_new_tokens"}


def _params(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str], frozenset[str]]:
    """The line's params under GenerationParams names, where each came from (``params.<key>``), and
    the fields whose scalar value was wrapped in a list (``"stop": "x"``)."""
    data: dict[str, Any] = {}
    src: dict[str, str] = {}
    wrapped: set[str] = set()
    for key, value in raw.items():
        name = PARAM_ALIASES.get(key, key)
        if name in src:
            raise _LineError(f"params.{key}", f"same parameter as {src[name]}; set only one of them")
        if key == "stop" and isinstance(value, str):
            value = [value]
            wrapped.add(name)
        data[name] = value
        src[name] = f"params.{key}"
    return data, src, frozenset(wrapped)


def _parse_jsonl(obj: dict[str, Any], line_no: int, default_endpoint: Endpoint | None = None) -> ParsedLine:
    """One lmdq line; ``default_endpoint`` (submit's ``--endpoint``) is the endpoint of a line naming none,
    and a line naming another one is refused (the caller said what the file is)."""
    for key in (() if obj.keys() <= _JSONL_KEY_SET else obj):  # a set comparison in C for the usual line
        if key not in _JSONL_KEY_SET:
            hint = ""
            if key in ("url", "body", "method"):
                hint = " (this looks like an OpenAI batch line; the file's first request line decides the format)"
            raise _LineError(key, f"unknown key; expected only {_join(_JSONL_KEYS)}{hint}")
    custom_id = _custom_id(obj.get("custom_id"), line_no)
    raw_endpoint = obj.get("endpoint")
    if raw_endpoint is None:
        endpoint = default_endpoint or Endpoint.chat
    elif isinstance(raw_endpoint, str) and raw_endpoint in _ENDPOINTS:
        endpoint = _ENDPOINTS[raw_endpoint]
    else:
        raise _LineError("endpoint", f"expected one of {_join(tuple(_ENDPOINTS))}, got {_got(raw_endpoint)}")
    if default_endpoint is not None and endpoint is not default_endpoint:
        raise _LineError("endpoint", f"expected {default_endpoint.value!r} (the submit's endpoint), got "
                                     f"{_got(raw_endpoint)}")
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
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise _LineError("model", f"expected a served model name (a string), got {_got(model)}")
    continuations = None
    if endpoint is Endpoint.score:
        if "continuations" not in obj:
            raise _LineError("continuations", "expected a list of strings to score for endpoint 'score', got nothing")
        continuations = _check_continuations(obj["continuations"], "continuations")
    elif "continuations" in obj:
        raise _LineError("continuations", f"only endpoint 'score' takes continuations (this line's is "
                                          f"{endpoint.value!r})")
    if endpoint is Endpoint.reward and messages is None:
        raise _LineError("prompt", "expected 'messages' for endpoint 'reward' (the chat to score), got 'prompt'")
    if endpoint is Endpoint.embedding and prompt is None:
        raise _LineError("messages", "expected 'prompt' (the text to embed) for endpoint 'embedding', got 'messages'")
    raw_params = obj.get("params")
    if not endpoint.generates:
        if raw_params is not None:
            raise _LineError("params", f"endpoint {endpoint.value!r} samples nothing: it takes no generation "
                                       "parameters")
        return ParsedLine(line_no, custom_id, prompt, messages, endpoint, None, model, continuations=continuations)
    params = None
    if raw_params is not None:
        if not isinstance(raw_params, dict):
            raise _LineError("params", f"expected an object of generation parameters, got {_got(raw_params)}")
        pkey = _params_key(raw_params)
        known = _VALID_PARAMS.get(pkey) if pkey is not None else None
        if known is not None:
            return ParsedLine(line_no, custom_id, prompt, messages, endpoint, known[0], model, known[1])
        data, src, wrapped = _params(raw_params)
        sampling = imply_sampling(data)
        if sampling is not None:
            src.setdefault("do_sample", src.get("temperature", "params"))
        params = _validate_params(data, src, "params", wrapped)
        if pkey is not None:
            if len(_VALID_PARAMS) >= _VALID_PARAMS_MAX:
                _VALID_PARAMS.clear()
            _VALID_PARAMS[pkey] = (params, sampling)
        return ParsedLine(line_no, custom_id, prompt, messages, endpoint, params, model, sampling)
    return ParsedLine(line_no, custom_id, prompt, messages, endpoint, params, model)


_VALID_PARAMS: dict[tuple[Any, ...], tuple[GenerationParams | None, Sampling | None]] = {}
"""A line's ``params`` object (:func:`_params_key`) -> what validating it gave. Why: a file's lines mostly
share a few params objects, and validating one (aliases, implied sampling, the contract model) cost ~20 % of
a submit's CPU per line (issue 49). Only valid params are kept, so a bad line is still refused with its own
line number; the result is immutable as used (the model is never changed after validation)."""

_VALID_PARAMS_MAX = 4096

_SCALARS = (str, int, float, bool, type(None))


def _params_key(raw: dict[str, Any]) -> tuple[Any, ...] | None:
    """A hashable key of a params object whose values are scalars or lists of scalars (None otherwise: not
    cached). Each value's type is part of the key: ``1``, ``1.0`` and ``true`` are equal in Python but not
    the same parameter to the strict validation."""
    key: list[Any] = []
    for k, v in raw.items():
        t = type(v)
        if t in _SCALARS:
            key.append((k, t, v))
        elif t is list and all(type(x) is str for x in v):
            key.append((k, list, tuple(v)))
        else:
            return None
    return tuple(key)
