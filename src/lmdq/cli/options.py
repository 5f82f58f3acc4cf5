"""Typer options generated from pydantic fields, so a setting declared once in a model gets its flag,
type, choices and help from that declaration instead of a hand-written copy beside it.

:func:`model_options` adds one option per :class:`lmdq.flags.FlagSpec` (declared by the core,
typer-free) to a typer command and hands the command
the values the user gave as one dict (unset options are absent: the model's own defaults apply, and
"explicitly set" stays visible). Typer reads a command's parameters from ``inspect.signature``, so the
generated options are added to the command's signature.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_origin

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from lmdq.flags import FlagSpec, base_type, option_name

__all__ = ["model_options"]

F = TypeVar("F", bound=Callable[..., Any])


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
    base = spec.cli_type if spec.cli_type is not None else base_type(spec.info.annotation)
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
