"""The worker's side of result reuse (issue 47): answer requests from the reuse index, record new answers.

At start (:meth:`ReuseHook.start`) the worker computes its **worker key** per served name: the engine,
its whole configuration and the content fingerprint of the weights it serves (and of the adapter, for
an adapter's name), and publishes it (``status`` counts what a batch will reuse with it). A model it
cannot fingerprint (a hub id with no local snapshot) turns reuse off for this worker, loudly: a name
alone is never an identity.

For a job of a batch submitted with ``--reuse`` (``JobPayload.reuse_ttl_s``), before anything reaches
the engine, :meth:`ReuseHook.answers` looks every qualifying request up (one round trip for the job,
shards read once each); a hit is written as the request's final result through the same exactly-once
writer as any other (so a worker killed half-way leaves each request answered once, whichever way), with
``reused_from`` naming the request that computed it. The engine sees only the misses. When the job ends,
:meth:`ReuseHook.record` indexes the results this attempt computed: pointers into the job's shard once
it is sealed into a results sink, compact copies otherwise.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import redis
from pydantic import BaseModel

from lmdq.contract import JobPayload, Request, Result, ResultStatus, Timings
from lmdq.redis.keys import Keys
from lmdq.reuse.fingerprint import folder_digest
from lmdq.reuse.identity import (
    effective_params,
    identity,
    inline_inputs,
    params_key,
    qualifies,
    request_key,
    worker_key,
)
from lmdq.reuse.index import Completed, ReuseIndex
from lmdq.reuse.store import ReuseStore
from lmdq.worker.settings import WorkerSettings

__all__ = ["ReuseHook", "start_weights_fingerprint", "weights_fingerprint"]

#: fingerprints being computed in the background (start_weights_fingerprint), by the model as given
_started: dict[str, Future[str | None]] = {}
_started_lock = threading.Lock()


def _cache_file() -> Path:
    from lmdq.worker.default_model import default_cache_dir

    return Path(default_cache_dir()) / "fingerprints.json"


def _name(model: str | Path) -> str:
    """A local path resolved (the engine may name the folder the settings named another way), else as given."""
    p = Path(model)
    return str(p.resolve()) if p.exists() else str(model)


def start_weights_fingerprint(model: str | Path | None) -> None:
    """Start hashing ``model``'s weights on a thread of their own, now: the worker calls this before it
    loads the engine, so the hash (30 s for a 16 GB checkpoint on a fresh pod) runs beside the load (about
    a minute) instead of after it, where the first jobs waited for it. :func:`weights_fingerprint` of the
    same model then waits for this one instead of hashing again."""
    if model is None or str(model) == "":
        return
    name = _name(model)
    with _started_lock:
        if name in _started:
            return
        fut: Future[str | None] = Future()
        _started[name] = fut

    def run() -> None:
        try:
            fut.set_result(_weights_fingerprint(model))
        except BaseException as e:  # noqa: BLE001 - handed to the waiter, which raises it where it is asked
            fut.set_exception(e)

    threading.Thread(target=run, name="lmdq-weights-fingerprint", daemon=True).start()


def weights_fingerprint(model: str | Path | None) -> str | None:
    """The content digest of the served weights: a local folder or file, a hub id's local snapshot;
    ``"none"`` for an engine that loads no weights (sim without ``--model``); None when unknowable."""
    with _started_lock:
        fut = _started.pop(_name(model), None) if model is not None else None
    if fut is not None:
        return fut.result()
    return _weights_fingerprint(model)


def _weights_fingerprint(model: str | Path | None) -> str | None:
    if model is None or str(model) == "":
        return "none"
    p = Path(model)
    if not p.exists():
        try:
            from huggingface_hub import snapshot_download

            p = Path(snapshot_download(str(model), local_files_only=True))
        except Exception:  # noqa: BLE001 - no local snapshot (or no hub library): not fingerprintable
            return None
    return folder_digest(p, _cache_file())


class ReuseHook:
    """One per worker: its worker keys, the index, and the per-job lookup and record steps."""

    def __init__(self, client: redis.Redis, *, keys: Keys, engine: Any, settings: WorkerSettings,
                 served: list[str], log: Any) -> None:
        self.engine = engine
        self.settings = settings
        self.served = served
        self.log = log
        self.store = ReuseStore(client, keys=keys)
        self.index = ReuseIndex(self.store)
        #: served name -> worker key; empty until start() (and for good when the weights are not fingerprintable)
        self.keys: dict[str, bytes] = {}
        self.repeats_seeds = bool(getattr(engine, "repeats_seeds", False))

    def start(self) -> None:
        """Fingerprint the served weights (cached by path, size and mtime) and publish the worker keys."""
        t0 = time.monotonic()
        source = getattr(self.engine, "model_path", None) or self.settings.model
        weights = weights_fingerprint(source)
        if weights is None:
            self.log.warning("result reuse off on this worker: its model has no local files to fingerprint",
                             model=str(source))
            return
        cfg = getattr(self.engine, "config", None)
        if not isinstance(cfg, BaseModel):
            cfg = self.settings.engine_config
        config = cfg.model_dump(mode="json", exclude=set(getattr(cfg, "reuse_ignores", ())))
        name = str(getattr(self.engine, "name", self.settings.engine_name))
        adapters = self.settings.adapters
        for served in self.served:
            adapter = folder_digest(Path(adapters[served]), _cache_file()) if served in adapters else None
            self.keys[served] = worker_key(engine=name, config=config, weights=weights, adapter=adapter)
            self.store.publish_worker(served, self.keys[served])
        self.log.info("result reuse ready", weights=weights[:16], seconds=round(time.monotonic() - t0, 3))

    def identities(self, payload: JobPayload, todo: list[Request]) -> dict[int, bytes]:
        """Request index -> identity, for the job's requests that qualify (empty: reuse not asked or off)."""
        wkey = self.keys.get(payload.model)
        if payload.reuse_ttl_s is None or wkey is None:
            return {}
        out: dict[int, bytes] = {}
        shared = payload.params.resolved()  # most requests carry no params of their own: resolved once
        shared_key = params_key(shared)
        for r in todo:
            p = shared if r.params is None else effective_params(payload.params, r)
            if qualifies(p, repeats_seeds=self.repeats_seeds) and inline_inputs(r):
                out[r.index] = identity(wkey, request_key(shared_key if r.params is None else p, r))
        return out

    def answers(self, payload: JobPayload, todo: list[Request], ids: dict[int, bytes], *, worker: str,
                attempt: int, enqueued_at: float | None, now: float) -> dict[int, Result]:
        """Request index -> its final result answered from the index (the hits among ``ids``)."""
        order = [r for r in todo if r.index in ids]
        found = self.index.find(payload.model, [ids[r.index] for r in order])
        out: dict[int, Result] = {}
        # one Timings for the job's hits (all answered at ``now``): a result's fields are only read from here on
        timings = Timings.model_construct(enqueued_at=enqueued_at, started_at=now, finished_at=now)
        taken: set[int] = set()
        for pos, stored in found.items():
            r = order[pos]
            # find() parses each answer afresh, so it is ours to fill in; a copy only where one stored answer
            # serves two requests of this job (the same prompt twice)
            res = stored.model_copy() if id(stored) in taken else stored
            taken.add(id(stored))
            res.batch_id, res.custom_id, res.index = payload.batch_id, r.custom_id, r.index
            res.worker, res.attempt, res.timings = worker, attempt, timings
            out[r.index] = res
        return out

    def record(self, payload: JobPayload, fresh: list[Result], ids: dict[int, bytes], *, sealed: bool) -> None:
        """Index the completed results this attempt computed (never fails the job: reuse is a saving)."""
        if payload.reuse_ttl_s is None:
            return
        done = [Completed(ids[r.index], r, payload.job_no) for r in fresh
                if r.index in ids and r.status is ResultStatus.completed and r.reused_from is None]
        if not done:
            return
        try:
            self.index.record(payload.model, batch_id=payload.batch_id, results_url=payload.results_url,
                              ttl_s=payload.reuse_ttl_s, done=done, sealed=sealed)
        except redis.RedisError as e:
            self.log.warning("could not record results for reuse", error=str(e), batch_id=payload.batch_id)
