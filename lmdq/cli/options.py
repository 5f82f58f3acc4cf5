"""Typer options generated from pydantic fields, so a setting declared once in a model gets its flag,
type, choices and help from that declaration instead of a hand-written copy beside it.

:func:`model_options` adds one option per :class:`FlagSpec` to a typer command and hands the command
the values the user gave as one dict (unset options are absent: the model's own defaults apply, and
"explicitly set" stays visible). Typer reads a command's parameters from ``inspect.signature``, so the
generated options are added to the command's signature.
"""

from __future__ import annotations

import functools
import inspect
import json
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

__all__ = ["FlagSpec", "flag_name", "model_options", "option_name", "own_fields", "settings_flags"]

F = TypeVar("F", bound=Callable[..., Any])


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
        return _base_type(info.annotation)
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


def _base_type(annotation: Any) -> Any:
    """``Annotated[int, ...] | None`` → ``int``; ``list[Annotated[str, ...]] | None`` → ``list[str]``."""
    if get_origin(annotation) is Annotated:
        return _base_type(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _base_type(args[0])
        return str  # a union (a port or "auto"): the flag takes text, the settings model parses it
    if get_origin(annotation) is list:
        return list[_base_type(get_args(annotation)[0])]  # type: ignore[misc]
    return annotation


def _default_text(info: FieldInfo) -> str | None:
    """The field's default, or (unset-by-default fields like GenerationParams') its ``engine_default``."""
    default = info.default
    if default is None and isinstance(info.json_schema_extra, dict):
        default = info.json_schema_extra.get("engine_default")
    if default in (None, "", ()) or default is ... or default is PydanticUndefined or isinstance(default, BaseModel):
        return None
    if isinstance(default, Enum):
        return str(default.value)
    return str(default).lower() if isinstance(default, bool) else str(default)


def _parameter(spec: FlagSpec) -> tuple[inspect.Parameter, Callable[[Any], Any]]:
    """The signature parameter for ``spec`` and how its raw value becomes the field's value."""
    base = spec.cli_type if spec.cli_type is not None else _base_type(spec.info.annotation)
    help_ = " ".join(x for x in (spec.info.description or "", spec.note) if x) or None
    shown = _default_text(spec.info)
    convert: Callable[[Any], Any] = lambda v: v  # noqa: E731
    name = option_name(spec.flat)
    if base is bool:
        decls: tuple[str, ...] = (f"{name}/--no-{name[2:]}", *spec.aliases)
        annotation: Any = bool | None
    elif isinstance(base, type) and issubclass(base, BaseModel):
        decls, annotation = (name, *spec.aliases), str | None
        help_ = f"{help_ or ''} (a JSON object)".strip()

        def convert(v: Any) -> Any:
            try:
                return json.loads(v)
            except ValueError as exc:
                raise typer.BadParameter(f"expected a JSON object: {exc}", param_hint=name) from exc
    elif base in (int, float, str, Path) or get_origin(base) in (Literal, list) or (
            isinstance(base, type) and issubclass(base, Enum)):
        decls, annotation = (name, *spec.aliases), base | None
    else:
        raise TypeError(f"{spec.flat}: no option type for {base!r}")
    if spec.parse is not None:
        convert = spec.parse
    option = typer.Option(*decls, help=help_, show_default=shown if shown is not None else False)
    param = inspect.Parameter(spec.key, inspect.Parameter.KEYWORD_ONLY, default=None,
                              annotation=Annotated[annotation, option])
    return param, convert


def model_options(specs: Sequence[FlagSpec], *, into: str) -> Callable[[F], F]:
    """Decorate a typer command: add an option per spec; the command's parameter ``into`` receives
    ``{spec.key: value}`` for the options given on the command line."""
    built = {s.key: _parameter(s) for s in specs}
    flags = [option_name(s.flat) for s in specs]
    twice = sorted({f for f in flags if flags.count(f) > 1} | {k for k in built if [s.key for s in specs].count(k) > 1})
    if twice:
        raise TypeError(f"options generated twice: {twice}")

    def decorate(fn: F) -> F:
        sig = inspect.signature(fn, eval_str=True)
        if into not in sig.parameters:
            raise TypeError(f"{fn.__name__} has no parameter {into!r} to receive the generated options")
        clash = set(built) & set(sig.parameters)
        if clash:
            raise TypeError(f"{fn.__name__}: generated options clash with its own parameters {sorted(clash)}")
        own = [p for p in sig.parameters.values() if p.name != into]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            raw = {k: kwargs.pop(k) for k in list(kwargs) if k in built}
            given = {k: built[k][1](v) for k, v in raw.items() if v is not None and v != [] and v != ()}
            return fn(**kwargs, **{into: given})

        command.__signature__ = sig.replace(  # type: ignore[attr-defined]
            parameters=[*own, *(p for p, _ in built.values())])
        command.__annotations__ = {}  # the signature above carries the evaluated annotations
        return command  # type: ignore[return-value]

    return decorate
