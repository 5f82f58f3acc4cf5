"""lmdq's own JSONL lines: ``{"custom_id", "prompt" | "messages", "params", "endpoint"}``.

``params`` are the contract's GenerationParams names as they are, checked strictly.
"""

from __future__ import annotations

from typing import Any

from lmdq.contract import Endpoint
from lmdq.producer.formats.records import ParsedLine, _got, _join, _LineError
from lmdq.producer.formats.validation import _check_messages, _check_prompt, _custom_id, _validate_params

_JSONL_KEYS = ("custom_id", "prompt", "messages", "params", "endpoint")
_JSONL_KEY_SET = frozenset(_JSONL_KEYS)
_ENDPOINTS = {e.value: e for e in Endpoint}


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
