"""Wake-ups: idle workers sleep in Redis (BLPOP) instead of polling their queues.

An idle worker used to run a claim script every ``poll_interval_s`` (~20 a second, ~79 commands a
second counting the script's own LPOPs): a hundred idle GPUs cost a fifth of a Redis core doing
nothing. Now every path that makes jobs visible also pushes a token onto the model's wake list
(:meth:`lmdq.redis.keys.Keys.wake`), inside the same Lua call: the ledger's commit, the lease scripts'
re-queue (drain, retry, engine death) and reap. An idle worker BLPOPs that list with a timeout, then
tries an ordinary claim. Claims still go through the lease Lua only, so leases and exactly-once are
untouched: a token only says "look now".

The list holds at most one token (:data:`lmdq.redis.scripts.WAKE` pushes only onto an empty list), so it cannot grow
while no worker listens. One token wakes one idle worker; a worker woken that way which claims a full
share passes the token on (:meth:`WakeUp.notify`), so a large batch wakes the idle workers one after
another, each a round trip after the last, without a thundering herd.

A lost token (a worker that popped it and died, a Redis restart) only delays work: every idle worker
still tries a claim at the end of each block (``LMDQ_IDLE_WAIT_S``), and the reaper's re-queue pushes
a token of its own. The blocking call runs on a connection of its own whose socket timeout is longer
than the block, so it neither times out as a frozen Redis would nor holds a connection the worker's
other threads need.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from lmdq.redis.keys import Keys
from lmdq.redis.scripts import WAKE, LuaScript

__all__ = ["WakeUp"]



BLOCK_MARGIN_S = 10.0
"""The blocking connection's socket timeout is the block plus this: a reply later than that means Redis
is frozen or gone (the same judgement as ``LMDQ_REDIS_SOCKET_TIMEOUT_S`` for ordinary commands)."""


class WakeUp:
    """One model's wake list: :meth:`notify` leaves a token, :meth:`wait` blocks until one comes."""

    def __init__(self, client: redis.Redis, *, keys: Keys, model: str, block_s: float,
                 also: Sequence[str] = ()) -> None:
        self.client = client
        self.key = keys.wake(model)
        #: the lists :meth:`wait` blocks on: the model's, then those of the other models the worker serves
        #: (its LoRA adapters): a token on any of them wakes it
        self.wait_keys = [self.key, *(keys.wake(m) for m in also)]
        self.block_s = block_s
        self._notify = WAKE_NOTIFY.bind(client)
        kw = dict(client.connection_pool.connection_kwargs)
        kw["socket_timeout"] = block_s + BLOCK_MARGIN_S
        # No reconnect-and-resend: close() cuts the connection to end a block early, and a resent BLPOP
        # would block again.
        kw["retry"] = Retry(NoBackoff(), 0)
        self._pool = redis.ConnectionPool(connection_class=client.connection_pool.connection_class,
                                          max_connections=2, **kw)
        self._blocking = redis.Redis(connection_pool=self._pool)

    def notify(self) -> None:
        """Leave a token for the next idle worker (a no-op when one is already waiting in the list)."""
        self._notify(keys=[self.key])

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until a token comes (True) or ``timeout_s`` (default: ``block_s``) passes (False).

        Raises redis errors as any call does; after :meth:`close`, a ``ConnectionError``."""
        t = self.block_s if timeout_s is None else timeout_s
        got = self._blocking.blpop(self.wait_keys, timeout=max(0.01, t))
        return got is not None

    def close(self) -> None:
        """End a :meth:`wait` in progress in another thread now (its connection is shut)."""
        self._pool.disconnect(inuse_connections=True)


# ==== Lua: this module's scripts (composed and run by lmdq.redis.scripts.LuaScript) ====

WAKE_NOTIFY = LuaScript("wake_notify", "lmdq_wake(KEYS[1])\nreturn 1\n", uses=(WAKE,))
