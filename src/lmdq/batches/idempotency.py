"""The store of idempotency keys (``submit --idempotency-key``): ``Keys.idempotency(key)`` holds the id
of the batch the key is bound to.

Why a module of its own: when a key is bound, checked against a submit's fingerprint or freed is the
ledger's rule (:mod:`lmdq.submission.ledger`); the commands and the release script are here, in the batches'
store (tests/test_redis_boundary.py). Binding is SET NX, so two concurrent submits with one
key cannot both win; freeing is a script that deletes the key only while it names the batch, so a
failing submit never frees a key another batch holds.
"""

from __future__ import annotations

import redis

from lmdq.redis.keys import Keys
from lmdq.redis.replies import reply_text
from lmdq.redis.scripts import LuaScript

__all__ = ["IdempotencyKeys"]


class IdempotencyKeys:
    """The idempotency keys of one key prefix (thread-safe: redis-py clients are). Methods take the user's
    key (``--idempotency-key``), not the Redis key."""

    def __init__(self, client: redis.Redis, *, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._release = RELEASE_KEY.bind(client)

    def bound(self, idempotency_key: str) -> str | None:
        """The batch id the key is bound to (decoded with replacement: untrusted), None when it is free."""
        raw = self.client.get(self.keys.idempotency(idempotency_key))
        return None if raw is None else reply_text(raw)

    def bind(self, idempotency_key: str, batch_id: str, *, ttl_s: int) -> bool:
        """Bind the key to ``batch_id`` for ``ttl_s`` unless it is bound already (SET NX EX): True when
        this call bound it."""
        return bool(self.client.set(self.keys.idempotency(idempotency_key), batch_id, nx=True, ex=ttl_s))

    def release(self, idempotency_key: str, batch_id: str) -> None:
        """Free the key if it is still bound to ``batch_id``. Reads first: where it is not bound to this
        batch nothing is written, so a release against a read-only replica is not refused."""
        key = self.keys.idempotency(idempotency_key)
        bound = self.client.get(key)
        if bound is not None and reply_text(bound) == batch_id:
            self._release(keys=[key], args=[batch_id])


# ==== Lua: this module's scripts (composed and run by lmdq.redis.scripts.LuaScript) ====

# KEYS: idempotency key.  ARGV: batch id.  Deletes the key only while it still names this batch.
RELEASE_KEY = LuaScript("release_key", """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
""")
