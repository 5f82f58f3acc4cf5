"""Sets of keys as a whole: find them by pattern, weigh them, delete them.

For the benchmarks (lmdq_bench): their memory figures are the exact bytes of the keys a phase wrote,
and each run clears what it wrote on a shared server. lmdq itself never walks the keyspace (it knows
its keys: :mod:`lmdq.redis.keys`); only the benches and their tests use these, so they
live in the lab, a declared store module (tests/test_redis_boundary.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import redis

__all__ = ["delete", "keys_memory", "scan"]

_CHUNK = 1000
"""Keys per DEL (and per SCAN call): short commands, so a large clean-up never holds Redis for long."""


def scan(client: redis.Redis, match: str | None = None) -> Iterator[bytes]:
    """The keys matching the glob ``match`` (every key when None), by SCAN, not KEYS: Redis serves
    other clients between the calls."""
    for key in client.scan_iter(match=match, count=_CHUNK):
        yield key if isinstance(key, bytes) else str(key).encode()


def keys_memory(client: redis.Redis, keys: Iterable[bytes | str]) -> int:
    """Exact bytes of ``keys`` (``MEMORY USAGE key SAMPLES 0``, one pipelined call; a key that is gone
    counts 0).

    The benches' memory figures: deterministic for the same data, unlike ``used_memory`` deltas, which
    also hold allocator noise, Lua caches and client buffers (they went negative at a test's 16 requests).
    """
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.memory_usage(k, samples=0)
    return sum(int(v or 0) for v in pipe.execute())


def delete(client: redis.Redis, keys: Iterable[bytes | str]) -> int:
    """Delete ``keys``, :data:`_CHUNK` per DEL in one pipelined round trip; returns how many existed."""
    batch = list(keys)
    if not batch:
        return 0
    with client.pipeline(transaction=False) as p:
        for start in range(0, len(batch), _CHUNK):
            p.delete(*batch[start:start + _CHUNK])
        return sum(int(n) for n in p.execute())
