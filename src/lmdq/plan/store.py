"""The plan's store: what the fleet has measured, per model, for a plan to rest on.

Two hashes per model (:meth:`lmdq.redis.keys.Keys.plan_lengths`, :meth:`~lmdq.redis.keys.Keys.plan_rates`):

* output lengths: field ``"L"`` (a request that stopped by itself after L tokens) or ``"L+"`` (one cut
  at its ``max_new_tokens`` = L: its own length is at least L) -> how many requests; lengths above 256
  are bucketed to 64 a power of two (:func:`bucket`), so the hash stays small whatever the traffic;
* rates: field worker name -> JSON ``{"busy_s", "prefill", "decode", "windows": [[busy_s, prefill,
  decode], ...], "at"}``: totals since the worker started and its last :data:`MAX_WINDOWS` recording
  windows (a window is what the worker did between two flushes), ``at`` the Redis server's time.

Written by workers as their batches' requests finish (:mod:`lmdq.worker.plan_recorder`: one pipelined
round trip per flush); read by a plan (one round trip), which never writes. Both hashes expire
:data:`HISTORY_TTL_S` after their last write: a model nobody ran for a month has no history.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from lmdq.redis.keys import Keys
from lmdq.redis.replies import reply_text

__all__ = ["HISTORY_TTL_S", "MAX_WINDOWS", "History", "PlanStore", "WorkerRate", "bucket"]

HISTORY_TTL_S = 30 * 24 * 3600
"""A model's history expires this long after its last write."""

MAX_WINDOWS = 64
"""Recording windows kept per worker (the rate fit reads them; older ones only live on in the totals)."""


def bucket(length: int) -> int:
    """``length`` as the lengths hash stores it: exact up to 256, above that rounded down to one of 64
    steps per power of two (under 1.6 % off)."""
    if length <= 256:
        return max(0, int(length))
    step = 1 << (int(math.log2(length)) - 6)
    return (int(length) // step) * step


@dataclass
class WorkerRate:
    """One worker's measurements for one model (see the module doc)."""

    worker: str
    busy_s: float
    prefill: int
    decode: int
    windows: list[tuple[float, int, int]]
    at: float


@dataclass
class History:
    """A model's recorded history: output lengths (``length -> count``, stopped and cut apart) and each
    worker's rates; ``now`` is the Redis server's clock at the read."""

    model: str
    stopped: dict[int, int] = field(default_factory=dict)
    cut: dict[int, int] = field(default_factory=dict)
    rates: list[WorkerRate] = field(default_factory=list)
    now: float = 0.0

    @property
    def requests(self) -> int:
        return sum(self.stopped.values()) + sum(self.cut.values())


class PlanStore:
    """The plan's Redis commands for one key prefix."""

    def __init__(self, client: redis.Redis, *, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    def record(self, model: str, worker: str, *, lengths: Mapping[tuple[int, bool], int], busy_s: float,
               prefill: int, decode: int) -> None:
        """Add what ``worker`` did for ``model`` since its last flush, in one pipelined round trip:
        ``lengths`` maps (output length, cut at max_new_tokens) -> requests; ``busy_s`` the seconds its
        engine held at least one of the model's jobs, ``prefill`` / ``decode`` the tokens it computed.
        The worker's rate record is read and rewritten whole (one worker writes its own field only)."""
        lk, rk = self.keys.plan_lengths(model), self.keys.plan_rates(model)
        with self.client.pipeline(transaction=False) as p:
            p.time()
            p.hget(rk, worker)
            (sec, usec), raw = p.execute()
        rec = _rate(worker, raw) or WorkerRate(worker, 0.0, 0, 0, [], 0.0)
        rec.busy_s += busy_s
        rec.prefill += prefill
        rec.decode += decode
        if busy_s > 0:
            rec.windows = [*rec.windows, (round(busy_s, 6), prefill, decode)][-MAX_WINDOWS:]
        rec.at = float(sec) + float(usec) / 1e6
        with self.client.pipeline(transaction=False) as p:
            for (length, cut), n in lengths.items():
                p.hincrby(lk, f"{bucket(length)}{'+' if cut else ''}", n)
            p.hset(rk, worker, json.dumps({"busy_s": round(rec.busy_s, 6), "prefill": rec.prefill,
                                           "decode": rec.decode, "windows": rec.windows, "at": rec.at}))
            p.expire(lk, HISTORY_TTL_S)
            p.expire(rk, HISTORY_TTL_S)
            p.execute()

    def history(self, model: str) -> History:
        """``model``'s history, one round trip (untrusted: a malformed field is skipped)."""
        with self.client.pipeline(transaction=False) as p:
            p.time()
            p.hgetall(self.keys.plan_lengths(model))
            p.hgetall(self.keys.plan_rates(model))
            (sec, usec), raw_lengths, raw_rates = p.execute()
        h = History(model=model, now=float(sec) + float(usec) / 1e6)
        for k, v in raw_lengths.items():
            key, cut = reply_text(k), False
            if key.endswith("+"):
                key, cut = key[:-1], True
            try:
                length, n = int(key), int(v)
            except ValueError:
                continue
            if length >= 0 and n > 0:
                (h.cut if cut else h.stopped)[length] = n
        for k, v in raw_rates.items():
            rec = _rate(reply_text(k), v)
            if rec is not None:
                h.rates.append(rec)
        h.rates.sort(key=lambda r: r.worker)
        return h

    def forget(self, model: str) -> None:
        """Drop ``model``'s history (tests and benches start from a known one)."""
        self.client.delete(self.keys.plan_lengths(model), self.keys.plan_rates(model))


def _rate(worker: str, raw: Any) -> WorkerRate | None:
    """A worker's rate record from its JSON, or None when absent or malformed."""
    if raw is None:
        return None
    try:
        d = json.loads(reply_text(raw))
        windows = [(float(w[0]), int(w[1]), int(w[2])) for w in d.get("windows", [])][-MAX_WINDOWS:]
        return WorkerRate(worker, float(d["busy_s"]), int(d["prefill"]), int(d["decode"]), windows,
                          float(d.get("at", 0.0)))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
