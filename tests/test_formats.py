"""Prompt-file parsing: every format's field mapping and every bad-input case with file:line:field."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from lmdq.contract import Endpoint, GenerationParams, Request
from lmdq.submission import formats
from lmdq.submission.formats import (
    InputError,
    InputFormat,
    InputLimits,
    ParsedLine,
    detect_format,
    iter_lines,
)

DATA = Path(__file__).parent / "data"
GOOD = DATA / "good"
BAD = DATA / "bad"
EXAMPLES = Path(__file__).parent.parent / "examples"


def parse(path: Path, **kw: object) -> list[ParsedLine | InputError]:
    return list(iter_lines(path, **kw))  # type: ignore[arg-type]


def only_errors(items: list[ParsedLine | InputError]) -> list[InputError]:
    return [i for i in items if isinstance(i, InputError)]


def write(tmp_path: Path, name: str, lines: list[object]) -> Path:
    p = tmp_path / name
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return p


# ---------------------------------------------------------------------------------------------
# Detection


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("good/prompts.txt", InputFormat.text),
        ("good/prompts.jsonl", InputFormat.jsonl),
        ("good/openai_batch.jsonl", InputFormat.openai),
        ("bad/empty.jsonl", InputFormat.jsonl),
        ("bad/malformed_json.jsonl", InputFormat.jsonl),
        ("bad/openai_mixed_formats.jsonl", InputFormat.openai),
    ],
)
def test_detect_format(name: str, fmt: InputFormat) -> None:
    assert detect_format(DATA / name) is fmt


def test_detect_skips_blank_lines_and_bom(tmp_path: Path) -> None:
    p = tmp_path / "batch.json"
    body = {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x"}}
    p.write_bytes(b"\xef\xbb\xbf\n  \n" + json.dumps(body).encode() + b"\n")
    assert detect_format(p) is InputFormat.openai
    [item] = parse(p)
    assert isinstance(item, ParsedLine) and item.line_no == 3 and item.prompt == "x"


def test_txt_suffix_wins_over_content(tmp_path: Path) -> None:
    p = write(tmp_path, "PROMPTS.TXT", [{"prompt": "x"}])
    assert detect_format(p) is InputFormat.text
    [item] = parse(p)
    assert isinstance(item, ParsedLine) and item.prompt == '{"prompt": "x"}'


def test_explicit_fmt_overrides_detection(tmp_path: Path) -> None:
    p = write(tmp_path, "p.jsonl", ["just a plain prompt"])
    [item] = parse(p, fmt=InputFormat.text)
    assert isinstance(item, ParsedLine) and item.prompt == "just a plain prompt"


# ---------------------------------------------------------------------------------------------
# Good inputs


def test_text_format() -> None:
    items = parse(GOOD / "prompts.txt")
    assert all(isinstance(i, ParsedLine) for i in items)
    assert [(i.line_no, i.custom_id, i.prompt) for i in items] == [  # type: ignore[union-attr]
        (1, "1", "What is the capital of France?"),
        (3, "3", "Write a haiku about the sea."),
        (4, "4", "What is 2+2?"),
        (5, "5", 'Translate "hello" to French.'),  # trailing '\r' stripped
    ]
    for i in items:
        assert isinstance(i, ParsedLine)
        assert i.endpoint is Endpoint.chat and i.messages is None and i.params is None and i.model is None


def test_text_last_line_without_newline(tmp_path: Path) -> None:
    p = tmp_path / "p.txt"
    p.write_bytes(b"  keep  spaces \r\n\t\nlast")
    items = parse(p)
    assert [(i.line_no, i.prompt) for i in items] == [(1, "  keep  spaces "), (3, "last")]  # type: ignore[union-attr]


def test_jsonl_format() -> None:
    items = parse(GOOD / "prompts.jsonl")
    assert not only_errors(items)
    capital, math, haiku, italy, nulls = items
    assert isinstance(capital, ParsedLine)
    assert (capital.line_no, capital.custom_id, capital.prompt, capital.messages) == (
        1,
        "capital",
        "What is the capital of France?",
        None,
    )
    assert capital.endpoint is Endpoint.chat and capital.params is None and capital.model is None
    assert isinstance(math, ParsedLine)
    assert math.messages is not None and [m["role"] for m in math.messages] == ["system", "user"]
    assert math.params == GenerationParams(max_new_tokens=8)
    assert isinstance(haiku, ParsedLine)
    assert haiku.line_no == 4 and haiku.custom_id == "42"  # blank line 3 counted; int id -> str
    assert isinstance(italy, ParsedLine)
    assert italy.custom_id == "5" and italy.endpoint is Endpoint.completion  # default id: the line number
    assert italy.params == GenerationParams(
        max_new_tokens=4, stop_words=["."], temperature=0.7, do_sample=True, top_p=0.9, random_seed=7
    )
    assert isinstance(nulls, ParsedLine) and nulls.params is None and nulls.endpoint is Endpoint.chat


def test_openai_format_field_mapping() -> None:
    items = parse(GOOD / "openai_batch.jsonl")
    assert not only_errors(items)
    chat1, chat2, comp, chat3 = items
    assert isinstance(chat1, ParsedLine)
    assert chat1.custom_id == "chat-1" and chat1.model == "smollm2-135m" and chat1.endpoint is Endpoint.chat
    assert chat1.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    assert chat1.params == GenerationParams(
        max_new_tokens=32, temperature=0.7, do_sample=True, top_p=0.9, stop_words=["\n"], random_seed=1234, logprobs=3
    )
    assert isinstance(chat2, ParsedLine)
    assert chat2.params == GenerationParams(
        max_new_tokens=8,
        temperature=0.0,
        do_sample=False,
        stop_words=["\n", "."],
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
        ignore_eos=False,
        min_new_tokens=2,
        logprobs=1,  # logprobs: true without top_logprobs
    )
    assert isinstance(comp, ParsedLine)
    assert comp.endpoint is Endpoint.completion and comp.prompt == "The capital of France is" and comp.messages is None
    assert comp.params == GenerationParams(max_new_tokens=5, logprobs=1)
    assert isinstance(chat3, ParsedLine)  # no model, no params; custom_id is required in this format (#19)
    assert chat3.custom_id == "chat-3" and chat3.model is None and chat3.params is None


@pytest.mark.parametrize("name", ["good/prompts.txt", "good/prompts.jsonl", "good/openai_batch.jsonl"])
def test_parsed_lines_are_valid_contract_requests(name: str) -> None:
    """Whatever the parser accepts must build a wire Request (the caller relies on it)."""
    for index, item in enumerate(parse(DATA / name)):
        assert isinstance(item, ParsedLine)
        Request(
            index=index,
            custom_id=item.custom_id,
            prompt=item.prompt,
            messages=item.messages,  # type: ignore[arg-type]
            endpoint=item.endpoint,
            params=item.params,
        )


def test_example_prompts_file() -> None:
    items = parse(EXAMPLES / "prompts.jsonl")
    assert len(items) == 8 and not only_errors(items)
    ids = [i.custom_id for i in items]  # type: ignore[union-attr]
    assert len(set(ids)) == 8
    assert any(i.prompt is not None for i in items) and any(i.messages is not None for i in items)  # type: ignore[union-attr]
    params = [i.params for i in items if i.params is not None]  # type: ignore[union-attr]
    assert any(p.stop_words for p in params)
    assert all(p.max_new_tokens is None or p.max_new_tokens <= 64 for p in params)


def test_bom_and_crlf(tmp_path: Path) -> None:
    p = tmp_path / "p.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n{"prompt": "b"}\r\n')
    assert [i.prompt for i in parse(p)] == ["a", "b"]  # type: ignore[union-attr]


def test_openai_line_without_optional_method_and_null_values(tmp_path: Path) -> None:
    line = {
        "custom_id": "a",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "x"}], "temperature": None, "stop": None, "n": None,
                 "stream": None},
    }
    [item] = parse(write(tmp_path, "o.jsonl", [line]))
    assert isinstance(item, ParsedLine) and item.params is None and item.custom_id == "a"


# ---------------------------------------------------------------------------------------------
# Bad inputs: (file, line, field or None, substring of the message)

BAD_CASES = [
    ("malformed_json.jsonl", 2, None, "invalid JSON at column"),
    ("not_object.jsonl", 2, None, "expected a JSON object, got a list"),
    ("prompt_wrong_type.jsonl", 2, "prompt", "expected a string, got 42"),
    ("param_wrong_type.jsonl", 2, "params.max_new_tokens", "expected an integer, got '64'"),
    ("missing_prompt.jsonl", 2, "prompt", "got neither"),
    ("both_prompt_and_messages.jsonl", 2, "messages", "exactly one of 'prompt' or 'messages'"),
    ("empty_messages.jsonl", 2, "messages", "expected at least one message"),
    ("bad_role.jsonl", 2, "messages[1].role", "expected one of system|user|assistant"),
    ("audio_content_part.jsonl", 2, "messages[0].content[1].type", "expected 'text' or 'image_url'"),
    ("unknown_top_level_key.jsonl", 2, "temperature",
     "expected only custom_id|prompt|messages|params|endpoint|model|continuations"),
    ("unknown_param.jsonl", 2, "params.max_length", "unknown parameter; expected one of max_new_tokens"),
    ("temperature_out_of_range.jsonl", 2, "params.temperature", "expected a number from 0.0 to 2.0, got 5"),
    ("min_over_max.jsonl", 2, "params.min_new_tokens", "expected at most params.max_new_tokens (5), got 10"),
    ("bad_endpoint.jsonl", 2, "endpoint", "expected one of chat|completion|score|reward|embedding, got 'embeddings'"),
    ("completion_with_messages.jsonl", 2, "messages", "expected 'prompt' for endpoint 'completion'"),
    ("custom_id_float.jsonl", 2, "custom_id", "expected a string or an integer, got 1.5"),
    ("empty_prompt.jsonl", 2, "prompt", "expected a non-empty string"),
    ("openai_unknown_url.jsonl", 2, "url", "expected one of /v1/chat/completions|/v1/completions"),
    ("openai_n_over_max.jsonl", 2, "body.n", "expected an integer from 1 to 128, got 129"),
    ("openai_missing_custom_id.jsonl", 2, "custom_id", "required field is missing"),
    ("openai_stream_true.jsonl", 2, "body.stream", "expected false or null, got true: a batch request cannot stream"),
    ("openai_temperature_out_of_range.jsonl", 2, "body.temperature", "expected a number from 0.0 to 2.0, got 5"),
    ("openai_wrong_method.jsonl", 2, "method", "expected 'POST', got 'GET'"),
    ("openai_list_prompt.jsonl", 2, "body.prompt", "list prompts are not supported"),
    ("openai_frequency_penalty.jsonl", 2, "body.frequency_penalty", "unsupported"),
    ("openai_unknown_body_key.jsonl", 2, "body.tools", "unsupported key; expected only"),
    ("openai_missing_body.jsonl", 2, "body", "required field is missing"),
    ("openai_mixed_formats.jsonl", 2, "prompt", "OpenAI batch format"),
    ("openai_top_logprobs_without_logprobs.jsonl", 2, "body.top_logprobs", '"logprobs": true'),
    ("openai_stop_wrong_type.jsonl", 2, "body.stop[1]", "expected a string, got 7"),
    ("openai_messages_on_completions.jsonl", 2, "body.messages", "belongs to url /v1/chat/completions"),
    ("openai_max_tokens_zero.jsonl", 2, "body.max_tokens", "expected an integer from 1 to"),
    ("whitespace_prompt.jsonl", 2, "prompt", "expected some text, got only whitespace"),
    ("message_without_content.jsonl", 2, "messages[1].content", "got nothing (the key is missing)"),
    ("openai_tool_calls_without_content.jsonl", 2, "body.messages[1].content", "lmdq serves no tools"),
    ("duplicate_key.jsonl", 2, None, "duplicate key 'prompt' in one JSON object; expected each key once"),
    ("duplicate_nested_key.jsonl", 2, None, "duplicate key 'temperature'"),
    ("param_alias_and_name.jsonl", 2, "params.stop", "same parameter as params.stop_words; set only one"),
    ("param_alias_stop_wrong_type.jsonl", 2, "params.stop[1]", "expected a string, got 7"),
]


def test_bad_corpus_is_fully_covered() -> None:
    listed = {c[0] for c in BAD_CASES} | {"empty.jsonl", "blank_only.jsonl", "empty.txt"}
    assert listed == {p.name for p in BAD.iterdir()}


@pytest.mark.parametrize(("name", "line", "field", "message"), BAD_CASES)
def test_bad_line(name: str, line: int, field: str | None, message: str) -> None:
    items = parse(BAD / name)
    assert isinstance(items[0], ParsedLine) and items[0].custom_id == "ok"  # line 1 is fine
    [err] = only_errors(items)
    assert (err.path, err.line, err.field) == (str(BAD / name), line, field)
    assert message in err.message
    text = str(err)
    assert text.startswith(f"{BAD / name}:{line}: ")
    assert name in text
    if field is not None:
        assert f"field '{field}': " in text
    assert message in text


@pytest.mark.parametrize("name", ["empty.jsonl", "blank_only.jsonl", "empty.txt"])
def test_empty_file(name: str) -> None:
    [err] = parse(BAD / name)
    assert isinstance(err, InputError)
    assert err.line == 0 and err.field is None and "file has no requests" in err.message
    assert str(err) == f"{BAD / name}: {err.message}"


def test_error_str_format() -> None:
    err = InputError("prompts.jsonl", 12, "body.messages[0].role", "expected one of system|user, got 'bot'")
    assert str(err) == "prompts.jsonl:12: field 'body.messages[0].role': expected one of system|user, got 'bot'"
    assert str(InputError("p.txt", 3, None, "boom")) == "p.txt:3: boom"


def test_parsing_continues_after_errors(tmp_path: Path) -> None:
    p = write(tmp_path, "p.jsonl", ["{bad", {"prompt": 1}, "", {"prompt": "ok"}, "[]", {"prompt": "ok2"}])
    items = parse(p)
    assert [(type(i).__name__, getattr(i, "line", None) or getattr(i, "line_no", None)) for i in items] == [
        ("InputError", 1),
        ("InputError", 2),
        ("ParsedLine", 4),
        ("InputError", 5),
        ("ParsedLine", 6),
    ]


def test_invalid_utf8(tmp_path: Path) -> None:
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n{"prompt": "next"}\n')
    ok, err, nxt = parse(p)
    assert isinstance(err, InputError)
    assert err.line == 2 and err.field is None
    assert "invalid UTF-8 at byte 15 of the line (file offset 32)" in str(err)
    assert str(err).startswith(f"{p}:2: ")
    assert isinstance(ok, ParsedLine) and isinstance(nxt, ParsedLine) and nxt.prompt == "next"


def test_invalid_utf8_text_and_utf16_hint(tmp_path: Path) -> None:
    p = tmp_path / "p.txt"
    p.write_bytes("hello\n".encode("utf-16"))
    errors = only_errors(parse(p))
    assert errors[0].line == 1 and "UTF-16" in errors[0].message


def test_nan_and_deep_nesting_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write(tmp_path, "p.jsonl", ['{"prompt": "x", "params": {"temperature": NaN}}', "[" * 5000 + "]" * 5000])
    for loads in (formats._loads, formats._stdlib_loads):
        monkeypatch.setattr(formats, "_loads", loads)
        errs = only_errors(parse(p))
        assert [e.line for e in errs] == [1, 2]
        assert all("invalid JSON" in e.message for e in errs)


def test_custom_id_rules(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        "p.jsonl",
        [
            {"custom_id": 7, "prompt": "x"},
            {"custom_id": True, "prompt": "x"},
            {"custom_id": "x" * 513, "prompt": "x"},
            {"custom_id": None, "prompt": "x"},
        ],
    )
    a, b, c, d = parse(p)
    assert isinstance(a, ParsedLine) and a.custom_id == "7"
    assert isinstance(b, InputError) and b.field == "custom_id" and "got true" in b.message
    assert isinstance(c, InputError) and "at most 512 characters" in c.message
    assert isinstance(d, ParsedLine) and d.custom_id == "4"


def test_got_values_are_truncated(tmp_path: Path) -> None:
    p = write(tmp_path, "p.jsonl", [{"prompt": "x", "endpoint": "e" * 5000}])
    [err] = parse(p)
    assert isinstance(err, InputError) and len(err.message) < 130  # the value is cut, whatever the tmp path


# ---------------------------------------------------------------------------------------------
# Limits


def test_max_requests_stops(tmp_path: Path) -> None:
    p = write(tmp_path, "p.txt", ["a", "", "b", "c", "d"])
    items = parse(p, limits=InputLimits(max_requests=2))
    assert [type(i).__name__ for i in items] == ["ParsedLine", "ParsedLine", "InputError"]
    err = items[-1]
    assert isinstance(err, InputError) and err.line == 4 and "too many requests" in err.message and "2" in err.message


def test_line_limit_boundaries(tmp_path: Path) -> None:
    p = tmp_path / "p.txt"
    p.write_bytes(b"a" * 100 + b"\r\n" + b"b" * 101 + b"\n" + b"c" * 150 + b"\r\n" + b"ok\n" + b"d" * 101)
    items = parse(p, limits=InputLimits(max_line_bytes=100))
    assert isinstance(items[0], ParsedLine) and items[0].prompt == "a" * 100
    errs = {e.line: e.message for e in only_errors(items)}
    assert set(errs) == {2, 3, 5}
    assert "line is 101 bytes, over the limit of 100 bytes" in errs[2]
    assert "line is 150 bytes" in errs[3]
    assert isinstance(items[3], ParsedLine) and items[3].prompt == "ok" and items[3].line_no == 4


def test_multi_chunk_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines longer than one readline chunk are joined when under the limit, dropped when over."""
    monkeypatch.setattr(formats, "_CHUNK", 16)
    prompt = "x" * 80
    p = write(tmp_path, "p.jsonl", [{"prompt": prompt}, {"prompt": "y" * 500}, {"prompt": "z"}])
    items = parse(p, limits=InputLimits(max_line_bytes=100))
    assert isinstance(items[0], ParsedLine) and items[0].prompt == prompt
    assert isinstance(items[1], InputError) and items[1].line == 2 and "line is 514 bytes" in items[1].message
    assert isinstance(items[2], ParsedLine) and items[2].prompt == "z" and items[2].line_no == 3


def test_50mb_line_memory_stays_bounded(tmp_path: Path) -> None:
    p = tmp_path / "huge.jsonl"
    size = 50 * 1024 * 1024
    with open(p, "wb") as f:
        f.write(b'{"prompt": "before"}\n{"prompt": "')
        block = b"a" * (1024 * 1024)
        for _ in range(size // len(block)):
            f.write(block)
        f.write(b'"}\n{"prompt": "after"}\n')
    tracemalloc.start()
    try:
        items = parse(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 * 1024 * 1024, f"peak {peak / 2**20:.1f} MiB"
    before, err, after = items
    assert isinstance(before, ParsedLine) and isinstance(after, ParsedLine) and after.line_no == 3
    assert isinstance(err, InputError) and err.line == 2
    assert f"line is {size + 14:,} bytes, over the limit of {10 * 1024 * 1024:,} bytes" in str(err)
    assert str(err).startswith(f"{p}:2: ")


@pytest.mark.parametrize("line", [
    '{"prompt": "a", "prompt": "b"}',
    '{"prompt" : "a", "prompt"\t: "b"}',  # whitespace before the colon
    '{"messages": [{"role": "user", "content": "x", "role": "system"}]}',  # nested in a list
    '{"prompt": "say \\":\\" twice", "params": {"top_k": 1, "top_k": 2}}',  # an escaped quote too
])
def test_duplicate_keys_are_refused_by_every_loader(tmp_path: Path, line: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for loads in _loaders():
        monkeypatch.setattr(formats, "_loads", loads)
        [err] = parse(write(tmp_path, "d.jsonl", [line]))
        assert isinstance(err, InputError) and err.line == 1 and "duplicate key" in err.message, (loads, err)


@pytest.mark.parametrize("line", [
    '{"prompt": "say \\": and \\":\\" here"}',  # '\":' in a string: the count's false alarm, accepted
    '{"prompt": ":leading colon", "custom_id": ":x"}',
    '{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "a"}]}',  # same keys, 2 objects
])
def test_lines_without_duplicates_are_accepted_by_every_loader(tmp_path: Path, line: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for loads in _loaders():
        monkeypatch.setattr(formats, "_loads", loads)
        [item] = parse(write(tmp_path, "ok.jsonl", [line]))
        assert isinstance(item, ParsedLine), (loads, item)


def _loaders() -> list[object]:
    """Every loader the reader may use: the exact stdlib one, and the fast parsers with their cheap
    duplicate check (orjson's only where orjson is installed)."""
    out: list[object] = [formats._stdlib_loads, formats._checked(formats._fast_json_loads)]
    try:
        import orjson
    except ImportError:
        return out
    return [*out, formats._checked(orjson.loads)]


def test_message_content_rules(tmp_path: Path) -> None:
    cases = [
        ({"role": "user", "content": None}, "got null"),
        ({"role": "user", "content": []}, "expected at least one text part, got an empty list"),
        ({"role": "assistant", "tool_calls": []}, "lmdq serves no tools"),
    ]
    for msg, message in cases:
        [err] = parse(write(tmp_path, "m.jsonl", [{"messages": [msg]}]))
        assert isinstance(err, InputError) and err.field == "messages[0].content" and message in err.message
    [ok] = parse(write(tmp_path, "m.jsonl", [{"messages": [{"role": "user", "content": " "},
                                                          {"role": "user", "content": "x"}]}]))
    assert isinstance(ok, ParsedLine)  # a blank message inside a conversation is the user's call


def test_whitespace_only_prompt_in_openai_completions(tmp_path: Path) -> None:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "\n \t"}}
    [err] = parse(write(tmp_path, "o.jsonl", [line]))
    assert isinstance(err, InputError) and err.field == "body.prompt" and "only whitespace" in err.message


# ---------------------------------------------------------------------------------------------
# lmdq JSONL params: the producer's flag names as aliases, and sampling without do_sample


def test_jsonl_params_accept_the_cli_names(tmp_path: Path) -> None:
    p = write(tmp_path, "a.jsonl", [
        {"prompt": "x", "params": {"stop": "\n", "seed": 7, "max_tokens": 9}},
        {"prompt": "y", "params": {"stop": ["a", "b"]}},
        {"prompt": "z", "params": {"stop_words": ["a"], "random_seed": 1, "max_new_tokens": 3}},
    ])
    one, two, three = parse(p)
    assert isinstance(one, ParsedLine) and one.params == GenerationParams(stop_words=["\n"], random_seed=7,
                                                                          max_new_tokens=9)
    assert isinstance(two, ParsedLine) and two.params == GenerationParams(stop_words=["a", "b"])
    assert isinstance(three, ParsedLine) and three.params == GenerationParams(stop_words=["a"], random_seed=1,
                                                                              max_new_tokens=3)


@pytest.mark.parametrize(("params", "field"), [
    ({"seed": 1, "random_seed": 1}, "params.random_seed"),
    ({"max_new_tokens": 3, "max_tokens": 3}, "params.max_tokens"),
    ({"stop": "a", "stop_words": ["a"]}, "params.stop_words"),
])
def test_an_alias_and_its_name_together_are_refused(tmp_path: Path, params: dict[str, object], field: str) -> None:
    [err] = parse(write(tmp_path, "b.jsonl", [{"prompt": "x", "params": params}]))
    assert isinstance(err, InputError) and err.line == 1 and err.field == field
    assert str(err).startswith(f"{tmp_path / 'b.jsonl'}:1: field '{field}': same parameter as "), str(err)


def test_alias_errors_name_the_key_the_user_wrote(tmp_path: Path) -> None:
    [err] = parse(write(tmp_path, "c.jsonl", [{"prompt": "x", "params": {"max_tokens": 0}}]))
    assert isinstance(err, InputError) and err.field == "params.max_tokens", err


def test_temperature_without_do_sample_decides_sampling(tmp_path: Path) -> None:
    from lmdq.submission.formats.records import Sampling

    p = write(tmp_path, "s.jsonl", [
        {"prompt": "a", "params": {"temperature": 0.7}},
        {"prompt": "b", "params": {"temperature": 0}},
        {"prompt": "c", "params": {"temperature": 0.7, "do_sample": False}},
        {"prompt": "d", "params": {"top_p": 0.9}},
        {"prompt": "e", "params": {"top_k": 5, "do_sample": True}},
        {"prompt": "f", "params": {"max_tokens": 5}},
    ])
    a, b, c, d, e, f = parse(p)
    assert isinstance(a, ParsedLine) and a.params is not None
    assert a.params.do_sample is True and a.sampling is Sampling.implied
    assert isinstance(b, ParsedLine) and b.params is not None
    assert b.params.do_sample is False and b.sampling is Sampling.implied
    assert isinstance(c, ParsedLine) and c.params is not None
    assert c.params.do_sample is False and c.sampling is None  # explicit do_sample wins
    assert isinstance(d, ParsedLine) and d.params is not None
    assert d.params.do_sample is None and d.sampling is Sampling.inert  # the batch decides
    assert isinstance(e, ParsedLine) and e.sampling is None
    assert isinstance(f, ParsedLine) and f.sampling is None
