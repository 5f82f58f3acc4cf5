"""Every engine's settings as one set of worker flags and environment variables: the engine registry's
settings classes (:data:`ENGINE_CONFIGS`), their flat names, and how a worker's settings are split
between the common fields and the chosen engine's.

Why apart from :mod:`lmdq.worker.engine_config` (the classes themselves): the registry imports those
classes, and this module reads the registry, so keeping both in one module made an import circle."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from lmdq.errors import BadSetting
from lmdq.flags import FlagSpec
from lmdq.worker.engine_config import EngineConfig, flag_of, flat_names
from lmdq.worker.engine_config import describe_validation_error as describe_config_error
from lmdq.worker.engines.registry import engine_specs

__all__ = ["ENGINE_CONFIGS", "all_flat_names", "describe_validation_error", "engine_flag_specs",
           "split_engine_settings", "unused_env"]


class _EngineConfigs(Mapping[str, type[EngineConfig]]):
    """Engine name → its settings class, read from the engine registry each time (a plug-in registered
    after this module was imported is in it)."""

    def _all(self) -> dict[str, type[EngineConfig]]:
        return {spec.name: spec.settings for spec in engine_specs()}

    def __getitem__(self, name: str) -> type[EngineConfig]:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


ENGINE_CONFIGS: Mapping[str, type[EngineConfig]] = _EngineConfigs()
"""Every registered engine's settings class, by engine name (registry order)."""


def all_flat_names() -> dict[str, list[str]]:
    """Every engine setting's flat name → the engines that take it (declaration order)."""
    out: dict[str, list[str]] = {}
    for engine, cls in ENGINE_CONFIGS.items():
        for flat in flat_names(cls):
            out.setdefault(flat, []).append(engine)
    return out


def split_engine_settings(data: dict[str, Any], engine: str, env: dict[str, Any]) -> dict[str, Any]:
    """The chosen engine's config values from flat names: ``env`` (flat names from ``LMDQ_*``) under
    ``data[engine]`` (a nested dict or config) under the flat names in ``data`` (flags, Python keywords).

    Flat names are removed from ``data``. A flag (keyword) the engine does not take raises ValueError
    naming it and the engines that do take it. An env var the engine does not take is left alone: an
    environment (a ConfigMap, a shell, a CI job) is shared by processes running different engines; the
    worker CLI logs the ones it leaves unused (:func:`unused_env`)."""
    shared = all_flat_names()
    own = flat_names(ENGINE_CONFIGS[engine])
    given = {k: data.pop(k) for k in list(data) if k in shared}
    for flat in given:
        if flat not in own:
            raise ValueError(f"{flag_of(flat)} is a setting of the {' and '.join(shared[flat])} engine, "
                             f"not of --engine {engine}: remove it or choose that engine")
    nested = data.get(engine)
    base = nested.model_dump(exclude_unset=True) if isinstance(nested, BaseModel) else dict(nested or {})
    return {**{own[k]: v for k, v in env.items() if k in own}, **base, **{own[k]: v for k, v in given.items()}}


def unused_env(engine: str, environ: Mapping[str, str]) -> list[str]:
    """The ``LMDQ_*`` engine settings set in ``environ`` that ``engine`` does not take (and so ignores)."""
    own = flat_names(ENGINE_CONFIGS[engine])
    present = {k.upper() for k in environ}
    names = [f"LMDQ_{flat.upper()}" for flat in all_flat_names() if flat not in own]
    return [n for n in names if n in present]


def describe_validation_error(exc: ValidationError, cls: type[BaseModel]) -> BadSetting:
    """:func:`lmdq.worker.engine_config.describe_validation_error` with every registered engine's settings
    class, so a location inside the worker settings' engine section names that engine's flag."""
    return describe_config_error(exc, cls, ENGINE_CONFIGS)


def engine_flag_specs() -> list[FlagSpec]:
    """One CLI option per engine setting (the worker's and the bench's), from its one declaration."""
    specs = []
    for flat, engines in all_flat_names().items():
        cls = ENGINE_CONFIGS[engines[0]]
        info = cls.model_fields[flat_names(cls)[flat]]
        specs.append(FlagSpec(key=flat, flat=flat, info=info, note=f"({', '.join(engines)})"))
    return specs
