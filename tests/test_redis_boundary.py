"""The Redis boundary: each concept owns its stored state, in declared store modules (issues 30, 43).

A concept's Redis commands and its Lua live beside its rules, in the store modules of its own package
(:data:`STORE_MODULES`); :mod:`lmdq.redis` keeps only what they share (connections, keys, the script
runner and the fragments several concepts use). AST checks over lmdq's own code (lmdq/, worker/,
producer/, bench/; tests may speak Redis):

* Lua source text (``redis.call(`` / ``redis.pcall(`` in a string) appears only in src/lmdq/redis/scripts.py
  (the shared fragments) and in the store modules;
* a script object (``LuaScript(...)`` / ``Fragment(...)``) is built only there too;
* a script is run one way: ``register_script``, ``eval``/``evalsha`` (and ``_ro``), ``script_load``,
  ``fcall`` or redis-py's ``Script`` appear only in src/lmdq/redis/scripts.py (so every script is a
  ``LuaScript``, run by EVALSHA);
* a redis-py command method called on a Redis client or pipeline appears only under src/lmdq/redis/ and
  in the store modules. :data:`STORE_MODULES` is EXACT: a store module left with no Redis command and no
  Lua fails the test until it leaves the set, and a module outside it that calls Redis fails at once.

Each detector is first shown to catch a planted violation (and to pass look-alikes: ``dict.get``,
torch's ``model.eval()``), and the rules themselves are run on a planted tree, so none of them can pass
by finding nothing.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import redis

from lmdq.jobs import leases, wakeup
from lmdq.redis import scripts

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("src", "worker", "producer", "bench")
REDIS_HOME = "src/lmdq/redis/"
SCRIPTS_MODULE = "src/lmdq/redis/scripts.py"

#: Each concept's store modules: the only modules outside src/lmdq/redis/ with Redis commands, Lua text
#: or script objects, each inside its concept's package. Exact: see the module doc.
STORE_MODULES: dict[str, set[str]] = {
    "src/lmdq/api/": {"src/lmdq/api/batch_records.py", "src/lmdq/api/files.py", "src/lmdq/api/paging.py"},
    "src/lmdq/gates/": {"src/lmdq/gates/store.py"},
    "src/lmdq/batches/": {"src/lmdq/batches/batch_jobs.py", "src/lmdq/batches/idempotency.py",
                          "src/lmdq/batches/records.py", "src/lmdq/batches/staging.py"},
    "src/lmdq/jobs/": {"src/lmdq/jobs/data.py", "src/lmdq/jobs/decode.py", "src/lmdq/jobs/idle_roster.py",
                       "src/lmdq/jobs/leases.py", "src/lmdq/jobs/reads.py", "src/lmdq/jobs/rq_records.py",
                       "src/lmdq/jobs/wakeup.py"},
    "src/lmdq/metrics/": {"src/lmdq/metrics/queue_stats.py"},
    "src/lmdq/plan/": {"src/lmdq/plan/store.py"},
    "src/lmdq/registry/": {"src/lmdq/registry/store.py"},
    "src/lmdq/results/": {"src/lmdq/results/sink.py", "src/lmdq/results/store.py"},
    "src/lmdq/reuse/": {"src/lmdq/reuse/store.py"},
    "src/lmdq/webhooks/": {"src/lmdq/webhooks/store.py"},
    "bench/": {"bench/keyspace.py"},  # the lab's key scans (only the benches and their tests use them)
}
STORES: set[str] = set().union(*STORE_MODULES.values())

# ---- the detectors -------------------------------------------------------------------------------

REDIS_METHODS = {n for n in dir(redis.Redis) if not n.startswith("_")} | {"execute", "multi"}
"""Every public method of redis-py's client (its commands) plus a pipeline's own."""

SCRIPT_CALLS = {"register_script", "eval", "evalsha", "eval_ro", "evalsha_ro", "script_load", "fcall", "fcall_ro"}
ALWAYS_REDIS = SCRIPT_CALLS | {"pipeline", "execute_command"}
"""Method names no other library lmdq uses has (``eval`` only with arguments: torch's ``model.eval()``)."""

_CLIENT_TYPES = ("Redis", "StrictRedis", "Pipeline")
_CLIENT_FACTORIES = {"connect", "redis.Redis", "redis.StrictRedis", "redis.from_url", "redis.Redis.from_url"}


def _is_client_type(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    text = ast.unparse(annotation).replace('"', "").replace("'", "")
    return any(part.strip().split(".")[-1] in _CLIENT_TYPES for part in text.replace("[", "|").split("|"))


def _is_client_factory(value: ast.expr) -> bool:
    if not isinstance(value, ast.Call):
        return False
    func = ast.unparse(value.func)
    return func in _CLIENT_FACTORIES or func.endswith((".pipeline", ".master_for"))


def _clients(tree: ast.Module) -> set[str]:
    """Expressions (as source text) that hold a Redis client or pipeline: parameters and variables annotated
    so, what ``connect()`` / ``redis.Redis()`` / ``.pipeline()`` return, and names bound from those."""
    clients: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            clients |= {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if _is_client_type(p.annotation)}
        elif isinstance(node, ast.AnnAssign) and _is_client_type(node.annotation):
            clients.add(ast.unparse(node.target))
    grew = True
    while grew:
        grew = False
        for node in ast.walk(tree):
            pairs: list[tuple[ast.expr, ast.expr]] = []
            if isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                pairs = [(node.target, node.value)]
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                pairs = [(node.optional_vars, node.context_expr)]
            for target, value in pairs:
                name = ast.unparse(target)
                if name not in clients and (_is_client_factory(value) or ast.unparse(value) in clients):
                    clients.add(name)
                    grew = True
    return clients


def redis_calls(source: str) -> list[str]:
    """``line: receiver.method`` for each Redis command or script call in ``source``, and each command
    method taken off a client without a call (``rank = client.zrank``)."""
    tree = ast.parse(source)
    clients = _clients(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method = node.func.attr
            if method in ALWAYS_REDIS and (method != "eval" or node.args):
                out.append(f"{node.lineno}: {ast.unparse(node.func.value)}.{method}")
        elif isinstance(node, ast.Attribute) and node.attr in REDIS_METHODS and node.attr not in ALWAYS_REDIS:
            receiver = ast.unparse(node.value)
            if receiver in clients or receiver.endswith((".client", "._client")):
                out.append(f"{node.lineno}: {receiver}.{node.attr}")
    return out


def script_paths(source: str) -> list[str]:
    """Ways of running Lua other than :class:`lmdq.redis.scripts.LuaScript`: script calls, ``Script``."""
    tree = ast.parse(source)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SCRIPT_CALLS:
            if node.func.attr != "eval" or node.args:
                out.append(f"{node.lineno}: .{node.func.attr}(")
        elif isinstance(node, ast.ImportFrom) and node.module == "redis.commands.core":
            out += [f"{node.lineno}: import {a.name}" for a in node.names if a.name == "Script"]
        elif isinstance(node, ast.Attribute) and node.attr == "Script" and ast.unparse(node.value).endswith("core"):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def lua_strings(source: str) -> list[str]:
    """String literals (f-strings too) holding Lua: ``redis.call(`` or ``redis.pcall(``, one per line."""
    out: dict[int, str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
        else:
            continue
        if "redis.call(" in text or "redis.pcall(" in text:
            out.setdefault(node.lineno, f"{node.lineno}: {text.strip().splitlines()[0][:60]!r}")
    return sorted(out.values())


def script_objects(source: str) -> list[str]:
    """Script objects built here: calls of ``LuaScript(...)`` or ``Fragment(...)`` (plain or dotted)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in {"LuaScript", "Fragment"}:
            out.append(f"{node.lineno}: {ast.unparse(node.func)}(")
    return out


def _module_name(path: str) -> str:
    """``src/lmdq/jobs/leases.py`` -> ``lmdq.jobs.leases``; ``bench/keyspace.py`` -> ``lmdq_bench.keyspace``."""
    if path.startswith("bench/"):
        return "lmdq_bench." + path.removeprefix("bench/").removesuffix(".py").replace("/", ".")
    rel = path.removeprefix("src/").removesuffix(".py").replace("/", ".")
    return rel if rel.startswith("lmdq.") else f"lmdq.{rel}"


# ---- the rules, as functions of a tree (the real one, and a planted one) -------------------------


def lua_outside_homes(modules: dict[str, str], stores: set[str]) -> dict[str, list[str]]:
    return {m: hits for m, src in modules.items()
            if m != SCRIPTS_MODULE and m not in stores and (hits := lua_strings(src))}


def script_objects_outside_homes(modules: dict[str, str], stores: set[str]) -> dict[str, list[str]]:
    return {m: hits for m, src in modules.items()
            if m != SCRIPTS_MODULE and m not in stores and (hits := script_objects(src))}


def script_paths_outside_runner(modules: dict[str, str]) -> dict[str, list[str]]:
    return {m: hits for m, src in modules.items() if m != SCRIPTS_MODULE and (hits := script_paths(src))}


def commands_outside_homes(modules: dict[str, str], stores: set[str]) -> dict[str, list[str]]:
    return {m: hits[:5] for m, src in modules.items()
            if not m.startswith(REDIS_HOME) and m not in stores and (hits := redis_calls(src))}


def idle_stores(modules: dict[str, str], stores: set[str]) -> set[str]:
    """Declared store modules with no Redis command and no Lua left (or gone): take them off the set."""
    return {m for m in stores if m not in modules or not (redis_calls(modules[m]) or lua_strings(modules[m]))}


def _modules() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
            for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))}


# ---- each detector catches a planted violation ---------------------------------------------------

PLANTED = '''
import redis
from redis.commands.core import Script
from lmdq.redis.connection import connect

LUA = """redis.call('DEL', KEYS[1])"""
OTHER = f"return redis.pcall('GET', {'KEYS'}[1])"

def f(client: redis.Redis, r: "redis.Redis | None", model, d: dict[str, int]) -> None:
    client.hget("k", "f")
    with client.pipeline() as p:
        p.zadd("z", {"m": 1})
        p.execute()
    r.eval("return 1", 0)
    other = connect("redis://x")
    other.delete("k")
    client.register_script(LUA)
    Script(None, b"return 1")
    d.get("k"); d.keys(); model.eval(); open("f").close()
    rank = client.zrank
    LuaScript("planted", LUA)
    scripts.Fragment("planted", OTHER)

class Holder:
    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def g(self) -> None:
        self.client.smembers("s")
        self.store.client.hlen("h")
'''


def test_each_detector_catches_a_planted_violation_and_passes_look_alikes() -> None:
    calls = {c.split(": ", 1)[1] for c in redis_calls(PLANTED)}
    assert calls == {"client.hget", "client.pipeline", "p.zadd", "p.execute", "r.eval", "other.delete",
                     "client.register_script", "self.client.smembers", "self.store.client.hlen", "client.zrank"}, calls
    assert not {"d.get", "d.keys", "model.eval"} & calls
    paths = script_paths(PLANTED)
    assert len(paths) == 3 and any("eval(" in p for p in paths) and any("register_script" in p for p in paths)
    assert any("import Script" in p for p in paths)
    lua = lua_strings(PLANTED)
    assert len(lua) == 2, lua
    assert not lua_strings('x = "redis is called"\ny = f"{redis}.call"\n')
    assert not redis_calls("def f(x):\n    x.get(1)\n    x.eval()\n")
    objects = script_objects(PLANTED)
    assert len(objects) == 2 and any("LuaScript(" in o for o in objects) and any("Fragment(" in o for o in objects)
    assert not script_objects("x = LuaScriptName\ny = make_fragment()\n")


def test_each_rule_fails_on_a_planted_tree() -> None:
    """The rules, on a tree with one violation of each kind: each is found, and only where it is one."""
    lua = 'LUA = """redis.call(\'DEL\', KEYS[1])"""\n'
    obj = "X = LuaScript('x', BODY)\n"
    call = "def f(client: redis.Redis) -> None:\n    client.hget('k', 'f')\n"
    tree = {
        SCRIPTS_MODULE: lua + obj,                      # the runner's fragments: allowed
        "src/lmdq/jobs/leases.py": lua + obj + call,    # a declared store: allowed
        "src/lmdq/redis/keys.py": call + lua + obj,     # shared Redis code: commands yes, Lua and scripts no
        "src/lmdq/jobs/queue.py": lua + obj + call,     # the concept's rules, not its store: nothing
        "worker/runner.py": call + "r.eval('return 1', 0)\n",
        "src/lmdq/results/store.py": "x = 1\n",      # declared, but holds no stored state
    }
    stores = {"src/lmdq/jobs/leases.py", "src/lmdq/results/store.py", "src/lmdq/api/gone.py"}
    assert set(lua_outside_homes(tree, stores)) == {"src/lmdq/redis/keys.py", "src/lmdq/jobs/queue.py"}
    assert set(script_objects_outside_homes(tree, stores)) == {"src/lmdq/redis/keys.py", "src/lmdq/jobs/queue.py"}
    assert set(commands_outside_homes(tree, stores)) == {"src/lmdq/jobs/queue.py", "worker/runner.py"}
    assert set(script_paths_outside_runner(tree)) == {"worker/runner.py"}
    assert idle_stores(tree, stores) == {"src/lmdq/results/store.py", "src/lmdq/api/gone.py"}


# ---- the boundary itself ------------------------------------------------------------------------


def test_each_store_module_is_inside_its_concept_package() -> None:
    for package, stores in STORE_MODULES.items():
        assert package != REDIS_HOME and all(m.startswith(package) for m in stores), (package, stores)
        assert all((ROOT / m).is_file() for m in stores), stores


def test_lua_text_lives_only_in_the_scripts_module_and_the_store_modules() -> None:
    found = lua_outside_homes(_modules(), STORES)
    assert not found, f"Lua outside {SCRIPTS_MODULE} and the store modules (make it a LuaScript or Fragment in " \
                      f"the concept's store module, or a shared Fragment in {SCRIPTS_MODULE}): {found}"
    assert lua_strings((ROOT / SCRIPTS_MODULE).read_text()), "the scripts module holds the shared fragments (sanity)"


def test_script_objects_live_only_in_the_scripts_module_and_the_store_modules() -> None:
    found = script_objects_outside_homes(_modules(), STORES)
    assert not found, f"a LuaScript or Fragment built outside the store modules: {found}"


def test_scripts_are_run_one_way() -> None:
    found = script_paths_outside_runner(_modules())
    assert not found, f"a script run other than through lmdq.redis.scripts.LuaScript: {found}"


def test_redis_commands_only_under_lmdq_redis_or_in_the_store_modules() -> None:
    modules = _modules()
    found = commands_outside_homes(modules, STORES)
    assert not found, (f"Redis commands outside {REDIS_HOME} and the store modules: {found}"
                       " (move them into the concept's store module, or declare a new one in STORE_MODULES)")
    idle = idle_stores(modules, STORES)
    assert idle == set(), f"no Redis commands or Lua left here: take them off STORE_MODULES: {idle}"
    assert any(redis_calls(src) for m, src in modules.items() if m.startswith(REDIS_HOME)), "sanity"


# ---- the scripts themselves ----------------------------------------------------------------------


def _store_scripts() -> dict[str, scripts.LuaScript]:
    """Every LuaScript the store modules define, by name (importing them registers them in SCRIPTS)."""
    out: dict[str, scripts.LuaScript] = {}
    for module in sorted(STORES | {SCRIPTS_MODULE}):
        mod = importlib.import_module(_module_name(module))
        out |= {v.name: v for v in vars(mod).values() if isinstance(v, scripts.LuaScript)}
    return out


def test_every_script_lives_in_a_store_module_and_is_registered() -> None:
    homed = _store_scripts()
    assert len(homed) >= 26
    assert set(homed) == set(scripts.SCRIPTS), set(homed) ^ set(scripts.SCRIPTS)
    assert all(scripts.SCRIPTS[name] is script for name, script in homed.items())


def test_every_script_compiles_on_a_real_server_and_fragments_come_once(client: redis.Redis) -> None:
    _store_scripts()
    assert len(scripts.SCRIPTS) >= 26
    for name, script in scripts.SCRIPTS.items():
        assert client.script_load(script.source) == script.sha, name  # SCRIPT LOAD compiles it
        for frag in script.fragments:
            assert script.source.count(frag.source) >= 1, (name, frag.name)
        assert len({f.name for f in script.fragments}) == len(script.fragments), name
    release = leases.RELEASE
    assert [f.name for f in release.fragments] == ["wake_key", "wake", "drop_own_lease"]


def test_a_script_survives_an_empty_script_cache_on_a_client_and_in_a_pipeline(client: redis.Redis,
                                                                               prefix: str) -> None:
    """EVALSHA with NOSCRIPT fallback: after SCRIPT FLUSH (a restarted Redis) a call still runs."""
    key = f"{prefix}:boundary:wake"
    client.script_flush()
    assert wakeup.WAKE_NOTIFY(keys=[key], client=client) == 1
    client.script_flush()
    with client.pipeline() as p:
        wakeup.WAKE_NOTIFY.bind(client)(keys=[key], client=p)
        assert p.execute() == [1]
    assert client.lrange(key, 0, -1) == [b"1"]  # one token: the wake script pushes onto an empty list only


def test_a_script_in_a_pipeline_is_queued_as_eval_so_the_pipeline_sends_no_script_exists(client: redis.Redis,
                                                                                        prefix: str) -> None:
    """Issue 49: redis-py's pipeline asks SCRIPT EXISTS, in a round trip of its own, before every execute that
    holds an EVALSHA; a script in a pipeline goes as EVAL with its text instead (one round trip per pipeline)."""
    key = f"{prefix}:boundary:wake-eval"
    client.script_flush()
    with client.pipeline() as p:
        wakeup.WAKE_NOTIFY(keys=[key], client=p)
        assert [c[0][0] for c in p.command_stack] == ["EVAL"] and not p.scripts
        assert p.command_stack[0][0][1] == wakeup.WAKE_NOTIFY.source
        assert p.execute() == [1]
    assert client.script_exists(wakeup.WAKE_NOTIFY.sha) == [True]  # EVAL cached it under the same SHA1
    assert wakeup.WAKE_NOTIFY(keys=[key], client=client) == 1  # EVALSHA on a client runs it too
    assert client.lrange(key, 0, -1) == [b"1"]  # still one token (the wake script pushes onto an empty list only)
