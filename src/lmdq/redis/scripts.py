"""The one way lmdq composes and runs Lua, and the Lua fragments several concepts share.

A script is where several keys change in one atomic step, so it is where a concept's rules are hardest
to read: each concept keeps its scripts beside the code that builds their KEYS/ARGV, in its store
module (``lmdq.jobs.leases``, ``lmdq.batches.batch_jobs``, ``lmdq.results.store``, ...; the list is
``STORE_MODULES`` in tests/test_redis_boundary.py), and each is a :class:`LuaScript` built once at
import, its full text (:attr:`LuaScript.source`) visible in one object. Every call goes the same way:

* On a client: EVALSHA with the script's SHA1, and on ``NOSCRIPT`` (a Redis restarted or failed over,
  whose script cache is empty) SCRIPT LOAD and EVALSHA again: redis-py's own
  :class:`~redis.commands.core.Script`. A script's text crosses the wire once per server, not once per call.
* In a pipeline: EVAL with the script's text. redis-py's pipeline would otherwise send ``SCRIPT EXISTS``
  for its scripts in a round trip of its own before EVERY execute, and a round trip costs the server more
  (~24 us of Redis CPU on a 2-core box, measured) than reading a few kB of text and hashing it (~1 us per
  kB; Redis caches the compiled script by that hash, so nothing is compiled twice). Issue 49: two or three
  of those round trips per job (the job's start and end records, the results' flush). Nothing can answer
  NOSCRIPT there either.
* The client (or pipeline) is passed at the call, never held here: ``CLAIM(keys=[...], args=[...],
  client=r)``, or ``CLAIM.bind(r)`` for an object that calls it often with one client.

Shared Lua is composed in ONE way: a :class:`Fragment` is Lua text that a script (or another
fragment) names in ``uses=``; a script's source is its fragments, each once, dependencies first, in
the order named, then its own body. A fragment either defines ``local function lmdq_*`` helpers or is
a prelude that runs first (``lmdq.jobs.leases.LEASE_CLOCK`` sets ``now``;
``lmdq.jobs.leases.DROP_OWN_LEASE`` returns 0 unless the caller holds the lease). Nothing else
concatenates Lua. This module holds the fragments used by more than one concept (:data:`WAKE`,
:data:`WAKE_KEY`, :data:`BATCH_ENDED`); a fragment of one concept lives with that concept's scripts.

This module is the only place in lmdq with a script call path (register_script, EVAL, redis-py's
``Script``); Lua text lives only here and in the declared store modules (tests/test_redis_boundary.py
fails otherwise). KEYS/ARGV of each script are in the comment above it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from redis.client import Pipeline
from redis.commands.core import Script
from rq.job import Job

from lmdq.redis.keys import BatchField

__all__ = ["SCRIPTS", "BoundScript", "Fragment", "LuaScript"]

F = BatchField
_JOB_PREFIX = Job.redis_job_namespace_prefix

class Fragment:
    """Lua shared by several scripts (helpers or a prelude), named in their ``uses=``."""

    def __init__(self, name: str, source: str, *, uses: Sequence[Fragment] = ()) -> None:
        self.name = name
        self.source = source
        self.uses = tuple(uses)

    def closure(self) -> list[Fragment]:
        """This fragment after everything it uses, each once, dependencies first."""
        out: list[Fragment] = []
        for dep in self.uses:
            out.extend(f for f in dep.closure() if f not in out)
        return [*out, self]

SCRIPTS: dict[str, LuaScript] = {}
"""Every script by name (tests load each one on a real server)."""

class LuaScript:
    """One Lua script: its fragments and body composed once, run by EVALSHA with a NOSCRIPT fallback."""

    def __init__(self, name: str, body: str, *, uses: Sequence[Fragment] = ()) -> None:
        parts: list[Fragment] = []
        for frag in uses:
            parts.extend(f for f in frag.closure() if f not in parts)
        self.name = name
        self.fragments = tuple(parts)
        self.source = "".join(f.source for f in parts) + body
        # registered_client None: redis-py's Script then needs bytes (no client encoder to ask) and the
        # client at every call, which is how lmdq calls scripts anyway.
        self._script = Script(None, self.source.encode())  # type: ignore[arg-type]
        if name in SCRIPTS:
            raise ValueError(f"two Lua scripts named {name!r}")
        SCRIPTS[name] = self

    @property
    def sha(self) -> str:
        return str(self._script.sha)

    def __call__(self, keys: Sequence[Any] = (), args: Iterable[Any] = (), *, client: Any) -> Any:
        """Run on ``client`` (a redis-py client or pipeline): EVALSHA on a client, EVAL queued on a pipeline
        (no ``SCRIPT EXISTS`` round trip before the pipeline runs: see the module doc)."""
        keys = list(keys)
        if isinstance(client, Pipeline):
            return client.eval(self.source, len(keys), *keys, *args)
        return self._script(keys=keys, args=list(args), client=client)

    def bind(self, client: Any) -> BoundScript:
        """This script with a default client, called like redis-py's registered scripts."""
        return BoundScript(self, client)

class BoundScript:
    """A :class:`LuaScript` with a default client: ``s(keys=..., args=...)``, or ``client=pipe`` for a pipeline."""

    def __init__(self, script: LuaScript, client: Any) -> None:
        self.script = script
        self.client = client

    def __call__(self, keys: Sequence[Any] = (), args: Iterable[Any] = (), client: Any = None) -> Any:
        return self.script(keys, args, client=self.client if client is None else client)

# ==== Fragments: Lua that several scripts share (named in their uses=) =================================

WAKE_KEY = Fragment("wake_key", """
local function lmdq_wake_key(inflight)
  local wake, n = string.gsub(inflight, ':inflight:([^:]*)$', ':wake:%1')
  if n == 1 then return wake end
  return nil
end
""")
"""Lua: ``lmdq_wake_key(inflight)`` is :meth:`Keys.wake` of the model whose :meth:`Keys.inflight` list is
``inflight`` (nil for a name that is not one). The release and reap scripts know a job's model only by
the in-flight list its owner entry names; a slug holds no ':' (the name rule admits none, and
:func:`model_slug` escapes one), so the anchored pattern cannot match inside the prefix.
(tests/test_idle.py checks it against :meth:`Keys.wake` on a real server.)"""

WAKE = Fragment("wake", """
local function lmdq_wake(key)
  if key and redis.call('LLEN', key) == 0 then redis.call('RPUSH', key, '1') end
end
""", uses=(WAKE_KEY,))
"""Lua: ``lmdq_wake(key)`` leaves one token on the wake list ``key`` (nil: nothing), and
``lmdq_wake(lmdq_wake_key(inflight))`` on the one of the model an in-flight list belongs to (scripts
that queue jobs include it)."""

BATCH_ENDED = Fragment("batch_ended", f"""
local function lmdq_batch_ended(batch, fallback)
  local ttl = tonumber(redis.call('HGET', batch, '{F.ttl}') or '') or tonumber(fallback)
  for _, suffix in ipairs({{'', ':results', ':partials', ':shards', ':sealed', ':jobs', ':gates',
                                ':gates:canary', ':gates:held', ':gates:seen', ':gates:jobs'}}) do
    redis.call('EXPIRE', batch .. suffix, ttl)
  end
  local jobs = batch .. ':jobs'
  local n = redis.call('LLEN', jobs)
  for s = 0, n - 1, 1000 do
    for _, jid in ipairs(redis.call('LRANGE', jobs, s, s + 999)) do
      redis.call('EXPIRE', '{_JOB_PREFIX}' .. jid, ttl)
    end
  end
  local idem = redis.call('HGET', batch, '{F.idempotency}')
  local id = string.match(batch, ':batch:([^:]+)$')
  if idem and id and redis.call('GET', idem) == id then redis.call('EXPIRE', idem, ttl) end
end
""")
"""Lua: ``lmdq_batch_ended(batch_key, fallback_ttl)`` starts the batch's retention: every key of the batch
(record, results, partials, shard index, sealed bits, job list, quality gates' keys, job hashes,
idempotency key) expires
``ttl`` seconds from now. O(jobs), once per batch (about 1 µs a job)."""
