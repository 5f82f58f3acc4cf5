"""OpenAI Batch API lines ``{"custom_id", "method", "url", "body"}``, mapped onto lmdq requests.

The body's OpenAI/vLLM keys are translated to GenerationParams names (``max_tokens`` ->
``max_new_tokens``, ``temperature`` > 0 turns sampling on, ``logprobs``/``top_logprobs`` and
``response_format`` are reshaped), so files written for OpenAI's batch API run unchanged.

What OpenAI itself refuses is refused here too, naming file:line: a line without ``custom_id`` (output
lines are joined to requests by it) and ``"stream": true`` (a batch has nobody to stream to).
``body.model`` is kept per line; ``submit`` decides which model the batch runs (``--model`` wins).

``/v1/embeddings`` bodies take ``input`` (one string, or a list holding one string: one vector per line, so
a line's output is one result and one Parquet row), ``model``, ``encoding_format`` (``float``, OpenAI's
default: the output lines carry floats) and the ignored ``user``; ``dimensions`` is refused (lmdq returns the
model's own vectors, untruncated).
"""

from __future__ import annotations

from typing import Any

from lmdq.contract import Endpoint
from lmdq.submission.formats.records import ParsedLine, _got, _join, _LineError
from lmdq.submission.formats.validation import (
    _check_continuations,
    _check_messages,
    _check_prompt,
    _custom_id,
    _validate_params,
)

_OPENAI_LINE_KEYS = ("custom_id", "method", "url", "body")
_OPENAI_LINE_KEY_SET = frozenset(_OPENAI_LINE_KEYS)
_OPENAI_URLS = {"/v1/chat/completions": Endpoint.chat, "/v1/completions": Endpoint.completion,
                "/v1/score": Endpoint.score, "/v1/reward": Endpoint.reward, "/v1/embeddings": Endpoint.embedding}
#: body keys of the scoring urls (lmdq's own: OpenAI has no scoring endpoint); nothing is sampled
_SCORE_KEYS = {Endpoint.score: ("model", "prompt", "messages", "continuations"),
               Endpoint.reward: ("model", "messages")}

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


def _parse_openai(obj: dict[str, Any], line_no: int, default_endpoint: Endpoint | None = None) -> ParsedLine:
    """One OpenAI Batch line; with ``default_endpoint`` (submit's ``--endpoint``) its url must be that one's."""
    for key in obj:
        if key not in _OPENAI_LINE_KEY_SET:
            raise _LineError(key, f"unknown key; expected only {_join(_OPENAI_LINE_KEYS)} (OpenAI batch format)")
    if "url" not in obj or "body" not in obj:
        missing = "url" if "url" not in obj else "body"
        raise _LineError(
            missing, "required field is missing; every line of an OpenAI batch file needs 'url' and 'body'"
        )
    if obj.get("custom_id") is None:
        # OpenAI's Batch API requires it: output lines are matched to requests by custom_id alone
        # (their order is not guaranteed), so a line-number default would silently break that join.
        raise _LineError(
            "custom_id", "required field is missing; every line of an OpenAI batch file needs a unique 'custom_id'"
        )
    custom_id = _custom_id(obj["custom_id"], line_no)
    method = obj.get("method")
    if method is not None and method != "POST":
        raise _LineError("method", f"expected 'POST', got {_got(method)}")
    url = obj["url"]
    endpoint = _OPENAI_URLS.get(url) if isinstance(url, str) else None
    if endpoint is None:
        raise _LineError("url", f"expected one of {_join(tuple(_OPENAI_URLS))}, got {_got(url)}")
    if default_endpoint is not None and endpoint is not default_endpoint:
        want = next(u for u, e in _OPENAI_URLS.items() if e is default_endpoint)
        raise _LineError("url", f"expected {want!r} (the submit's endpoint {default_endpoint.value!r}), "
                                f"got {_got(url)}")
    body = obj["body"]
    if not isinstance(body, dict):
        raise _LineError("body", f"expected an object, got {_got(body)}")
    if endpoint is Endpoint.embedding:
        return _parse_embedding_body(line_no, custom_id, body)
    if not endpoint.generates:
        return _parse_score_body(line_no, custom_id, endpoint, body)

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
    messages: list[dict[str, Any]] | None = None
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

    stream = body.get("stream")
    if stream is not None and stream is not False:
        # a batch has no connection to stream to: OpenAI refuses it, and accepting it would promise SSE chunks
        raise _LineError("body.stream", f"expected false or null, got {_got(stream)}: a batch request cannot stream")

    n = body.get("n")
    if n is not None and not (type(n) is int and n == 1):  # n samples in one result (choices[0..n-1]); 1 = default
        params["n"] = n
        src["n"] = "body.n"

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


def _parse_score_body(line_no: int, custom_id: str, endpoint: Endpoint, body: dict[str, Any]) -> ParsedLine:
    """``/v1/score`` (``prompt`` or ``messages`` + ``continuations``) and ``/v1/reward`` (``messages``) bodies."""
    keys = _SCORE_KEYS[endpoint]
    for key in body:
        if key not in keys and key not in _BODY_IGNORED:
            raise _LineError(f"body.{key}", f"unsupported key for {endpoint.value!r}; expected only {_join(keys)} "
                                            "(nothing is sampled)")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _LineError("body.model", f"expected a string, got {_got(model)}")
    prompt, messages = body.get("prompt"), body.get("messages")
    if endpoint is Endpoint.reward or prompt is None:
        if messages is None:
            want = "a list of chat messages" if endpoint is Endpoint.reward else "a 'prompt' string or 'messages'"
            raise _LineError("body.messages", f"required field is missing; expected {want}")
        messages = _check_messages(messages, "body.messages")
    elif messages is not None:
        raise _LineError("body.messages", "expected exactly one of 'prompt' or 'messages', got both")
    else:
        prompt = _check_prompt(prompt, "body.prompt")
    continuations = None
    if endpoint is Endpoint.score:
        if body.get("continuations") is None:
            raise _LineError("body.continuations", "required field is missing; expected a list of strings to score")
        continuations = _check_continuations(body["continuations"], "body.continuations")
    return ParsedLine(line_no, custom_id, prompt, messages, endpoint, None, model, continuations=continuations)


_EMBEDDING_KEYS = ("model", "input", "encoding_format")


def _parse_embedding_body(line_no: int, custom_id: str, body: dict[str, Any]) -> ParsedLine:
    """A ``/v1/embeddings`` body: ``input`` (a string, or a list of one string), ``model``, ``encoding_format``."""
    for key in body:
        if key == "dimensions":
            raise _LineError("body.dimensions", "unsupported: lmdq returns the model's own vectors (leave "
                                                "'dimensions' out, or truncate and renormalise the vectors yourself)")
        if key not in _EMBEDDING_KEYS and key not in _BODY_IGNORED:
            raise _LineError(f"body.{key}", f"unsupported key for '/v1/embeddings'; expected only "
                                            f"{_join(_EMBEDDING_KEYS)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _LineError("body.model", f"expected a string, got {_got(model)}")
    fmt = body.get("encoding_format")
    if fmt is not None and fmt != "float":
        raise _LineError("body.encoding_format", f"expected 'float' (the output lines carry floats; lmdq's own "
                                                 f"results and Parquet keep float32), got {_got(fmt)}")
    text = body.get("input")
    if text is None:
        raise _LineError("body.input", "required field is missing; expected the text to embed (a string)")
    if isinstance(text, list):
        if len(text) != 1 or not isinstance(text[0], str):
            raise _LineError("body.input", f"expected a string (or a list of one string), got {_got(text)}: one "
                                           "text per line (token-id inputs are not supported); put each text on "
                                           "its own line with its own custom_id")
        text = text[0]
    prompt = _check_prompt(text, "body.input")
    return ParsedLine(line_no, custom_id, prompt, None, Endpoint.embedding, None, model)
