"""lmdq.guided: what a response_format constrains to, LMDeploy's dict, and submit-time checks."""

from __future__ import annotations

import pytest

from lmdq.contract import ResponseFormat
from lmdq.guided import JSON_OBJECT_SCHEMA, check, grammar_source, schema_of, to_lmdeploy

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_schema_of_reads_openai_wrapper_bare_schema_and_string() -> None:
    assert schema_of(ResponseFormat(type="json_schema", json_schema={"name": "n", "schema": SCHEMA})) == SCHEMA
    assert schema_of(ResponseFormat(type="json_schema", json_schema=SCHEMA)) == SCHEMA
    assert schema_of(ResponseFormat(type="json_schema", json_schema={"schema": '{"type": "string"}'})) == {
        "type": "string"}
    assert schema_of(ResponseFormat(type="json_object")) == JSON_OBJECT_SCHEMA
    assert schema_of(ResponseFormat(type="regex", regex="a+")) is None


def test_schema_of_refuses_non_schemas() -> None:
    with pytest.raises(ValueError, match="not JSON"):
        schema_of(ResponseFormat(type="json_schema", json_schema={"schema": "{nope"}))
    with pytest.raises(ValueError, match="must be an object, got list"):
        schema_of(ResponseFormat(type="json_schema", json_schema={"schema": [1]}))


def test_grammar_source() -> None:
    assert grammar_source(ResponseFormat(type="regex", regex="[0-9]+")) == ("regex", "[0-9]+")
    kind, text = grammar_source(ResponseFormat(type="json_schema", json_schema={"schema": {"enum": ["é"]}}))
    assert kind == "json_schema" and text == '{"enum": ["é"]}'


def test_to_lmdeploy_for_each_kind() -> None:
    assert to_lmdeploy(None) is None
    assert to_lmdeploy({"type": "regex", "regex": "x"}) == {"type": "regex_schema", "regex_schema": "x"}
    assert to_lmdeploy(ResponseFormat(type="json_object")) == {"type": "json_object"}
    assert to_lmdeploy(ResponseFormat(type="json_schema", json_schema={"name": "pt", "schema": SCHEMA})) == {
        "type": "json_schema", "json_schema": {"name": "pt", "schema": SCHEMA}}
    named = to_lmdeploy(ResponseFormat(type="json_schema", json_schema={"name": 5, "schema": SCHEMA}))
    assert named is not None and named["json_schema"]["name"] == "lmdq"  # a non-string name is not passed on


def test_check_accepts_good_formats_and_refuses_bad_ones() -> None:
    check(ResponseFormat(type="json_schema", json_schema={"schema": SCHEMA}))
    check(ResponseFormat(type="regex", regex="(yes|no)"))
    check(ResponseFormat(type="json_object"))
    with pytest.raises(ValueError, match="regex"):
        check(ResponseFormat(type="regex", regex="(unclosed"))
    with pytest.raises(ValueError, match="JSON schema"):
        check(ResponseFormat(type="json_schema", json_schema={"schema": {"type": 5}}))
