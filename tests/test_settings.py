"""Engine settings and generation parameters: each declared once, everything else derived from it.

- flag > env > default for the chosen engine's settings (WorkerSettings.engine_config),
  through the real worker CLI too;
- a flag the chosen engine does not take exits 2 with one line (worker and bench);
- the producer's generation flags are exactly GenerationParams' fields;
- a scan of the source tree (ast): each engine setting's default is declared in one place.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
import typer
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from lmdq.cli.options import model_options
from lmdq.contract import GenerationParams
from lmdq.errors import BadSetting
from lmdq.flags import FlagSpec
from lmdq.worker.engine_config import LMDeployConfig, SimConfig, TransformersConfig, flat_names
from lmdq.worker.engine_settings import ENGINE_CONFIGS, all_flat_names, unused_env
from lmdq.worker.settings import WorkerSettings, load_worker_settings
from tests.conftest import ROOT, run_cli
from tests.helpers import write_jsonl

# ------------------------------------------------------------------ flag > env > default


@pytest.mark.parametrize("engine, flat, field, env_value, flag_value", [
    ("lmdeploy", "cache_max_entry_count", "cache_max_entry_count", "0.5", 0.3),
    ("lmdeploy", "mp_engine", "mp_engine", "false", True),
    ("transformers", "device", "device", "cuda:1", "cpu"),
    ("sim", "sim_step_ms", "step_ms", "7", 0.0),
    ("sim", "session_len", "session_len", "4096", 128),
])
def test_flag_beats_env_beats_default(monkeypatch: pytest.MonkeyPatch, engine: str, flat: str, field: str,
                                      env_value: str, flag_value: Any) -> None:
    cls = ENGINE_CONFIGS[engine]
    model = "/m" if engine == "lmdeploy" else None
    default = cls.model_fields[field].default
    assert getattr(WorkerSettings(engine=engine, model=model).engine_config, field) == default
    monkeypatch.setenv(f"LMDQ_{flat.upper()}", env_value)
    from_env = getattr(WorkerSettings(engine=engine, model=model).engine_config, field)
    assert from_env == cls.model_validate({field: env_value}).model_dump()[field] != default
    from_flag = getattr(WorkerSettings(engine=engine, model=model, **{flat: flag_value}).engine_config, field)
    assert from_flag == flag_value


def test_nested_python_config_sits_between_env_and_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMDQ_TP", "4")
    monkeypatch.setenv("LMDQ_QUANT_POLICY", "8")
    s = WorkerSettings(model="/m", lmdeploy=LMDeployConfig(tp=2))
    # the config object beats env, env fills the rest
    assert (s.engine_config.tp, s.engine_config.quant_policy) == (2, 8)
    assert WorkerSettings(model="/m", lmdeploy={"tp": 2}, tp=3).engine_config.tp == 3


def test_the_env_names_deployments_use_still_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/base/config.yaml and docker-compose.yml set the engine through flat LMDQ_* names (LMDQ_TP,
    LMDQ_CACHE_MAX_ENTRY_COUNT, ...): each one must land in the LMDeploy config, none be ignored."""
    yaml = pytest.importorskip("yaml")
    data = next(d for d in yaml.safe_load_all((ROOT / "deploy/base/config.yaml").read_text())
                if d and d.get("kind") == "ConfigMap")["data"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["worker"]["environment"]
    engine_keys = {k for k in [*data, *compose] if k.removeprefix("LMDQ_").lower() in all_flat_names()}
    assert {"LMDQ_BACKEND", "LMDQ_TP", "LMDQ_DTYPE", "LMDQ_CACHE_MAX_ENTRY_COUNT", "LMDQ_MAX_BATCH_SIZE"} <= engine_keys
    for k, v in data.items():
        monkeypatch.setenv(k, str(v))
    s = WorkerSettings()
    assert s.engine_name == "lmdeploy" and unused_env("lmdeploy", dict(data)) == []
    for k in data:
        flat = k.removeprefix("LMDQ_").lower()
        if flat in all_flat_names():
            field = flat_names(LMDeployConfig)[flat]
            expected = LMDeployConfig.model_validate({field: data[k]}).model_dump()[field]
            assert getattr(s.engine_config, field) == expected
            assert field in s.engine_config.model_fields_set, k  # set from the env, not the default


def test_engine_choice_and_its_config() -> None:
    assert WorkerSettings().engine_name == "transformers"  # no model: the embedded default on transformers
    assert WorkerSettings(model="/m").engine_name == "lmdeploy"
    s = WorkerSettings(engine="sim", sim_max_batch=3)
    assert type(s.engine_config) is SimConfig and s.engine_config.max_batch == 3


def test_the_engine_gets_a_process_of_its_own_where_it_would_hold_the_workers_gil(tmp_path: Path) -> None:
    """Unset, ``engine_process`` follows the engine: TurboMind (LMDeploy, backend not pytorch, no adapters) runs
    in the loading process, so it gets a child; LMDeploy's PyTorch backend (its own engine process), the
    transformers engine and the sim stay in the worker. Set, it is what it says."""
    assert WorkerSettings(model="/m").runs_engine_process  # backend auto: TurboMind first
    assert WorkerSettings(model="/m", backend="turbomind").runs_engine_process
    assert not WorkerSettings(model="/m", backend="pytorch").runs_engine_process
    (tmp_path / "adapter_config.json").write_text("{}")  # an adapter folder: --adapter checks it at start
    assert not WorkerSettings(model="/m", adapter=[f"sql={tmp_path}"], backend="pytorch").runs_engine_process
    assert not WorkerSettings().runs_engine_process  # the embedded default on transformers
    assert not WorkerSettings(engine="sim").runs_engine_process
    assert WorkerSettings(engine="sim", engine_process=True).runs_engine_process
    assert not WorkerSettings(model="/m", backend="turbomind", engine_process=False).runs_engine_process


@pytest.mark.parametrize("engine, flat", [
    ("transformers", "tp"), ("transformers", "raw"), ("transformers", "backend"),
    ("sim", "cache_max_entry_count"), ("sim", "dtype"), ("lmdeploy", "sim_step_ms"), ("lmdeploy", "device"),
])
def test_a_setting_the_engine_does_not_take_is_an_error(engine: str, flat: str) -> None:
    cls = next(c for c in ENGINE_CONFIGS.values() if flat in flat_names(c))
    value = cls.model_fields[flat_names(cls)[flat]].default
    with pytest.raises(BadSetting, match=f"--{flat.replace('_', '-')} is a setting of the .* engine, "
                                         f"not of --engine {engine}"):
        load_worker_settings(engine=engine, model="/m", **{flat: value})  # even its default value, when given


def test_env_for_another_engine_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment is shared (ConfigMap, shell): LMDQ_TP does not stop a sim worker; the CLI logs it."""
    monkeypatch.setenv("LMDQ_TP", "2")
    assert WorkerSettings(engine="sim").engine_config == SimConfig()
    assert unused_env("sim", {"LMDQ_TP": "2", "LMDQ_SIM_STEP_MS": "1"}) == ["LMDQ_TP"]
    assert unused_env("lmdeploy", {"lmdq_tp": "2"}) == []


def test_bad_values_name_flag_and_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BadSetting, match=r"--backend / LMDQ_BACKEND: expected 'auto', 'turbomind' or 'pytorch', "
                                         r"got 'vllm'"):
        load_worker_settings(model="/m", backend="vllm")
    monkeypatch.setenv("LMDQ_SIM_MAX_BATCH", "0")
    with pytest.raises(BadSetting, match="--sim-max-batch / LMDQ_SIM_MAX_BATCH: .*greater than or equal to 1"):
        load_worker_settings(engine="sim")
    with pytest.raises(BadSetting, match="--dtype / LMDQ_DTYPE: expected auto, float16 or bfloat16 for lmdeploy"):
        load_worker_settings(model="/m", dtype="float32")
    assert load_worker_settings(engine="transformers", dtype="float32").engine_config.dtype == "float32"


def test_engine_constructors_take_the_config_object() -> None:
    from lmdq.worker.engines.sim import SIM_CONTEXT_LEN, SimEngine

    e = SimEngine(SimConfig(step_ms=0.0, max_batch=3), model_name="x")
    try:
        assert (e.config.max_batch, e.max_batch, e.session_len) == (3, 3, SIM_CONTEXT_LEN)
    finally:
        e.close()
    e = SimEngine(SimConfig(max_batch=3), step_ms=0.0, sim_hidden=8)  # keywords (field or flag names) on top
    try:
        assert (e.max_batch, e.step_s, e.sim_hidden) == (3, 0.0, 8)
    finally:
        e.close()
    with pytest.raises(BadSetting, match="--sim-vocab"):
        SimEngine(vocab=0)


# ------------------------------------------------------------------ the real CLIs


def _log_events(stderr: bytes) -> list[dict[str, Any]]:
    out = []
    for line in stderr.decode().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_worker_cli_flag_env_default(env: dict[str, str]) -> None:
    """The worker CLI (generated engine flags) → the engine config it logs when loaded."""
    e = {**env, "LMDQ_SIM_MAX_BATCH": "7", "LMDQ_SIM_STEP_MS": "3", "LMDQ_TP": "2"}
    p = run_cli("worker", "--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "0", "--burst", env=e,
                timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    events = _log_events(p.stderr)
    loaded = next(ev for ev in events if ev.get("event") == "engine loaded")
    assert loaded["config"]["step_ms"] == 0.0  # flag beats env
    assert loaded["config"]["max_batch"] == 7  # env beats default
    assert loaded["config"]["emit_every"] == SimConfig.model_fields["emit_every"].default  # default
    ignored = next(ev for ev in events if "does not take" in str(ev.get("event")))
    assert ignored["env"] == ["LMDQ_TP"]


@pytest.mark.parametrize("args, flag", [
    (("--engine", "transformers", "--tp", "2"), "--tp"),
    (("--engine", "transformers", "--raw"), "--raw"),
    (("--engine", "sim", "--backend", "pytorch"), "--backend"),
    (("--engine", "sim", "--cache-max-entry-count", "0.5"), "--cache-max-entry-count"),
])
def test_worker_cli_unsupported_flag_exits_2(env: dict[str, str], args: tuple[str, ...], flag: str) -> None:
    p = run_cli("worker", *args, env=env, timeout=120)
    err = p.stderr.decode().strip()
    assert p.returncode == 2, err
    assert err.splitlines() == [f"error: {flag} is a setting of the lmdeploy engine, not of --engine {args[1]}: "
                                "remove it or choose that engine"]


def test_bench_cli_unsupported_flag_exits_2(env: dict[str, str]) -> None:
    p = run_cli("bench", "efficiency", "--engine", "sim", "--tp", "2", "--n", "4", env=env, timeout=120)
    assert p.returncode == 2 and "error: --tp is a setting of the lmdeploy engine" in p.stderr.decode()


def test_worker_help_lists_every_engine_setting_once() -> None:
    from lmdq.worker.cli import app

    cmd = typer.main.get_command(app)
    opts = [o for p in cmd.params for o in p.opts]
    for flat in all_flat_names():
        assert opts.count("--" + flat.replace("_", "-")) == 1, flat


# ------------------------------------------------------------------ generation parameters


def _submit_command() -> Any:
    from lmdq.producer.cli import app

    return typer.main.get_command(app).commands["submit"]  # type: ignore[attr-defined]


def test_producer_flags_are_exactly_the_generation_params() -> None:
    params = {p.name: p for p in _submit_command().params}
    fields = GenerationParams.model_fields
    generated = {name for name in params if name in fields}
    assert generated == set(fields)
    for name, info in fields.items():
        opt = params[name]
        assert opt.opts[0] == "--" + name.replace("_", "-")
        assert info.description and (opt.help or "").startswith(info.description)
    # the producer's older spellings are aliases of those options, not options of their own
    assert not {"seed", "stop", "stop_token_id"} & set(params)
    assert "--seed" in params["random_seed"].opts and "--greedy" in params["do_sample"].secondary_opts


def test_producer_generation_flags_reach_the_batch(env: dict[str, str], tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--json",
                "--max-new-tokens", "9", "--seed", "5", "--stop", "x", "--stop", "y", "--stop-token-ids", "3",
                "--greedy", "--keep-special-tokens", "--top-k", "4",
                "--response-format", '{"type": "regex", "regex": "[a-z]+"}', env=env)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    params = json.loads(p.stdout)["params"]
    assert params == {"max_new_tokens": 9, "random_seed": 5, "stop_words": ["x", "y"], "stop_token_ids": [3],
                      "do_sample": False, "skip_special_tokens": False, "top_k": 4,
                      "response_format": {"type": "regex", "regex": "[a-z]+", "json_schema": None}} | {
        k: v for k, v in params.items() if v is None}


def test_resolved_defaults_come_from_the_declaration() -> None:
    resolved = GenerationParams().resolved()
    assert set(resolved) == set(GenerationParams.model_fields)
    assert resolved["max_new_tokens"] == 512 and resolved["skip_special_tokens"] is True


# ------------------------------------------------------------------ the option generator itself


class _Knobs(BaseModel):
    size: int = Field(default=3, ge=1, description="how big")
    mode: str | None = Field(default=None, description="which mode")
    fast: bool = Field(default=False, description="go fast")


def test_model_options_pass_only_what_was_given() -> None:
    seen: list[dict[str, Any]] = []
    app = typer.Typer()

    @app.command()
    @model_options([FlagSpec(key=k, flat=k, info=i) for k, i in _Knobs.model_fields.items()], into="given")
    def cmd(given: dict[str, Any], name: str = "n") -> None:
        seen.append({"name": name, **given})

    runner = CliRunner()
    assert runner.invoke(app, []).exit_code == 0
    assert runner.invoke(app, ["--size", "5", "--fast", "--name", "z"]).exit_code == 0
    assert seen == [{"name": "n"}, {"name": "z", "size": 5, "fast": True}]
    assert "how big" in runner.invoke(app, ["--help"]).output


# ------------------------------------------------------------------ one declaration (source scan)

SOURCE_DIRS = ("src", "worker", "producer", "bench")

# Same name, different concept (not the engine setting): reviewed, each with its reason.
NOT_ENGINE_SETTINGS = {
    ("worker/engines/base.py", "raw"),  # EngineRequest.raw: this request skips the chat template
    ("src/lmdq/contract.py", "backend"),  # Result.backend: which backend served the request (a record)
    ("worker/engines/transformers_engine.py", "backend"),  # the engine's identity ("transformers")
    ("bench/cli.py", "step_ms"), ("bench/cli.py", "max_batch"),  # the lab's sim pacing, its own knobs
    ("bench/plan_bench.py", "step_ms"),  # the plan bench's sim fleet pacing
    ("src/lmdq/plan/rules.py", "prefix_block"),  # the tokens per block a plan counts savings in (LMDeploy's)
}


def _default_declarations(tree: ast.AST, names: set[str]) -> list[tuple[str, int]]:
    """(name, line) of every place that declares a default for one of ``names``: a class-body field with
    a value (pydantic, dataclass), or a function parameter with a default other than None."""
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and stmt.target.id in names and stmt.value is not None):
                    out.append((stmt.target.id, stmt.lineno))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = [*a.posonlyargs, *a.args]
            pairs = [*zip(positional[len(positional) - len(a.defaults):], a.defaults),
                     *((arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None)]
            for arg, default in pairs:
                if arg.arg in names and not (isinstance(default, ast.Constant) and default.value is None):
                    out.append((arg.arg, default.lineno))
    return out


def test_the_scan_finds_duplicated_defaults() -> None:
    """The scan below can fail: the old layout (a settings field plus a constructor default) is caught."""
    old = ast.parse("class S:\n    tp: int = Field(default=1)\n\n"
                    "def build(*, tp: int = 1, dtype: str | None = None, session_len=2048):\n    pass\n")
    assert _default_declarations(old, {"tp", "dtype", "session_len"}) == [("tp", 2), ("tp", 4), ("session_len", 4)]


def test_each_engine_setting_default_is_declared_once() -> None:
    names: dict[str, set[str]] = {}  # field or flat name → the flat names it may stand for
    for cls in ENGINE_CONFIGS.values():
        for flat, field in flat_names(cls).items():
            names.setdefault(flat, set()).add(flat)
            names.setdefault(field, set()).add(flat)
    found: dict[str, list[str]] = {flat: [] for flat in all_flat_names()}
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for name, line in _default_declarations(ast.parse(path.read_text(), rel), set(names)):
                if (rel, name) in NOT_ENGINE_SETTINGS:
                    continue
                for flat in names[name]:
                    found[flat].append(f"{rel}:{line}")
    for flat, places in found.items():
        assert len(places) == 1 and places[0].startswith("worker/engine_config.py:"), (flat, places)
    # ...and the settings really are declared there, as fields of the engine configs
    assert {TransformersConfig, LMDeployConfig, SimConfig} <= set(ENGINE_CONFIGS.values())


# ------------------------------------------------------------------ every setting declared once, all CLIs

from lmdq.flags import option_name, own_fields, settings_flags  # noqa: E402
from lmdq.settings import DEFAULT_RESULT_TTL_S, CommonSettings, default_of  # noqa: E402


def _worker_loop_fields() -> list[str]:
    return [*own_fields(WorkerSettings, CommonSettings), "redis_url"]


def test_worker_loop_flags_are_the_settings_fields() -> None:
    """lmdq-worker's loop flags are WorkerSettings' fields: name (the env var's), help and default from the
    field; the CLI declares no option of its own."""
    from lmdq.worker.cli import app

    params = {p.name: p for p in typer.main.get_command(app).params}
    loop = _worker_loop_fields()
    assert {"model", "served_model_name", "engine", "burst", "jobs_in_flight", "prefetch_requests",
            "drain_timeout_s", "heartbeat_ttl_s", "max_attempts", "health_port", "worker_name",
            "redis_url"} <= set(loop)  # every flag the hand-written CLI had is still there
    assert set(params) == {*loop, *all_flat_names()}
    fields = WorkerSettings.model_fields
    for name in loop:
        opt, info = params[name], fields[name]
        assert info.description and (opt.help or "").startswith(info.description), name
        assert opt.opts[0] == option_name(name.removesuffix("_s") if name in (
            "drain_timeout_s", "heartbeat_ttl_s") else name), name  # --drain-timeout: LMDQ_DRAIN_TIMEOUT's flag
    assert params["burst"].secondary_opts == ["--no-burst"]


def test_worker_loop_flags_reach_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the CLI hands WorkerSettings: each given flag as its field, nothing for one not given."""
    import lmdq.worker.cli as cli

    seen: list[dict[str, Any]] = []

    def capture(**values: Any) -> WorkerSettings:
        seen.append(values)
        raise typer.Exit(0)

    monkeypatch.setattr(cli, "load_worker_settings", capture)
    r = CliRunner().invoke(cli.app, ["--drain-timeout", "7", "--heartbeat-ttl", "9", "--no-burst",
                                     "--health-port", "auto", "--idle-wait-s", "0", "--engine", "sim",
                                     "--sim-step-ms", "1", "--redis-url", "redis://h:1/0"])
    assert r.exit_code == 0, r.output
    assert seen == [{"drain_timeout_s": 7.0, "heartbeat_ttl_s": 9.0, "burst": False, "health_port": "auto",
                     "idle_wait_s": 0.0, "engine": "sim", "sim_step_ms": 1.0, "redis_url": "redis://h:1/0"}]
    s = WorkerSettings(**seen[0])
    assert (s.drain_timeout_s, s.heartbeat_ttl_s, s.health_port) == (7.0, 9.0, "auto")
    assert s.engine_config.step_ms == 1.0


def test_adding_a_settings_field_adds_its_flag() -> None:
    """The step docs/architecture.md names ("Adding a setting"): a field, and the flag follows."""

    class Wider(WorkerSettings):
        widgets: int = Field(default=2, ge=1, description="how many widgets")

    app = typer.Typer(rich_markup_mode=None)
    got: list[dict[str, Any]] = []

    @app.command()
    @model_options(settings_flags(Wider, own_fields(Wider, CommonSettings)), into="given")
    def cmd(given: dict[str, Any]) -> None:
        got.append(given)

    r = CliRunner().invoke(app, ["--help"], terminal_width=200)
    assert "--widgets" in r.output and "how many widgets" in r.output and "[default: (2)]" in r.output
    assert CliRunner().invoke(app, ["--widgets", "5"]).exit_code == 0 and got == [{"widgets": 5}]
    assert Wider(**got[0]).widgets == 5 and Wider().widgets == 2


def test_exporter_flags_are_its_settings_fields() -> None:
    from lmdq.metrics.exporter import EXPORTER_FLAGS, ExporterSettings

    assert [s.key for s in EXPORTER_FLAGS] == own_fields(ExporterSettings, CommonSettings)
    assert [s.flat for s in EXPORTER_FLAGS] == [n.removeprefix("exporter_") for n in own_fields(
        ExporterSettings, CommonSettings)]


def test_submit_defaults_are_the_producer_settings() -> None:
    """SubmitOptions and InputLimits take ProducerSettings' declared defaults, not copies of them."""
    from lmdq.submission.formats import InputLimits
    from lmdq.submission.settings import ProducerSettings
    from lmdq.submission.submit import SubmitOptions

    opts, limits = SubmitOptions(model=None), InputLimits()
    for field, value in [("batch_size", opts.batch_size), ("prefix_groups", opts.prefix_groups),
                         ("prefix_group_bytes", opts.prefix_group_bytes), ("known_models", opts.known_models),
                         ("memory_headroom_fraction", opts.memory_fraction),
                         ("max_line_bytes", limits.max_line_bytes), ("max_requests", limits.max_requests)]:
        assert value == default_of(ProducerSettings, field), field
    s = ProducerSettings(max_line_bytes=4096, max_requests=7)
    assert InputLimits.of(s) == InputLimits(max_line_bytes=4096, max_requests=7)


def _settings_names() -> set[str]:
    """Every setting of the three CLIs and the API: the fields of their settings models."""
    from lmdq.api.settings import ApiSettings
    from lmdq.metrics.exporter import ExporterSettings
    from lmdq.submission.settings import ProducerSettings

    return {n for cls in (CommonSettings, ProducerSettings, WorkerSettings, ExporterSettings, ApiSettings)
            for n in own_fields(cls, BaseModel)}


def _literal(node: ast.expr | None) -> tuple[bool, Any]:
    """(True, value) for a literal or constant arithmetic (``7 * 24 * 3600``), else (False, None)."""
    if node is None:
        return False, None
    if isinstance(node, ast.BinOp):
        (ok_l, left), (ok_r, right) = _literal(node.left), _literal(node.right)
        if ok_l and ok_r and isinstance(left, (int, float)) and isinstance(right, (int, float)):
            ops: dict[type[ast.operator], Any] = {ast.Mult: lambda a, b: a * b, ast.Add: lambda a, b: a + b,
                                                  ast.Sub: lambda a, b: a - b, ast.Pow: lambda a, b: a ** b,
                                                  ast.LShift: lambda a, b: a << b}
            if type(node.op) in ops:
                return True, ops[type(node.op)](left, right)
        return False, None
    try:
        return True, ast.literal_eval(node)
    except ValueError:
        return False, None


def _literal_defaults(tree: ast.AST, names: set[str]) -> list[tuple[str, str, int]]:
    """(owner, name, line) of every literal default (not None: None is "unset") given to one of ``names``:
    a class-body field (``x: int = 32``, ``x: int = Field(default=32)``) or a function parameter."""
    out: list[tuple[str, str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and stmt.target.id in names):
                    continue
                value = stmt.value
                if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "Field":
                    kw = {k.arg: k.value for k in value.keywords}
                    value = kw.get("default", value.args[0] if value.args else None)
                ok, v = _literal(value)
                if ok and v is not None:
                    out.append((node.name, stmt.target.id, stmt.lineno))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = [*a.posonlyargs, *a.args]
            pairs = [*zip(positional[len(positional) - len(a.defaults):], a.defaults),
                     *((arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None)]
            for arg, default in pairs:
                ok, v = _literal(default)
                if arg.arg in names and ok and v is not None:
                    out.append((node.name, arg.arg, default.lineno))
    return out


#: The settings models: where each setting's default IS declared.
SETTINGS_CLASSES = {"CommonSettings", "ProducerSettings", "WorkerSettings", "ExporterSettings", "ApiSettings"}
#: Same name, another concept: reviewed, each with its reason.
NOT_THE_SETTING = {
    ("src/lmdq/contract.py", "Batch", "prefix_groups"),  # the batch RECORD: False = staged in input order
    ("worker/engines/lmdeploy_engine.py", "load", "log_level"),  # LMDeploy's own logger, not LMDQ_LOG_LEVEL
    ("worker/engines/lmdeploy_engine.py", "build_pipeline", "log_level"),  # the same, where the pipeline is built
    ("src/lmdq/testing.py", "enqueue_requests", "batch_size"),  # a test batch: one request a job unless asked
}
#: The benches' workload knobs (requests per job, engine, jobs in flight) are the experiment's, printed with
#: its numbers: they stay what the bench says when a deployment's LMDQ_* defaults change.
BENCH_KNOBS = {"batch_size", "engine", "jobs_in_flight", "model"}


def test_the_settings_scan_finds_a_copied_default() -> None:
    """The scan below can fail: the old SubmitOptions / InputLimits / sink signatures are caught, a
    reference to the declaration is not."""
    old = ast.parse("class SubmitOptions:\n    batch_size: int = 32\n    blob_url: str | None = None\n\n"
                    "class InputLimits:\n    max_line_bytes: int = 10 * 1024 * 1024\n\n"
                    "def spool(*, max_requests: int = 10_000_000): ...\n"
                    "class New:\n    batch_size: int = default_of(ProducerSettings, 'batch_size')\n"
                    "    max_requests: int = Field(default=5)\n")
    assert sorted(_literal_defaults(old, {"batch_size", "blob_url", "max_line_bytes", "max_requests"})) == [
        ("InputLimits", "max_line_bytes", 6), ("New", "max_requests", 11), ("SubmitOptions", "batch_size", 2),
        ("spool", "max_requests", 8)]


def test_each_setting_default_is_declared_once() -> None:
    names = _settings_names()
    assert {"batch_size", "max_line_bytes", "result_ttl_s", "drain_timeout_s", "exporter_port"} <= names
    copies = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for owner, name, line in _literal_defaults(ast.parse(path.read_text(), rel), names):
                if owner in SETTINGS_CLASSES or (rel, owner, name) in NOT_THE_SETTING:
                    continue
                if (rel.startswith("bench/") or rel == "bench/cli.py") and name in BENCH_KNOBS:
                    continue
                copies.append(f"{rel}:{line} {owner}: {name}")
    assert copies == [], "a setting's default written again (use lmdq.settings.default_of or the settings)"


# ------------------------------------------------------------------ the 7-day TTL, declared once

_SEVEN_DAYS = 7 * 24 * 3600


def _seven_day_literals(tree: ast.AST) -> list[int]:
    """Lines that write the 7-day TTL: a constant (``604800``, ``7 * 24 * 3600``, ``86400 * 7``) or
    ``timedelta(days=7)`` / ``timedelta(weeks=1)`` / ``timedelta(hours=168)``."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.BinOp, ast.Constant)) and not isinstance(getattr(node, "value", 0), (str, bytes)):
            ok, v = _literal(node)  # type: ignore[arg-type]
            if ok and isinstance(v, (int, float)) and not isinstance(v, bool) and v == _SEVEN_DAYS:
                lines.add(node.lineno)
        elif isinstance(node, ast.Call) and (getattr(node.func, "id", None) == "timedelta"
                                             or getattr(node.func, "attr", None) == "timedelta"):
            seconds = 0.0
            unit = {"weeks": 604800, "days": 86400, "hours": 3600, "minutes": 60, "seconds": 1}
            for kw in node.keywords:
                ok, v = _literal(kw.value)
                if ok and kw.arg in unit:
                    seconds += v * unit[kw.arg]
            if seconds == _SEVEN_DAYS:
                lines.add(node.lineno)
    return sorted(lines)


def test_the_ttl_scan_finds_a_second_declaration() -> None:
    planted = ast.parse("import datetime\n"
                        "def flush_job(*, ttl_s: int = 7 * 24 * 3600): ...\n"
                        "X = 604800\n"
                        "Y = datetime.timedelta(days=7)\n"
                        "Z = 86400 * 7\n"
                        "W = 7 * 24  # hours: not the TTL in seconds\n"
                        "V = '7d'  # an example in help text\n")
    assert _seven_day_literals(planted) == [2, 3, 4, 5]


def test_the_ttl_default_is_declared_once() -> None:
    found = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            found += [f"{rel}:{line}" for line in _seven_day_literals(ast.parse(path.read_text(), rel))]
    assert len(found) == 1 and found[0].startswith("src/lmdq/settings.py:"), found
    assert DEFAULT_RESULT_TTL_S == _SEVEN_DAYS == CommonSettings().result_ttl_s
