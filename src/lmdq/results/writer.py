"""Writing results, and every other store call of a job, through store faults without losing work.

Redis can be unreachable (restart, failover), or reachable and refusing writes: out of memory under
``maxmemory`` + ``noeviction``, a read-only replica after a failover, a failed RDB save (MISCONF).
None of that is a request's fault. A finished result stays in memory and its write is retried, with
capped backoff, for as long as it takes: a job whose requests already finished is never re-queued
(that would run them again only to find the store still full). One warning opens an episode, one
info line closes it; the attempts in between are not logged one by one (a full Redis used to print
a traceback per attempt, ~2,000 per worker in 30 s). While an episode lasts, :attr:`refusing` is set
and the worker claims nothing: there is no point running more work that cannot be stored.

A job that ends is sealed here too, by the writer that wrote its results (:meth:`ResultWriter.seal`):
with a results URL its shard is written from Redis and its records leave Redis (:mod:`lmdq.results.sink`).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import redis

from lmdq.contract import JobPayload, Result
from lmdq.redis.connection import RETRYABLE_ERRORS, RetryPolicy, refusal, with_reconnect
from lmdq.results.shards import ShardEntry
from lmdq.results.store import ResultStore

if TYPE_CHECKING:
    from lmdq.results.worker_sink import ResultsSink

__all__ = ["PendingWrite", "ResultWriter", "StoreRefused", "WriteAbandoned", "is_store_refusal"]

FLUSH_MAX = 256
"""Final results per pipelined write at most: a bounded reply, and a refused batch retries whole."""

T = TypeVar("T")

def is_store_refusal(e: BaseException) -> bool:
    """Redis answered but refused the write for a reason of its own (memory, role, disk): see
    :func:`lmdq.redis.connection.refusal`, the one classifier the producer's refusals use too."""
    return refusal(e) is not None


class StoreRefused(redis.exceptions.ConnectionError):
    """A refusal (see :func:`is_store_refusal`) re-raised as a connection-class error, so that the one
    reconnect policy (:func:`lmdq.redis.connection.with_reconnect`) retries it like an unreachable Redis."""


class WriteAbandoned(Exception):
    """The worker is being stopped hard while the store still refuses: the write is given up. The job's
    lease then expires and another worker runs its unfinished requests (nothing is written twice)."""


class PendingWrite:
    """A final result queued for the flusher (:meth:`ResultWriter.final_async`): :meth:`result` blocks
    until it is in Redis and says whether it was new.

    Why not a ``concurrent.futures.Future``: each one builds a ``threading.Condition`` in Python, and
    py-spy ``--gil`` on ``scripts/worker_cpu.py`` put 15 % of the worker's GIL samples in those
    constructors (the engine in the worker's own process, TurboMind, needs that GIL; a CPU-time A/B on
    a shared 2-core box stayed within its noise). One condition per writer serves every pending write."""

    __slots__ = ("_done", "_error", "_new", "_writer")

    def __init__(self, writer: ResultWriter) -> None:
        self._writer = writer
        self._done = False
        self._new = False
        self._error: BaseException | None = None

    def result(self) -> bool:
        """True if the result was new, False if the request already had one; re-raises the flusher's error
        (e.g. :class:`WriteAbandoned`)."""
        if not self._done:
            self._writer._await(self)
        if self._error is not None:
            raise self._error
        return self._new


class ResultWriter:
    """Final and partial results, and the retry policy for every store call of a job."""

    def __init__(self, store: ResultStore, *, log: Any, give_up: threading.Event, cap_s: float = 5.0,
                 sink: ResultsSink | None = None) -> None:
        self.store = store
        #: the worker's shard writes: a job that ends is sealed here, where its results were written
        self.sink = sink
        self.log = log
        #: set when the worker must end now (second signal, drain deadline passed)
        self.give_up = give_up
        self.cap_s = cap_s
        #: set while the store refuses or is unreachable: the worker claims nothing meanwhile
        self.refusing = threading.Event()
        self._lock = threading.Lock()
        self._episode_start: float | None = None
        self._episode_retries = 0  # calls that had to retry during the episode
        self._retrying = 0  # calls retrying now
        self.stats = {"results": 0, "duplicates": 0, "store_episodes": 0}
        # write-behind of final results (final_async): one flusher thread, one pipelined call per batch
        self._queue: list[tuple[Result, PendingWrite]] = []
        self._partials: dict[tuple[str, int], Result] = {}  # the newest partial of each request, not yet written
        self._qcond = threading.Condition()
        self._done_cond = threading.Condition()  # notified when a flushed batch's writes are done
        self._flusher: threading.Thread | None = None

    def call(self, fn: Callable[[], T], what: str) -> T:
        """``fn()``, retried through connection errors and store refusals until it succeeds (or the
        worker gives up). ``what`` names the operation in the episode's one warning. The episode
        lasts while any call is retrying; the last one to get through ends it."""
        retried = False

        def once() -> T:
            if self.give_up.is_set():
                raise WriteAbandoned(f"{what}: given up (the worker is stopping and Redis still refuses)")
            try:
                return fn()
            except redis.ResponseError as e:
                if is_store_refusal(e):
                    raise StoreRefused(str(e)) from e
                raise

        def on_retry(e: Exception, delay: float) -> None:
            nonlocal retried
            if not retried:
                retried = True
                self._enter(e, what, delay)
            # no jitter of its own: the one retry policy's delays are already jittered ([d/2, d],
            # lmdq.redis.connection.RetryPolicy), so job threads and workers do not hit a recovering Redis at once

        ok = False
        try:
            out = with_reconnect(once, policy=RetryPolicy(retries=1_000_000_000, cap_s=self.cap_s), on_retry=on_retry)
            ok = True
            return out
        finally:
            if retried:
                self._leave(ok)

    def final(self, result: Result) -> bool:
        """Store a final result (exactly once, see :mod:`lmdq.results.store`). True if it was new."""
        return self.final_async(result).result()

    def finals(self, results: list[Result]) -> list[bool]:
        """Store many final results now, from this thread, in one script call per batch (the same script
        and rules as :meth:`final`, each result exactly once); per result, whether it was new.

        Why beside :meth:`final_async`: a job answered from the reuse index (issue 47) has all its results
        at once; handing 1,000 of them to the one flusher thread (256 a flush) made every such job wait on
        it, the reused path's largest cost. Retried through store faults like every write here."""
        if not results:
            return []
        news = self.call(functools.partial(self.store.write_results_each, results), "write results")
        with self._lock:
            self.stats["results"] += sum(news)
            self.stats["duplicates"] += len(news) - sum(news)
        return news

    def final_async(self, result: Result) -> PendingWrite:
        """Queue a final result for the flusher thread; the pending write says whether it was new.

        Why: a worker that writes each result in its own round trip costs Redis twice the CPU per request
        of one that pipelines them (the round trip's syscalls cost as much as the exactly-once script).
        Results that finish together (a job's requests often do) are written in one pipelined call,
        each through the same script. Nothing is weaker: the job's thread waits for its writes before the
        job is released (:meth:`wait`), so a result is in Redis before its lease goes, and a worker that
        dies first leaves the job to run again, as before. The flusher retries through store faults with
        :meth:`call`, like :meth:`final`."""
        fut = PendingWrite(self)
        with self._qcond:
            self._queue.append((result, fut))
            self._ensure_flusher()
            self._qcond.notify()
        return fut

    def _ensure_flusher(self) -> None:
        """Start the flusher thread on first use (call with ``_qcond`` held)."""
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_loop, name="lmdq-result-writer", daemon=True)
            self._flusher.start()

    @staticmethod
    def wait(futures: list[PendingWrite]) -> None:
        """Block until every queued write in ``futures`` is in Redis (re-raises the flusher's error, e.g.
        :class:`WriteAbandoned`), then clear the list."""
        try:
            for f in futures:
                f.result()
        finally:
            futures.clear()

    def _flush_loop(self) -> None:
        while True:
            with self._qcond:
                while not self._queue and not self._partials:
                    self._qcond.wait()
                batch, self._queue = self._queue[:FLUSH_MAX], self._queue[FLUSH_MAX:]
                partials, self._partials = list(self._partials.values()), {}
            if partials:
                try:
                    self._write_partials(partials)
                except BaseException as e:  # noqa: BLE001 - a progress hint: never the flusher's end
                    self.log.warning("partial results not written", error=str(e), n=len(partials))
            if not batch:
                continue
            try:
                write = functools.partial(self.store.write_results_each, [r for r, _ in batch])
                news = self.call(write, "write results")
            except BaseException as e:  # noqa: BLE001 - handed to the job threads that wait on these
                with self._done_cond:
                    for _, f in batch:
                        f._error, f._done = e, True
                    self._done_cond.notify_all()
                continue
            with self._lock:
                self.stats["results"] += sum(news)
                self.stats["duplicates"] += len(news) - sum(news)
            with self._done_cond:
                for (_, f), new in zip(batch, news):
                    f._new, f._done = new, True
                self._done_cond.notify_all()

    def _await(self, pending: PendingWrite) -> None:
        """Block until the flusher is done with ``pending`` (:meth:`PendingWrite.result`)."""
        with self._done_cond:
            while not pending._done:
                self._done_cond.wait()

    def seal(self, payload: JobPayload, jlog: Any) -> ShardEntry | None:
        """A job whose results are all written: with a results URL, its shard is written and sealed
        (:mod:`lmdq.sink`); returns its index entry, or None (no sink, or the shard write failed and is
        retried by the sweeper while the records stay in Redis). Call only after :meth:`wait`."""
        if self.sink is None or not payload.results_url:
            return None
        return self.sink.flush(payload, jlog)

    def partial(self, result: Result) -> None:
        """Queue in-progress text for the flusher thread, which writes the partials due together in one
        pipelined call (one script per batch), before the finals of the same flush (so a final written
        with them drops the partial, and a late partial is refused by the final already there).

        Best effort: partial text is a progress hint, so a store fault skips it instead of waiting (the
        final result, written by :meth:`final`, is what must not be lost); a newer partial of the same
        request replaces one not written yet."""
        if self.refusing.is_set():
            return
        with self._qcond:
            self._partials[(result.batch_id, result.index)] = result
            self._ensure_flusher()
            self._qcond.notify()

    def _write_partials(self, partials: list[Result]) -> None:
        try:
            self.store.write_partials(partials)
        except RETRYABLE_ERRORS as e:
            self.log.debug("partial results not written", error=str(e), n=len(partials))
        except redis.ResponseError as e:
            if not is_store_refusal(e):
                raise
            self.log.debug("partial results not written", error=str(e), n=len(partials))

    # ---- episodes ----------------------------------------------------------------------------
    def _enter(self, e: Exception, what: str, delay: float) -> None:
        with self._lock:
            self._retrying += 1
            first = self._episode_start is None
            if first:
                self._episode_start = time.monotonic()
                self.stats["store_episodes"] += 1
            self._episode_retries += 1
        self.refusing.set()
        if first:
            # The same event name as the loop's own reconnect line for an unreachable Redis; its own
            # for a Redis that answers and refuses (the operator's fix differs: memory, failover).
            event = ("redis refuses writes: holding finished results in memory and retrying; claiming paused"
                     if isinstance(e, StoreRefused) else "redis unavailable, retrying")
            self.log.warning(event, operation=what, error=str(e), delay_s=delay)

    def _leave(self, ok: bool) -> None:
        with self._lock:
            self._retrying -= 1
            if self._retrying > 0 or self._episode_start is None:
                return
            start, calls = self._episode_start, self._episode_retries
            self._episode_start, self._episode_retries = None, 0
            self.refusing.clear()
        if ok:
            self.log.info("redis accepts writes again: resuming", down_s=round(time.monotonic() - start, 1),
                          calls_retried=calls)
