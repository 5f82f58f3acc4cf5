"""The engine contract (worker/engines/base.py, worker/engines/registry.py) and the error-code vocabulary.

- every engine in the registry has every field of its spec and an engine class with every field of the
  ``Engine`` protocol (a field added to the protocol is checked here without editing this file);
- a spec or an engine that lacks one is refused at registration, loudly (the checks can fail);
- ``capacity`` is the contract's: an engine that calls it something else fails at start, not with 1 slot;
- ``EngineEvent.finish_reason`` is a ``FinishReason``; a reason outside it fails where it is made;
- no user-visible error code is a bare string in lmdq/, worker/, producer/ (an AST scan, with a planted
  violation of each kind to show that the scan finds them).
"""

from __future__ import annotations

import ast
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from lmdq.contract import ErrorCode, ErrorInfo, FinishReason
from lmdq.worker.engine_config import EngineConfig, SimConfig
from lmdq.worker.engine_settings import ENGINE_CONFIGS
from lmdq.worker.engines.base import (
    Borrowed,
    EngineContractError,
    EngineEvent,
    EngineRequest,
    engine_capacity,
)
from lmdq.worker.engines.registry import (
    BenchEntry,
    EngineSpec,
    EngineTarget,
    check_engine_class,
    contract_fields,
    engine_spec,
    engine_specs,
    register_engine,
)

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("src", "worker", "producer")


# --- the registry ---------------------------------------------------------------------------------


def test_the_builtin_engines_are_registered_in_order() -> None:
    assert [s.name for s in engine_specs()][:3] == ["lmdeploy", "transformers", "sim"]
    assert list(ENGINE_CONFIGS)[:3] == ["lmdeploy", "transformers", "sim"]  # the settings derive from it


@pytest.mark.parametrize("spec", engine_specs(), ids=lambda s: s.name)
def test_every_registered_engine_has_every_field_of_the_contract(spec: EngineSpec) -> None:  # type: ignore[type-arg]
    for f in dataclasses.fields(EngineSpec):
        assert getattr(spec, f.name) is not None, f"{spec.name}: {f.name}"
    assert issubclass(spec.settings, EngineConfig) and ENGINE_CONFIGS[spec.name] is spec.settings
    assert callable(spec.factory) and callable(spec.served_name) and callable(spec.bench.label)
    assert spec.summary, spec.name
    attrs, methods = contract_fields()
    assert {"name", "backend", "model_name", "capacity"} <= set(attrs)
    assert {"stream", "count_tokens", "alive", "close"} <= set(methods)
    check_engine_class(spec.engine, spec.name)  # raises on a missing field
    assert spec.engine.name == spec.name


class _NoCapacity:
    """An engine that calls its slots ``max_batch``: what silently got one slot before."""

    name = "nocap"
    backend = "nocap"
    model_name = "m"

    def __init__(self) -> None:
        self.max_batch = 8

    def stream(self, requests: Sequence[EngineRequest], abort: threading.Event) -> Iterator[EngineEvent]:
        yield from ()

    def count_tokens(self, text: str) -> int:
        return 0

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        pass


class _NoCapacityConfig(EngineConfig):
    pass


def test_an_engine_without_capacity_is_refused_at_registration() -> None:
    spec = EngineSpec(name="nocap", settings=_NoCapacityConfig, factory=lambda c, t: _NoCapacity(),
                      engine=_NoCapacity)
    with pytest.raises(EngineContractError, match="lacks capacity"):
        register_engine(spec)
    with pytest.raises(ValueError, match="expected one of"):
        engine_spec("nocap")  # nothing was registered


def test_an_engine_without_capacity_fails_at_start_not_with_one_slot() -> None:
    with pytest.raises(EngineContractError, match="capacity=None"):
        engine_capacity(_NoCapacity())  # type: ignore[arg-type]
    with pytest.raises(EngineContractError):
        Borrowed(_NoCapacity())  # type: ignore[arg-type]
    e = _NoCapacity()
    e.capacity = 0  # type: ignore[attr-defined]
    with pytest.raises(EngineContractError, match="capacity=0"):
        engine_capacity(e)  # type: ignore[arg-type]


def test_a_spec_that_breaks_the_contract_is_refused() -> None:
    from lmdq.worker.engines.sim import SimEngine

    def spec(**kw: object) -> EngineSpec:  # type: ignore[type-arg]
        base: dict[str, object] = dict(name="other", settings=_NoCapacityConfig,
                                       factory=lambda c, t: None, engine=SimEngine)
        return EngineSpec(**{**base, **kw})  # type: ignore[arg-type]

    with pytest.raises(EngineContractError, match="named 'sim', registered as 'other'"):
        register_engine(spec())
    with pytest.raises(EngineContractError, match="engine name 'Bad-Name'"):
        register_engine(spec(name="Bad-Name"))
    with pytest.raises(EngineContractError, match="settings must be an EngineConfig"):
        register_engine(spec(name="sim", settings=dict))
    with pytest.raises(EngineContractError, match="registered already"):
        register_engine(spec(name="sim"))
    with pytest.raises(EngineContractError, match="bench must be a BenchEntry"):
        register_engine(spec(name="sim", bench=None))

    class Clash(EngineConfig):  # --tp is lmdeploy's: a second declaration of it would be a second flag
        tp: int = 1

    with pytest.raises(EngineContractError, match="--tp is already declared by the 'lmdeploy' engine"):
        register_engine(EngineSpec(name="clash", settings=Clash, factory=lambda c, t: _NoCapacity(),
                                   engine=type("ClashEngine", (SimEngine,), {"name": "clash"})))


def test_the_factory_builds_through_the_registry() -> None:
    from lmdq.worker.engine_factory import build_engine, served_model_name
    from lmdq.worker.settings import WorkerSettings

    s = WorkerSettings(engine="sim", sim_max_batch=5, sim_step_ms=0.0)
    assert served_model_name(s) == "sim"
    eng = build_engine(s)
    try:
        assert (eng.name, eng.model_name, eng.capacity, engine_capacity(eng)) == ("sim", "sim", 5, 5)
    finally:
        eng.close()
    assert engine_spec("sim").bench.label(s.engine_config, eng, "") == "sim(step=0.0ms,max_batch=5)"
    with pytest.raises(ValueError, match="--engine lmdeploy needs --model"):
        served_model_name(WorkerSettings(engine="lmdeploy"))
    assert engine_spec("lmdeploy").served_name("/models/Qwen2-7B/") == "Qwen2-7B"
    assert EngineTarget(model=None, served_model_name="x").served_model_name == "x"
    assert BenchEntry().label(SimConfig(), None, "kept") == "kept"


# --- FinishReason ---------------------------------------------------------------------------------


def test_finish_reason_is_the_enum() -> None:
    ev = EngineEvent(index=0, finish_reason="stop")  # type: ignore[arg-type]
    assert ev.finish_reason is FinishReason.stop
    assert EngineEvent(index=0).finish_reason is None
    with pytest.raises(ValueError, match="'done' is not a valid FinishReason"):
        EngineEvent(index=0, finish_reason="done")  # type: ignore[arg-type]


def test_error_codes_read_as_their_wire_strings() -> None:
    assert ErrorInfo(code=ErrorCode.expired, message="m").model_dump(mode="json") == {"code": "expired",
                                                                                      "message": "m"}
    assert type(ErrorInfo(code=ErrorCode.expired, message="m").code) is str  # results hold plain strings
    assert f"{ErrorCode.engine_crash}" == str(ErrorCode.engine_crash) == "engine_crash"
    import json

    assert json.dumps({"code": ErrorCode.invalid_file}) == '{"code": "invalid_file"}'


# --- no bare error codes --------------------------------------------------------------------------

#: values other vocabularies share with ErrorCode (a result status ``expired``): a bare one of these is
#: only a violation where it is plainly a code (rules 1 and 2), not anywhere it appears
_CODE_VALUES = {c.value for c in ErrorCode}


def _shared_values() -> set[str]:
    from lmdq import contract

    out: set[str] = set()
    for obj in vars(contract).values():
        if isinstance(obj, type) and issubclass(obj, contract.Enum) and obj is not ErrorCode:
            out |= {str(m.value) for m in obj}
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}


def bare_error_codes(source: str, path: str = "<src>") -> list[str]:
    """Where ``source`` spells a user-visible error code as a bare string:

    1. ``code=`` / ``error_code=`` given a string literal (ErrorInfo, EngineEvent, ApiError, ...);
    2. a dict literal whose ``"code"`` is a string literal (API error bodies, a batch's ``errors``);
    3. any other string literal that is exactly an ErrorCode value (a code passed positionally, returned,
       compared), except values another enum of the contract shares (``expired``), docstrings and
       ``__all__``."""
    tree = ast.parse(source, path)
    shared, docs = _shared_values(), _docstrings(tree)
    out: list[str] = []
    seen: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "ErrorCode":
            seen |= {id(n) for n in ast.walk(node)}  # the one declaration of the codes
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            seen |= {id(n) for n in ast.walk(node)}  # names exported (a function called bad_request)
        if isinstance(node, ast.keyword) and node.arg in ("code", "error_code") and \
                isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.append(f"{path}:{node.value.lineno}: {node.arg}={node.value.value!r}")
            seen.add(id(node.value))
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == "code" and isinstance(v, ast.Constant) and \
                        isinstance(v.value, str):
                    out.append(f"{path}:{v.lineno}: {{'code': {v.value!r}}}")
                    seen.add(id(v))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in seen and \
                id(node) not in docs and node.value in _CODE_VALUES and node.value not in shared:
            out.append(f"{path}:{node.lineno}: {node.value!r}")
    return sorted(out, key=lambda f: int(f.split(": ", 1)[0].rsplit(":", 1)[1]))


PLANTED = '''
class ErrorCode(str, Enum):
    expired = "expired"          # the declaration itself is not a violation
    engine_crash = "engine_crash"

def f(e):
    """Fails with 'engine_crash' (a docstring naming a code is fine)."""
    ErrorInfo(code="engine_crash", message="m")            # rule 1
    __all__ = ["bad_request"]                              # an exported name, not a code
    EngineEvent(index=0, error_code="my_own_code")         # rule 1: any literal, known or not
    body = {"code": "invalid_file", "param": None}         # rule 2
    close_all(todo, "failed", "max_runs_exceeded", "m")    # rule 3: positional
    return "duplicate_custom_id"                           # rule 3: returned
'''


def test_the_scan_finds_each_kind_of_bare_code() -> None:
    found = bare_error_codes(PLANTED)
    assert [f.split(": ", 1)[1] for f in found] == [
        "code='engine_crash'", "error_code='my_own_code'", "{'code': 'invalid_file'}",
        "'max_runs_exceeded'", "'duplicate_custom_id'"], found
    fixed = PLANTED.replace('code="engine_crash"', "code=ErrorCode.engine_crash")
    assert len(bare_error_codes(fixed)) == len(found) - 1


def test_no_user_visible_error_code_is_a_bare_string() -> None:
    found: list[str] = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += bare_error_codes(path.read_text(), path.relative_to(ROOT).as_posix())
    assert not found, "spell these as lmdq.contract.ErrorCode members:\n" + "\n".join(found)
