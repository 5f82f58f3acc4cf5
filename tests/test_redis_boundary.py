"""The Redis boundary: Lua and Redis commands live in src/lmdq/redis/, nowhere else (issue 30).

Three AST checks over lmdq's own code (lmdq/, worker/, producer/, bench/; tests may speak Redis):

* Lua source text (``redis.call(`` / ``redis.pcall(`` in a string) appears only in src/lmdq/redis/scripts.py;
* a script is run one way: ``register_script``, ``eval``/``evalsha`` (and ``_ro``), ``script_load``,
  ``fcall`` or redis-py's ``Script`` appear only in src/lmdq/redis/scripts.py;
* a redis-py command method called on a Redis client or pipeline appears only under src/lmdq/redis/, except
  in the modules of :data:`NOT_YET_MOVED`, which must be EXACTLY the modules that still make such calls
  (a module that is cleaned up fails the test until it leaves the list, a new one fails at once).

Each detector is first shown to catch a planted violation (and to pass look-alikes: ``dict.get``,
torch's ``model.eval()``), so none of them can pass by finding nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import redis

from lmdq.redis import scripts

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("src", "worker", "producer", "bench")
REDIS_HOME = "src/lmdq/redis/"
SCRIPTS_MODULE = "src/lmdq/redis/scripts.py"

#: Modules outside src/lmdq/redis/ that still call Redis commands themselves (the part of issue 30 not done
#: yet: each should move its calls into a data-access module under src/lmdq/redis/). Exact: see the module doc.
NOT_YET_MOVED: set[str] = set()

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


# ---- the boundary itself ------------------------------------------------------------------------


def test_lua_text_lives_only_in_the_scripts_module() -> None:
    found = {m: hits for m, src in _modules().items() if m != SCRIPTS_MODULE and (hits := lua_strings(src))}
    assert not found, f"Lua outside {SCRIPTS_MODULE} (make it a LuaScript or Fragment there): {found}"
    assert lua_strings((ROOT / SCRIPTS_MODULE).read_text()), "the scripts module holds the Lua (sanity)"


def test_scripts_are_run_one_way() -> None:
    found = {m: hits for m, src in _modules().items() if m != SCRIPTS_MODULE and (hits := script_paths(src))}
    assert not found, f"a script run other than through lmdq.redis.scripts.LuaScript: {found}"


def test_redis_commands_only_under_lmdq_redis_or_in_the_known_list() -> None:
    calling = {m for m, src in _modules().items() if not m.startswith(REDIS_HOME) and redis_calls(src)}
    assert calling - NOT_YET_MOVED == set(), (
        f"Redis commands outside {REDIS_HOME}: {({m: redis_calls(_modules()[m])[:5] for m in calling - NOT_YET_MOVED})}"
        " (call a data-access function under src/lmdq/redis/ instead)")
    cleaned = NOT_YET_MOVED - calling
    assert cleaned == set(), f"no Redis calls left here: take them off NOT_YET_MOVED: {cleaned}"
    assert any(redis_calls(src) for m, src in _modules().items() if m.startswith(REDIS_HOME)), "sanity"


# ---- the scripts themselves ----------------------------------------------------------------------


def test_every_script_compiles_on_a_real_server_and_fragments_come_once(client: redis.Redis) -> None:
    assert len(scripts.SCRIPTS) >= 26
    for name, script in scripts.SCRIPTS.items():
        assert client.script_load(script.source) == script.sha, name  # SCRIPT LOAD compiles it
        for frag in script.fragments:
            assert script.source.count(frag.source) >= 1, (name, frag.name)
        assert len({f.name for f in script.fragments}) == len(script.fragments), name
    release = scripts.RELEASE
    assert [f.name for f in release.fragments] == ["wake_key", "wake", "drop_own_lease"]


def test_a_script_survives_an_empty_script_cache_on_a_client_and_in_a_pipeline(client: redis.Redis,
                                                                               prefix: str) -> None:
    """EVALSHA with NOSCRIPT fallback: after SCRIPT FLUSH (a restarted Redis) a call still runs."""
    key = f"{prefix}:boundary:wake"
    client.script_flush()
    assert scripts.WAKE_NOTIFY(keys=[key], client=client) == 1
    client.script_flush()
    with client.pipeline() as p:
        scripts.WAKE_NOTIFY.bind(client)(keys=[key], client=p)
        assert p.execute() == [1]
    assert client.lrange(key, 0, -1) == [b"1"]  # one token: the wake script pushes onto an empty list only
