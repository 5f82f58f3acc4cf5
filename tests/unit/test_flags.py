"""lmdq.flags: a settings field's flag name, type and default come from its declaration."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from lmdq.flags import base_type, flag_name, option_name, own_fields, settings_flags


class _Nested(BaseModel):
    x: int = 1


class _Base(BaseModel):
    shared: int = 0


class _Settings(_Base):
    drain_timeout_s: float = Field(30.0, alias="LMDQ_DRAIN_TIMEOUT", description="how long a drain waits")
    max_new_tokens: Annotated[int, Field(ge=1)] | None = None
    other_alias: str = Field("a", alias="NOT_LMDQ_X")
    engine: _Nested = _Nested()
    maybe_engine: _Nested | None = None
    tags: list[Annotated[str, Field(min_length=1)]] | None = None
    port: int | str = "auto"


def test_option_name() -> None:
    assert option_name("max_new_tokens") == "--max-new-tokens"
    assert option_name("x") == "--x"


def test_flag_name_follows_the_env_var_only_for_lmdq_aliases() -> None:
    f = _Settings.model_fields
    assert flag_name("drain_timeout_s", f["drain_timeout_s"]) == "drain_timeout"
    assert flag_name("max_new_tokens", f["max_new_tokens"]) == "max_new_tokens"
    assert flag_name("other_alias", f["other_alias"]) == "other_alias"


def test_own_fields_skip_the_base_and_nested_models_in_declaration_order() -> None:
    assert own_fields(_Settings, _Base) == ["drain_timeout_s", "max_new_tokens", "other_alias", "tags", "port"]


def test_base_type_unwraps_annotated_optional_and_lists() -> None:
    f = _Settings.model_fields
    assert base_type(f["max_new_tokens"].annotation) is int
    assert base_type(f["tags"].annotation) == list[str]
    assert base_type(f["port"].annotation) is str  # a real union: text, parsed by the model
    assert base_type(float) is float


def test_settings_flags_carry_the_field_and_the_name() -> None:
    specs = settings_flags(_Settings, ["drain_timeout_s", "tags"])
    assert [(s.key, s.flat) for s in specs] == [("drain_timeout_s", "drain_timeout"), ("tags", "tags")]
    assert specs[0].info.default == 30.0 and specs[0].info.description == "how long a drain waits"
    custom = settings_flags(_Settings, ["tags"], flat=lambda n: f"x_{n}")
    assert custom[0].flat == "x_tags"
