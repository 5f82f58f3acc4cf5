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

* ``custom_id`` defaults to the 1-based line number (not in OpenAI files: there it is required, as
  OpenAI's Batch API does); JSON integers are accepted and turned into
  strings (``7`` -> ``"7"``); booleans, floats and empty strings are refused.
* ``null`` means "absent" for every optional key.
* Values are checked strictly: ``"temperature": "0.7"`` is an error, not silently coerced.
* An empty or whitespace-only ``prompt`` is refused (a model given nothing is almost always a
  file bug).
* A chat message must have ``content`` (a string, or a non-empty list of text parts). OpenAI lets
  an assistant message that carries ``tool_calls`` omit it; lmdq serves no tools, so such a message
  could only be rendered as an empty turn: refused, with that reason.
* A key twice in one JSON object is refused (``file:line``, naming the key): parsers disagree on
  which value wins, so the request would not mean one thing. Checked exactly by the stdlib parser;
  with orjson by a cheap count that falls back to the exact parse only when it sees a doubt.
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

The package is split by concept: :mod:`~producer.formats.records` (the types and line errors),
:mod:`~producer.formats.validation` (field checks shared by the JSON formats),
:mod:`~producer.formats.jsonl` and :mod:`~producer.formats.openai_batch` (one line parser each).
The streaming reader and format detection stay here, next to the JSON loader and chunk size that
tests swap out on this module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from lmdq.contract import Endpoint
from lmdq.submission.formats.jsonl import _parse_jsonl
from lmdq.submission.formats.openai_batch import _parse_openai
from lmdq.submission.formats.records import InputError, InputFormat, InputLimits, ParsedLine, _got, _LineError

__all__ = [
    "InputError", "InputFormat", "InputLimits", "ParsedLine", "detect_format", "iter_lines", "iter_records",
    "iter_records_data", "read_request_at", "request_lines",
]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class _DuplicateKey(ValueError):
    """A key twice in one JSON object: parsers disagree on which value wins, so it is refused."""

    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return obj


#: the stdlib's decoders, each built ONCE: ``json.loads`` with any keyword builds a new decoder per call
#: (issue 49: 3.5 % of a submit's CPU)
_EXACT_DECODER = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
_FAST_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _text(data: bytes | str) -> str:
    return data if isinstance(data, str) else data.decode("utf-8")


def _stdlib_loads(data: bytes | str) -> Any:
    """Stdlib parser: refuses NaN/Infinity like orjson, and duplicate keys (exactly, naming the key)."""
    return _EXACT_DECODER.decode(_text(data))


# Every key in JSON text ends with '"', optional whitespace and ':'. Inside a string '"' only occurs
# escaped, so counting this pattern gives an upper bound on the keys written (``\":`` in a string,
# or a string that starts with ':', count too, and never hide one).
_KEY_END = re.compile(r'"\s*:')
_KEY_END_B = re.compile(rb'"\s*:')


def _count_keys(obj: Any) -> int:
    """Keys in a parsed JSON object or array, nested ones included. Recursive on purpose (3x faster
    than a stack here); a line nested deeper than the recursion limit raises RecursionError, which
    the reader reports as 'nested too deeply' like the parsers do."""
    n = 0
    if type(obj) is dict:
        n = len(obj)
        obj = obj.values()
    for v in obj:
        t = type(v)
        if t is dict or t is list:
            n += _count_keys(v)
    return n


def _fast_json_loads(data: bytes | str) -> Any:
    """The stdlib parser without the pairs hook (C all the way); refuses NaN/Infinity."""
    return _FAST_DECODER.decode(_text(data))


def _checked(parse: Callable[[bytes | str], Any]) -> Callable[[bytes | str], Any]:
    """``parse`` (which keeps the last of duplicate keys silently) plus a cheap duplicate check.

    Why not the stdlib's pairs hook throughout: a Python call per object costs ~25% of the reader's
    throughput; a substring count costs little, and the exact (slower) parse runs only when the
    count says a key may be missing: a duplicate, or a rare false alarm (``\\":`` in a string).
    """

    def loads(data: bytes | str) -> Any:
        obj = parse(data)
        if type(obj) is dict or type(obj) is list:
            if isinstance(data, bytes):
                written = data.count(b'":')
                if b'" ' in data or b'"\t' in data or b'"\r' in data:  # a key may be written '"key" :'
                    written = len(_KEY_END_B.findall(data))
            else:
                written = data.count('":')
                if '" ' in data or '"\t' in data or '"\r' in data:
                    written = len(_KEY_END.findall(data))
            # written >= keys in the text >= keys parsed; equal to the top level's (and its objects'): no twin
            if type(obj) is dict:
                seen = len(obj)
                if written > seen:
                    for v in obj.values():
                        if type(v) is dict:
                            seen += len(v)
            else:
                seen = 0
            if written > seen and written > _count_keys(obj):
                return _stdlib_loads(data)
        return obj

    return loads


_loads: Callable[[bytes | str], Any]
try:  # orjson is ~2x faster than the stdlib parser here
    from orjson import loads as _orjson_loads

    _loads = _checked(_orjson_loads)
except ImportError:  # pragma: no cover - exercised only where orjson is absent
    _loads = _checked(_fast_json_loads)

_CHUNK = 1 << 20  # readline granularity: bounds memory while skipping an over-long line
_BOM = b"\xef\xbb\xbf"


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
    if isinstance(exc, _DuplicateKey):
        return (f"duplicate key {exc.key!r} in one JSON object; expected each key once "
                "(JSON parsers disagree on which value wins)")
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON at column {exc.colno}: {exc.msg}; expected one JSON object per line"
    if isinstance(exc, RecursionError):
        return "invalid JSON: nested too deeply; expected one JSON object per line"
    return f"invalid JSON: {exc}; expected one JSON object per line"


def iter_lines(
    path: Path, *, fmt: InputFormat | None = None, limits: InputLimits = InputLimits(),
    endpoint: Endpoint | None = None,
) -> Iterator[ParsedLine | InputError]:
    """Stream ``path``, yielding a ParsedLine per valid request and an InputError per bad line.

    Parsing continues after errors; the caller decides how many to show.  Memory stays flat:
    one line (at most ``limits.max_line_bytes``) is held at a time.  ``OSError`` from opening
    the file propagates.
    """
    for _offset, item in iter_records(path, fmt=fmt, limits=limits, endpoint=endpoint):
        yield item


def iter_records(
    path: Path, *, fmt: InputFormat | None = None, limits: InputLimits = InputLimits(),
    endpoint: Endpoint | None = None,
) -> Iterator[tuple[int, ParsedLine | InputError]]:
    """:func:`iter_lines` with each line's file offset: ``(offset, item)``. The offset lets a caller
    read one request again later (:func:`read_request_at`) without holding the file in memory. ``endpoint``
    (submit's ``--endpoint``): every line's endpoint; a line naming another is an error."""
    for offset, _data, item in iter_records_data(path, fmt=fmt, limits=limits, endpoint=endpoint):
        yield offset, item


def iter_records_data(
    path: Path, *, fmt: InputFormat | None = None, limits: InputLimits = InputLimits(),
    endpoint: Endpoint | None = None,
) -> Iterator[tuple[int, bytes | None, ParsedLine | InputError]]:
    """:func:`iter_records` with each line's bytes too (newline stripped; None for a line over the limit):
    ``(offset, data, item)``. Submit keeps a checksum of each accepted line's bytes, so a file edited
    between its passes is found without parsing it again (:mod:`lmdq.submission.submit`)."""
    path = Path(path)
    if fmt is None:
        fmt = detect_format(path)
    name = str(path)
    parse = _parser(fmt, endpoint)
    is_text = fmt is InputFormat.text
    line_parser = _parse_line if is_text else _parse_json_line
    count = 0
    max_requests = limits.max_requests
    max_bytes = limits.max_line_bytes
    with open(path, "rb", buffering=256 * 1024) as f:
        for line_no, start, data, size in _read_lines(f, max_bytes):
            if data is not None:
                body = data[len(_BOM) :] if line_no == 1 and data.startswith(_BOM) else data
                if not body or body.isspace():
                    continue
            count += 1
            if count > max_requests:
                too_many = f"too many requests: the limit is {max_requests:,} per file"
                yield start, data, InputError(name, line_no, None, too_many)
                return
            yield start, data, line_parser(name, line_no, start, data, size, max_bytes, is_text, parse, endpoint)
    if count == 0:
        yield 0, None, InputError(name, 0, None, "file has no requests (expected at least one non-blank line)")


def request_lines(path: Path, *, limits: InputLimits = InputLimits()) -> Iterator[tuple[int, bytes | None]]:
    """``(line number, bytes)`` of every line :func:`iter_records_data` would parse (blank lines skipped, a
    line over the limit as None), without parsing any: what submit's check that the file did not change
    reads (:mod:`lmdq.submission.submit`)."""
    with open(Path(path), "rb", buffering=256 * 1024) as f:
        for line_no, _start, data, _size in _read_lines(f, limits.max_line_bytes):
            if data is not None:
                body = data[len(_BOM) :] if line_no == 1 and data.startswith(_BOM) else data
                if not body or body.isspace():
                    continue
            yield line_no, data


def _parser(fmt: InputFormat, endpoint: Endpoint | None) -> Callable[[dict[str, Any], int], ParsedLine]:
    """The line parser of ``fmt`` with submit's ``--endpoint`` (if any) bound in."""
    parse = _parse_openai if fmt is InputFormat.openai else _parse_jsonl
    if endpoint is None:
        return parse
    return lambda obj, line_no: parse(obj, line_no, endpoint)


def read_request_at(
    f: IO[bytes], name: str, offset: int, line_no: int, *, fmt: InputFormat, limits: InputLimits = InputLimits(),
    endpoint: Endpoint | None = None,
) -> ParsedLine | InputError:
    """The request on the line at ``offset`` of the open file ``f`` (line ``line_no``, as
    :func:`iter_records` reported it), parsed exactly as the streaming reader parses it."""
    f.seek(offset)
    for _no, start, data, size in _read_lines(f, limits.max_line_bytes):
        return _parse_line(name, line_no, start + offset, data, size, limits.max_line_bytes,
                           fmt is InputFormat.text, _parser(fmt, endpoint), endpoint)
    return InputError(name, line_no, None, "the line is gone (the file is shorter than when it was read)")


def _parse_line(
    name: str, line_no: int, start: int, data: bytes | None, size: int, max_bytes: int, is_text: bool,
    parse: Callable[[dict[str, Any], int], ParsedLine], endpoint: Endpoint | None = None,
) -> ParsedLine | InputError:
    """One non-blank line → its request or its error (``data`` None: the line was over ``max_bytes``)."""
    if data is None:
        over = f"line is {size:,} bytes, over the limit of {max_bytes:,} bytes per line"
        return InputError(name, line_no, None, over)
    bom = 0
    if line_no == 1 and data.startswith(_BOM):
        data = data[len(_BOM) :]
        bom = len(_BOM)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        hint = ""
        if line_no == 1 and data[:2] in (b"\xff\xfe", b"\xfe\xff"):
            hint = " (the file looks like UTF-16; save it as UTF-8)"
        return InputError(
            name,
            line_no,
            None,
            f"invalid UTF-8 at byte {exc.start + bom} of the line (file offset {start + bom + exc.start}); "
            f"expected UTF-8 text{hint}",
        )
    if is_text:
        return ParsedLine(line_no, str(line_no), text, None, endpoint or Endpoint.chat, None, None)
    try:
        obj = _loads(text)
    except (ValueError, RecursionError) as exc:
        return InputError(name, line_no, None, _json_error(exc))
    return _parsed(name, line_no, obj, parse)


def _parse_json_line(
    name: str, line_no: int, start: int, data: bytes | None, size: int, max_bytes: int, is_text: bool,
    parse: Callable[[dict[str, Any], int], ParsedLine], endpoint: Endpoint | None = None,
) -> ParsedLine | InputError:
    """:func:`_parse_line` of a JSON format, the line's bytes parsed as they are (orjson checks the UTF-8 as
    it parses: no decoded copy, issue 49); a line that fails either way goes through :func:`_parse_line`,
    whose error names the byte or column as always."""
    if data is not None and not (line_no == 1 and data.startswith(_BOM)):
        try:
            obj = _loads(data)
        except (ValueError, RecursionError):
            pass
        else:
            return _parsed(name, line_no, obj, parse)
    return _parse_line(name, line_no, start, data, size, max_bytes, is_text, parse, endpoint)


def _parsed(name: str, line_no: int, obj: Any, parse: Callable[[dict[str, Any], int], ParsedLine]
            ) -> ParsedLine | InputError:
    if not isinstance(obj, dict):
        hint = " (for one plain prompt per line use a .txt file)" if isinstance(obj, str) else ""
        return InputError(name, line_no, None, f"expected a JSON object, got {_got(obj)}{hint}")
    try:
        return parse(obj, line_no)
    except _LineError as exc:
        return InputError(name, line_no, exc.field, exc.message)
