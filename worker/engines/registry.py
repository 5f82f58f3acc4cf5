"""Engines as registered plug-ins: the ONE place that says which engines exist and how each is built.

Each engine registers one :class:`EngineSpec`: its ``name`` (``--engine NAME``), its ``settings``
class (an :class:`~lmdq.worker.engine_config.EngineConfig`: each field becomes an ``lmdq-worker`` and
``lmdq-bench`` flag and an ``LMDQ_*`` env var, and the worker's ``engine_config``), its ``factory``
(config + model → engine), the ``engine`` class (checked against the
:class:`~lmdq.worker.engines.base.Engine` contract when registered), the name it serves when none is
given, and its ``bench`` entry (how ``lmdq-bench`` labels its runs). Everything that used to list the
engines by hand derives from here: the flags, ``--engine``'s choices, ``WorkerSettings``' validation,
``build_engine``, ``served_model_name``, the bench.

Where specs come from, read once, the first time the registry is asked:

- the built-in engines: :data:`BUILTIN` names the modules whose ``SPEC`` is registered (their import is
  light: each factory imports its heavy library, LMDeploy or torch, when it builds);
- other packages: an entry point in group :data:`ENTRY_POINT_GROUP` naming an ``EngineSpec``
  (``[project.entry-points."lmdq.engines"] NAME = "pkg.module:SPEC"`` in its pyproject.toml);
- Python: :func:`register_engine` (an application embedding the worker, before it builds settings).

A spec that breaks the contract (a missing ``capacity``, a name that is not its engine's, a flag name
another engine declares differently) is refused with :class:`EngineContractError` at registration:
loudly, at start-up, never as a worker that quietly runs one slot.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import import_module, metadata
from pathlib import Path
from typing import Any, Generic, TypeVar

from lmdq.worker.engine_config import EngineConfig, declaring_class, flat_names
from lmdq.worker.engines.base import Engine, EngineContractError

__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "BenchEntry",
    "EngineSpec",
    "EngineTarget",
    "check_engine_class",
    "contract_fields",
    "engine_names",
    "engine_spec",
    "engine_specs",
    "model_folder_name",
    "register_engine",
    "unregister_engine",
]

ENTRY_POINT_GROUP = "lmdq.engines"
"""The entry-point group an installed package registers its engines under."""

BUILTIN = (
    "lmdq.worker.engines.lmdeploy_engine",
    "lmdq.worker.engines.transformers_engine",
    "lmdq.worker.engines.sim",
)
"""Modules of the engines lmdq ships, each with a module-level ``SPEC`` (this order is the order of
``--engine``'s choices and of the flags in ``--help``)."""

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")

C = TypeVar("C", bound=EngineConfig)


@dataclass(frozen=True)
class EngineTarget:
    """What a factory builds for, besides the engine's own config: the model and the served name."""

    #: ``--model`` as given (a folder or hub id; None when not given)
    model: str | None
    #: the name results report and producers submit to (already resolved: ``--served-model-name`` or
    #: the spec's ``served_name(model)``)
    served_model_name: str
    #: LoRA adapters to serve beside the model (``--adapter NAME=PATH``), by name; an engine that cannot
    #: apply them is refused before it is built (lmdq.worker.adapters)
    adapters: Mapping[str, str] = field(default_factory=dict)


def model_folder_name(model: str | None) -> str:
    """The default served name of an engine that loads weights: the model folder's (or hub id's) last
    part. No model is an error naming the flag (``--model``)."""
    if not model:
        raise ValueError("needs --model (a model folder or hub id)")
    return Path(model.rstrip("/")).name


def _no_label(config: Any, engine: Any, label: str) -> str:
    return label


@dataclass(frozen=True)
class BenchEntry:
    """How ``lmdq-bench`` reports runs of this engine."""

    #: (config, built engine, the bench's own label: the model) → the ``model`` field of its report
    label: Callable[[Any, Any, str], str] = _no_label
    #: the bench needs a model for this engine (``--model`` or ``--random-llama8b``)
    needs_model: bool = True


@dataclass(frozen=True)
class EngineSpec(Generic[C]):
    """One engine, as everything else in lmdq sees it."""

    #: ``--engine NAME`` / ``LMDQ_ENGINE``: lowercase letters, digits, ``_``; the engine's own ``name``
    name: str
    #: its settings, each field declared once (flags, env vars and the nested config derive from them)
    settings: type[C]
    #: builds the engine (called once per worker process): (its config, the target) → the engine
    factory: Callable[[C, EngineTarget], Engine]
    #: the engine class the factory returns, checked against the contract at registration
    engine: type
    #: the name served when ``--served-model-name`` is not given, from ``--model``
    served_name: Callable[[str | None], str] = model_folder_name
    #: how ``lmdq-bench`` labels it
    bench: BenchEntry = field(default_factory=BenchEntry)
    #: one line for ``--help`` and docs
    summary: str = ""


def contract_fields() -> tuple[list[str], list[str]]:
    """(attributes, methods) of the :class:`Engine` protocol, read from the protocol itself: a field
    added to the contract is checked on every registered engine without touching this module."""
    attrs = [a for a in Engine.__annotations__ if not a.startswith("_")]
    methods = [m for m, v in vars(Engine).items() if callable(v) and not m.startswith("_")]
    return attrs, methods


def _declared(cls: type, attr: str) -> bool:
    return any(attr in vars(k) or attr in vars(k).get("__annotations__", {}) for k in cls.__mro__)


def check_engine_class(cls: type, name: str | None = None) -> None:
    """Refuse an engine class that lacks a field of the contract: every attribute of the :class:`Engine`
    protocol declared on the class (a class attribute or a class-level annotation, so readers and type
    checkers see it), every method callable, and ``name`` (when a class attribute) the registered name."""
    attrs, methods = contract_fields()
    missing = [a for a in attrs if not _declared(cls, a)]
    missing += [m for m in methods if not callable(getattr(cls, m, None))]
    if missing:
        raise EngineContractError(f"engine class {cls.__qualname__} lacks {', '.join(missing)} of the Engine "
                                  f"contract (lmdq.worker.engines.base.Engine): declare them on the class")
    own = vars(cls).get("name", getattr(cls, "name", None))
    if name is not None and isinstance(own, str) and own != name:
        raise EngineContractError(f"engine class {cls.__qualname__} is named {own!r}, registered as {name!r}")


class _Registry:
    def __init__(self) -> None:
        self._specs: dict[str, EngineSpec[Any]] = {}
        self._lock = threading.RLock()
        self._loaded = False

    def _check(self, spec: EngineSpec[Any]) -> None:
        if not isinstance(spec, EngineSpec):
            raise EngineContractError(f"not an EngineSpec: {spec!r}")
        if not _NAME.match(spec.name):
            raise EngineContractError(f"engine name {spec.name!r}: expected lowercase letters, digits and _ "
                                      "(at most 32, starting with a letter)")
        if not (isinstance(spec.settings, type) and issubclass(spec.settings, EngineConfig)):
            raise EngineContractError(f"engine {spec.name!r}: settings must be an EngineConfig subclass, "
                                      f"got {spec.settings!r}")
        for what in ("factory", "served_name"):
            if not callable(getattr(spec, what)):
                raise EngineContractError(f"engine {spec.name!r}: {what} must be callable")
        if not isinstance(spec.bench, BenchEntry) or not callable(spec.bench.label):
            raise EngineContractError(f"engine {spec.name!r}: bench must be a BenchEntry")
        check_engine_class(spec.engine, spec.name)
        # one flag per flat name: a name another engine declares must be the same declaration (inherited)
        for flat, fname in flat_names(spec.settings).items():
            for other in self._specs.values():
                theirs = flat_names(other.settings).get(flat)
                if theirs is not None and other.name != spec.name and (
                        declaring_class(other.settings, theirs) is not declaring_class(spec.settings, fname)):
                    raise EngineContractError(
                        f"engine {spec.name!r}: setting --{flat.replace('_', '-')} is already declared by the "
                        f"{other.name!r} engine; give the class a flag_prefix or inherit that declaration")

    def register(self, spec: EngineSpec[Any], *, replace: bool = False) -> None:
        with self._lock:
            self._check(spec)
            if spec.name in self._specs and not replace and self._specs[spec.name] is not spec:
                raise EngineContractError(f"an engine named {spec.name!r} is registered already")
            self._specs[spec.name] = spec

    def load(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True  # set first: a plug-in importing the registry must not loop
            for module in BUILTIN:
                self.register(import_module(module).SPEC)
            for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
                try:
                    spec = ep.load()
                except Exception as exc:  # noqa: BLE001 - any import failure: name the entry point
                    raise EngineContractError(f"engine entry point {ep.name} = {ep.value!r} "
                                              f"(group {ENTRY_POINT_GROUP}) failed to load: {exc}") from exc
                if getattr(spec, "name", None) != ep.name:
                    raise EngineContractError(f"engine entry point {ep.name} = {ep.value!r} names an engine "
                                              f"called {getattr(spec, 'name', None)!r}")
                self.register(spec)

    def specs(self) -> list[EngineSpec[Any]]:
        self.load()
        with self._lock:
            return list(self._specs.values())

    def unregister(self, name: str) -> None:
        with self._lock:
            self._specs.pop(name, None)


_REGISTRY = _Registry()


def register_engine(spec: EngineSpec[Any], *, replace: bool = False) -> None:
    """Register ``spec`` (checked: :class:`EngineContractError` if it breaks the contract). The built-in
    engines and entry points are loaded first, so a name clash is found here, not later."""
    _REGISTRY.load()
    _REGISTRY.register(spec, replace=replace)


def unregister_engine(name: str) -> None:
    """Forget an engine registered from Python (tests that register one for a while)."""
    _REGISTRY.unregister(name)


def engine_specs() -> list[EngineSpec[Any]]:
    """Every registered engine, built-ins first."""
    return _REGISTRY.specs()


def engine_names() -> list[str]:
    return [s.name for s in engine_specs()]


def engine_spec(name: str) -> EngineSpec[Any]:
    """The spec registered as ``name``; ValueError naming the registered ones otherwise."""
    for spec in engine_specs():
        if spec.name == name:
            return spec
    raise ValueError(f"expected one of {', '.join(repr(n) for n in engine_names())}, got {name!r}")
