"""The results sink, worker side: when a job ends, its results become one shard in object storage.

Offloading is an optimisation, never a risk to the results. What this module guarantees:

- **Seal only what is durable.** A job's records leave Redis only after its shard was confirmed
  written (:meth:`lmdq.results.blobs.BlobStore.put_bytes`: a PUT checked by HEAD and size, or a folder
  write fsynced and renamed). Every sink call is bounded by ``LMDQ_SINK_TIMEOUT_S``.
- **The drain deadline holds.** At the deadline (or a second signal) :meth:`ResultsSink.close`
  is called: sink calls in progress stop being waited for, nothing seals any more, and the jobs
  whose shards were not confirmed keep their full records in Redis, where ``results`` reads them.
  The worker says so in ONE line naming the sink (:meth:`ResultsSink.report_shutdown`).
- **Failed writes are retried until they land.** A job whose shard failed is put on a fleet-wide
  retry schedule in Redis (:func:`lmdq.results.sink.add_pending`); every worker's sweeper thread retries due
  entries with capped, jittered backoff (``LMDQ_SINK_RETRY_MAX_S``), so Redis is freed when the
  sink returns, whichever worker is still running then.

A sink failure is never a job failure: the job is released as done (its results are all in Redis).
Only a Redis failure propagates (the job is then re-queued like any other Redis outage).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis

from lmdq.contract import JobPayload
from lmdq.errors import BatchNotFound
from lmdq.logs.redaction import redact_url
from lmdq.redis.connection import RetryPolicy, with_reconnect
from lmdq.redis.keys import Keys
from lmdq.results.output_urls import OutputPolicy, shown
from lmdq.results.shards import ShardEntry, ranges_of
from lmdq.results.sink import PendingShard, add_pending, claim_pending, drop_pending, flush_job, flush_shard
from lmdq.results.store import ResultStore

__all__ = ["EVERY_ENTRY_S", "ResultsSink"]

SWEEP_BATCH = 16
"""Retry-schedule entries one sweep claims at most (each is one shard write, bounded by the timeout)."""

EVERY_ENTRY_S = 1e12
"""``ahead_s`` that makes a sweep take every scheduled entry, however far ahead (a burst worker's last)."""

SWEEP_EVERY_S = 5.0
"""How often a sweeper looks for due entries (one Lua call; at most the retry cap): an idle worker's
Redis cost stays a handful of commands a second."""

FIRST_RETRY_S = 1.0
"""The first retry's delay; then doubling (jittered) up to ``LMDQ_SINK_RETRY_MAX_S``."""


class ResultsSink:
    """Shard writes of one worker: the job threads' flushes, the sweeper, the shutdown report."""

    def __init__(self, client: redis.Redis, keys: Keys, *, store: ResultStore, outputs: OutputPolicy, log: Any,
                 timeout_s: float, retry_max_s: float, ttl_s: int, stopping: threading.Event,
                 on_retry: Callable[[Exception, float], None] | None = None) -> None:
        self.client = client
        self.keys = keys
        self.store = store
        self.outputs = outputs
        self.log = log
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self.policy = RetryPolicy(retries=1 << 30, base_s=min(FIRST_RETRY_S, retry_max_s), cap_s=retry_max_s)
        #: the worker is draining: failures are collected for one line instead of logged one by one
        self.stopping = stopping
        #: set at the drain deadline: nothing is waited for, nothing is sealed
        self.closed = threading.Event()
        self.on_retry = on_retry
        self._lock = threading.Lock()
        self._failing_since: float | None = None
        self._left: Counter[str] = Counter()  # sink (redacted) -> jobs left in Redis while stopping
        self.stats = {"shards": 0, "shard_failures": 0, "shards_retried": 0}

    # ---- a job's own flush ---------------------------------------------------------------------
    def flush(self, payload: JobPayload, jlog: Any) -> ShardEntry | None:
        """Write and seal the ended job's shard; on a sink failure schedule a retry and return None
        (the full records stay in Redis, where ``results`` reads them)."""
        try:
            entry = with_reconnect(
                lambda: flush_job(self.client, self.keys, payload, ttl_s=self.ttl_s, timeout_s=self.timeout_s,
                                  cancel=self.closed),
                on_retry=self.on_retry,
            )
        except redis.RedisError:
            raise
        except Exception as e:  # noqa: BLE001 - the results are safe in Redis; only the offload failed
            url = payload.results_url or ""
            indices = sorted(r.index for r in payload.requests)
            p = PendingShard(batch_id=payload.batch_id, job_no=payload.job_no, ranges=ranges_of(indices))
            with_reconnect(lambda: add_pending(self.client, self.keys, p, self.policy.delay(0)),
                           on_retry=self.on_retry)
            self._failed(url, e, jlog, job=payload.job_no)
            return None
        if entry is not None:
            self._ok()
            jlog.debug("results shard written", shard=entry.shard)
        return entry

    # ---- the sweeper ----------------------------------------------------------------------------
    def sweep_loop(self, stop: threading.Event, tick_s: float = SWEEP_EVERY_S) -> None:
        """The sweeper thread: retry due shard writes until the worker stops."""
        while not stop.wait(min(tick_s, self.policy.cap_s)):
            try:
                while self.sweep_once() >= SWEEP_BATCH and not stop.is_set():
                    pass
            except redis.RedisError as e:
                self.log.debug("results sink sweep: redis unavailable", error=str(e))
            except Exception:  # noqa: BLE001 - the sweeper must survive anything
                self.log.exception("results sink sweep crashed")

    def sweep_once(self, *, ahead_s: float = 0.0, limit: int = SWEEP_BATCH) -> int:
        """Try up to ``limit`` due entries of the retry schedule (and those due within ``ahead_s``);
        returns how many were claimed. A sink that fails once in a pass is not tried again in it: its
        other entries are rescheduled untried, so a pass costs one timeout per sink that is down, not
        one per entry."""
        claimed = claim_pending(self.client, self.keys, limit=limit, ahead_s=ahead_s,
                                lease_s=2 * self.timeout_s + 5)
        down: set[str] = set()
        for k, p in enumerate(claimed):
            if self.closed.is_set() or self.stopping.is_set():
                for rest in claimed[k:]:  # not tried: due again at once, for whichever worker runs
                    add_pending(self.client, self.keys, rest, 0.0)
                break
            self._retry(p, down)
        return len(claimed)

    def _retry(self, p: PendingShard, down: set[str]) -> None:
        try:
            batch = self.store.batches.get(p.batch_id)
        except BatchNotFound:
            drop_pending(self.client, self.keys, p.member)  # purged or expired: nothing to write
            return
        url = batch.results_url
        total = batch.request_counts.total
        if not url or not all(0 <= lo <= hi < total for lo, hi in p.ranges):
            drop_pending(self.client, self.keys, p.member)  # not a job of this batch's sink
            return
        try:
            url = self.outputs.check(url)
        except ValueError:
            # a sink this worker may not write to: left to a worker that may (same schedule)
            add_pending(self.client, self.keys, p, self.policy.delay(p.tries))
            return
        if url in down:
            add_pending(self.client, self.keys, p, self.policy.delay(p.tries))
            return
        try:
            flush_shard(self.client, self.keys, p.batch_id, p.job_no, url, p.indices(), ttl_s=self.ttl_s,
                        timeout_s=self.timeout_s, cancel=self.closed)
        except redis.RedisError:
            raise  # the claim lapses after its lease: the entry is tried again
        except Exception as e:  # noqa: BLE001 - the sink failed again: later, with a longer delay
            down.add(url)
            nxt = p.model_copy(update={"tries": p.tries + 1})
            add_pending(self.client, self.keys, nxt, self.policy.delay(p.tries + 1))
            self._failed(url, e, self.log.bind(batch=p.batch_id), job=p.job_no, tries=nxt.tries)
            return
        drop_pending(self.client, self.keys, p.member)
        with self._lock:
            self.stats["shards_retried"] += 1
        self._ok()

    # ---- closing and reporting ------------------------------------------------------------------
    def close(self) -> None:
        """The drain deadline passed (or a second signal came): stop waiting for the sink, seal nothing."""
        self.closed.set()

    def report_shutdown(self) -> None:
        """The ONE line a stopping worker writes when the sink kept some jobs' results in Redis."""
        with self._lock:
            left, self._left = dict(self._left), Counter()
        if left:
            self.log.warning(
                "results sink not written while stopping: those jobs' results stay in Redis (readable with "
                "`results`) and a running worker writes their shards when the sink answers",
                sink=", ".join(sorted(left)), jobs=sum(left.values()))

    # ---- episodes -------------------------------------------------------------------------------
    def _failed(self, url: str, e: Exception, jlog: Any, **where: Any) -> None:
        shown = _shown(url)
        error = f"{type(e).__name__}: {e}"
        with self._lock:
            self.stats["shard_failures"] += 1
            first = self._failing_since is None
            if first:
                self._failing_since = time.monotonic()
            if self.stopping.is_set():
                self._left[shown] += 1
        if self.stopping.is_set() or not first:
            jlog.debug("results shard not written; full results stay in Redis", sink=shown, error=error, **where)
            return
        jlog.warning("results sink failing: full results stay in Redis, shard writes retried until they land",
                     sink=shown, error=error, **where)

    def _ok(self) -> None:
        with self._lock:
            self.stats["shards"] += 1
            since, self._failing_since = self._failing_since, None
        if since is not None and not self.stopping.is_set():
            self.log.info("results sink answers again", down_s=round(time.monotonic() - since, 1))


def _shown(url: str) -> str:
    """The sink as a log line may show it: credentials, query and fragment never printed."""
    return redact_url(url) if "://" in url else shown(url)
