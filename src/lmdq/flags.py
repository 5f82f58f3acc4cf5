"""How a settings field is spelled on a command line: :class:`FlagSpec` and the functions that derive
them from a pydantic model. Pure data, no typer: the core (engine configs, submit's options, the
exporter's settings) declares its flags here, and :mod:`lmdq.cli.options` (the one package that
imports typer) renders them as typer options.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

__all__ = ["FlagSpec", "base_type", "flag_name", "option_name", "own_fields", "settings_flags"]


def option_name(flat: str) -> str:
    """``max_new_tokens`` → ``--max-new-tokens``."""
    return "--" + flat.replace("_", "-")


@dataclass(frozen=True)
class FlagSpec:
    """One generated option: ``key`` is what the command receives it as, ``flat`` its flag's name
    (``--`` + ``flat`` with dashes), ``info`` the field it derives from."""

    key: str
    flat: str
    info: FieldInfo
    #: Extra names kept for compatibility (``--seed`` for ``--random-seed``); for a bool, ``"--a/--b"`` pairs.
    aliases: tuple[str, ...] = ()
    #: Appended to the field's description (e.g. which engines take the setting).
    note: str = ""
    #: The flag's own type where the command line spells the value differently from the field (``--metadata
    #: k=v`` repeated for a dict, a path for a JSON schema); ``parse`` turns the flag's value into the field's.
    cli_type: Any = None
    parse: Callable[[Any], Any] | None = None


def flag_name(name: str, info: FieldInfo) -> str:
    """A setting's flag (without ``--``): its env var without ``LMDQ_`` where the field declares one
    (``drain_timeout_s`` is ``LMDQ_DRAIN_TIMEOUT``, so ``--drain-timeout``), else the field's name. The
    flag and the env var then always say the same (:func:`lmdq.worker.engine_config.describe_validation_error`
    names a bad setting the same way)."""
    alias = info.alias if isinstance(info.alias, str) else None
    return alias.removeprefix("LMDQ_").lower() if alias and alias.startswith("LMDQ_") else name


def own_fields(cls: type[BaseModel], base: type[BaseModel]) -> list[str]:
    """The fields ``cls`` declares beyond ``base``'s, in declaration order; nested models (an engine's
    config, whose fields get flags of their own) are left out."""
    return [n for n, info in cls.model_fields.items() if n not in base.model_fields
            and not (isinstance(t := _field_type(info), type) and issubclass(t, BaseModel))]


def _field_type(info: FieldInfo) -> Any:
    try:
        return base_type(info.annotation)
    except TypeError:
        return str


def settings_flags(cls: type[BaseModel], names: Sequence[str], *,
                   flat: Callable[[str], str] | None = None) -> list[FlagSpec]:
    """One :class:`FlagSpec` per field of ``cls`` in ``names``: the flag's name (:func:`flag_name`, or
    ``flat(field)``), type, default and help all come from the field's declaration, so adding a flag to
    a CLI is adding a field to its settings model."""
    specs = []
    for name in names:
        info = cls.model_fields[name]
        specs.append(FlagSpec(key=name, flat=flat(name) if flat else flag_name(name, info), info=info))
    return specs


def base_type(annotation: Any) -> Any:
    """The type a flag takes for a field: ``Annotated[int, ...] | None`` → ``int``;
    ``list[Annotated[str, ...]] | None`` → ``list[str]``."""
    if get_origin(annotation) is Annotated:
        return base_type(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return base_type(args[0])
        return str  # a union (a port or "auto"): the flag takes text, the settings model parses it
    if get_origin(annotation) is list:
        return list[base_type(get_args(annotation)[0])]  # type: ignore[misc]
    return annotation
