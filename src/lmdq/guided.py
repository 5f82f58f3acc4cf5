"""Guided decoding (``response_format``) helpers shared by the producer and the engines.

* :func:`schema_of` / :func:`grammar_source`: what a :class:`~lmdq.contract.ResponseFormat` constrains to,
  read the way LMDeploy 0.18 reads it (``json_schema`` may be OpenAI's ``{"name", "schema", "strict"}``
  wrapper or the schema itself; ``json_object`` is "any JSON object").
* :func:`to_lmdeploy`: the dict LMDeploy's ``GenerationConfig.response_format`` expects.
* :func:`check`: submit-time validation. With ``xgrammar`` installed (the worker extras: it is the
  grammar engine LMDeploy and lmdq's transformers engine use) the format is compiled exactly as a worker
  would. The producer's base install stays light (xgrammar pulls torch and triton), so without it a JSON
  schema is checked against its JSON Schema meta-schema when ``jsonschema`` is importable (else only
  structurally), and a regex is checked with Python's ``re`` (close to, not identical with, xgrammar's
  regex dialect).
"""

from __future__ import annotations

import json
import re
from typing import Any

from lmdq.contract import ResponseFormat

__all__ = ["check", "grammar_source", "schema_of", "to_lmdeploy"]

#: ``json_object``: any JSON object (LMDeploy compiles the same schema).
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object", "additionalProperties": True}


def schema_of(rf: ResponseFormat) -> Any:
    """The JSON schema of a json_schema/json_object format (a dict or a bool); None for regex."""
    if rf.type == "json_object":
        return JSON_OBJECT_SCHEMA
    if rf.type != "json_schema":
        return None
    schema: Any = rf.json_schema
    if isinstance(schema, dict):
        for key in ("json_schema", "schema"):
            if key in schema:
                schema = schema[key]
                break
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"json_schema.schema is a string but not JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json_schema.schema must be an object, got {type(schema).__name__}")
    return schema


def grammar_source(rf: ResponseFormat) -> tuple[str, str]:
    """('json_schema', schema as JSON text) or ('regex', pattern): what xgrammar compiles."""
    if rf.type == "regex":
        return "regex", rf.regex or ""
    return "json_schema", json.dumps(schema_of(rf), ensure_ascii=False)


def to_lmdeploy(rf: ResponseFormat | dict[str, Any] | None) -> dict[str, Any] | None:
    """lmdq's ResponseFormat → LMDeploy's ``response_format`` dict (lmdeploy/_guided_decoding.py)."""
    if rf is None:
        return None
    if isinstance(rf, dict):
        rf = ResponseFormat.model_validate(rf)
    if rf.type == "regex":
        return {"type": "regex_schema", "regex_schema": rf.regex}
    if rf.type == "json_object":
        return {"type": "json_object"}
    wrapper = rf.json_schema or {}
    name = wrapper.get("name") if isinstance(wrapper.get("name"), str) else "lmdq"
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema_of(rf)}}


def _clean(exc: BaseException) -> str:
    """xgrammar's C++ messages start with '[hh:mm:ss] /project/cpp/file.cc:N: '; keep the sentence."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip()).strip()


def check(rf: ResponseFormat) -> None:
    """Raise ValueError when ``rf`` cannot be compiled (see the module docstring for how exactly)."""
    kind, source = grammar_source(rf)
    try:
        import xgrammar as xgr

        have_xgrammar = True
    except ImportError:
        have_xgrammar = False
    if have_xgrammar:
        try:
            if kind == "regex":
                xgr.Grammar.from_regex(source)
            else:
                xgr.Grammar.from_json_schema(source)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/TypeError
            what = "regex" if kind == "regex" else "JSON schema"
            raise ValueError(f"invalid {what} (xgrammar cannot compile it): {_clean(exc)}") from None
        return
    if kind == "regex":
        try:
            re.compile(source)
        except re.error as exc:
            raise ValueError(f"invalid regex: {exc}") from None
        return
    schema = json.loads(source)
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"invalid JSON schema: {exc.message}") from None
