"""The worker loop: one engine, many jobs in flight, results stored the moment they finish.

Life: bootstrap (register, heartbeat thread, health endpoint) → loop (claim jobs while the
engine has room, so the next job's requests start while the last one's tail still decodes) →
teardown (drain within ``drain_timeout``, re-queue the rest, close the engine).

Building results (:mod:`worker.result_builder`), tensor outputs (:mod:`worker.tensor_store`)
and the results shard (:mod:`worker.results_sink`) live in their own modules.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import redis
import structlog
from lmdq.worker.engines.base import Engine, EngineError, EngineEvent, EngineRequest
from lmdq.worker.result_builder import LiveRequest, ResultBuilder, final_status, token_logprobs
from lmdq.worker.results_sink import flush_results
from lmdq.worker.settings import WorkerSettings
from lmdq.worker.tensor_store import TensorStore

from lmdq.connection import RETRYABLE_ERRORS, with_reconnect
from lmdq.contract import BatchStatus, ErrorInfo, FinishReason, JobPayload, Result, ResultStatus
from lmdq.job_decode import decode_job
from lmdq.jobs import Claim, JobQueue
from lmdq.keys import Keys, queue_names
from lmdq.output_urls import OutputPolicy
from lmdq.store import ResultStore

__all__ = ["Worker"]

log = structlog.get_logger("lmdq.worker")


@dataclass
class _Held:
    """A job this worker is running."""

    claim: Claim
    batch_id: str = ""
    n_requests: int = 0
    abort: threading.Event = field(default_factory=threading.Event)
    abort_reason: str | None = None  # 'cancel' | 'drain' | 'lost'
    reserved: int = 0  # requests counted against engine capacity for this job


def default_worker_name() -> str:
    """host.pid.random: unique per process, readable in logs, Redis records and metrics labels."""
    return f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:6]}"


class Worker:
    """Drains one model's queues with one long-lived engine."""

    def __init__(
        self,
        *,
        engine: Engine,
        client: redis.Redis,
        settings: WorkerSettings,
        health: Any | None = None,
        capacity: int | None = None,
    ) -> None:
        self.engine = engine
        self.client = client
        self.s = settings
        self.keys = Keys(settings.key_prefix)
        self.store = ResultStore(client, keys=self.keys, ttl_s=settings.result_ttl_s)
        self.jobs = JobQueue(client, keys=self.keys, job_ttl_s=settings.result_ttl_s,
                             max_job_bytes=settings.max_job_bytes)
        self.outputs = OutputPolicy.for_worker(settings.allowed_output_urls, settings.blob_url)
        self.model = engine.model_name
        self.queues = queue_names(self.model, self.keys.prefix)
        self.name = settings.worker_name or default_worker_name()
        self.health = health
        self.capacity = max(1, capacity or 1)
        self.max_jobs = settings.jobs_in_flight or 256
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._slot = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._force = threading.Event()
        self._last_job_size = 32
        self._requests_in_flight = 0
        self._pool = ThreadPoolExecutor(max_workers=self.max_jobs, thread_name_prefix="lmdq-job")
        self.log = log.bind(worker=self.name, model=self.model)
        self._tensors = TensorStore()
        self.stats = {"jobs": 0, "results": 0, "duplicates": 0, "requeued": 0, "refused": 0}

    # ---- lifecycle ----------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            if self._stop.is_set():
                self.log.warning("second signal: aborting in-flight work now", signal=signum)
                self._force.set()
            else:
                self.log.info("signal: draining (no new jobs)", signal=signum)
                self._stop.set()
            with self._slot:
                self._slot.notify_all()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> int:
        """Bootstrap → loop → teardown. Returns the process exit code."""
        self._register()
        hb = threading.Thread(target=self._heartbeat_loop, name="lmdq-heartbeat", daemon=True)
        hb.start()
        self.log.info("worker started", queues=self.queues, capacity=self.capacity, burst=self.s.burst)
        try:
            self._loop()
        finally:
            self._teardown()
        return 0

    def _register(self) -> None:
        now = time.time()
        with self.client.pipeline() as p:
            p.hset(self.keys.models(), self.model, now)
            p.hset(self.keys.worker(self.name), mapping={"model": self.model, "started_at": now, "pid": os.getpid()})
            p.expire(self.keys.worker(self.name), int(self.s.heartbeat_ttl_s))
            p.sadd(self.keys.workers(), self.name)
            p.execute()

    def _can_admit(self) -> bool:
        # Keep the engine's slots full plus a lookahead queued behind them (half an engine-full,
        # at least one job), so when many sequences end in the same step, the engine refills
        # from requests it already holds instead of waiting for the next claim round-trip.
        return self._room() > 0

    def _room(self) -> int:
        """How many more jobs to claim now (one Lua call claims them all: see JobQueue.claim_many)."""
        lookahead = self.s.prefetch_requests or max(self._last_job_size, self.capacity // 2)
        free = self.capacity + lookahead - self._requests_in_flight
        if free <= 0:
            return 0
        return max(0, min(self.max_jobs - len(self._held), -(-free // max(1, self._last_job_size)), 64))

    def _loop(self) -> None:
        last_cancel_poll = 0.0
        backoff = 0.1
        while not self._stop.is_set():
            if self.health:
                self.health.beat()
            now = time.monotonic()
            if now - last_cancel_poll > 0.5:
                last_cancel_poll = now
                self._poll_cancellations()
            claimed: list[Claim] = []
            room = self._room()
            if room:
                try:
                    claimed = self.jobs.claim_many(
                        self.queues, model=self.model, worker=self.name, lease_s=self.s.heartbeat_ttl_s, n=room
                    )
                    backoff = 0.1
                except RETRYABLE_ERRORS as e:
                    # Redis is away: wait for it however long it takes (never exit with jobs held),
                    # but on the stop event, so SIGTERM still drains promptly.
                    self._redis_retry(e, backoff)
                    self._stop.wait(backoff)
                    backoff = min(5.0, backoff * 2)
                    continue
            if claimed:
                for c in claimed:
                    held = _Held(claim=c, reserved=self._last_job_size)
                    with self._lock:
                        self._held[c.job_id] = held
                        self._requests_in_flight += held.reserved  # corrected once the payload is read
                    self._pool.submit(self._run_job, held)
                continue
            with self._slot:
                if self.s.burst and not self._held and self._can_admit():
                    if self._queues_empty():
                        self.log.info("burst: queues empty, exiting")
                        return
                # Busy (jobs held): an empty claim is retried when a job finishes (notify) or after
                # busy_poll_interval_s. Polling Redis every poll_interval_s here costs GIL time that
                # LMDeploy's in-process scheduler needs (measured: ~1 ms of Python per claim call).
                self._slot.wait(max(self.s.poll_interval_s, self.s.busy_poll_interval_s) if self._held
                                else self.s.poll_interval_s)

    def _queues_empty(self) -> bool:
        """Burst mode's exit test; an unreachable Redis counts as 'maybe not empty'."""
        try:
            return self.jobs.queue_depth(self.queues) == 0
        except RETRYABLE_ERRORS as e:
            self._redis_retry(e, self.s.poll_interval_s)
            return False

    def _teardown(self) -> None:
        if self.health:
            self.health.mark_draining()
        deadline = time.monotonic() + self.s.drain_timeout_s
        with self._slot:
            while self._held and time.monotonic() < deadline and not self._force.is_set():
                self._slot.wait(0.2)
            if self._held:
                self.log.warning("drain timeout: aborting and re-queueing held jobs", jobs=list(self._held))
                for h in self._held.values():
                    h.abort_reason = h.abort_reason or "drain"
                    h.abort.set()
            end = time.monotonic() + 30
            while self._held and time.monotonic() < end:
                self._slot.wait(0.2)
        self._stop.set()  # also ends the heartbeat thread (a burst exit never set it)
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            with self.client.pipeline() as p:
                p.delete(self.keys.worker(self.name))
                p.srem(self.keys.workers(), self.name)
                p.execute()
        except redis.RedisError:
            pass
        self.engine.close()
        self.log.info("worker stopped", **self.stats)

    def _redis_retry(self, e: Exception, delay: float) -> None:
        self.log.warning("redis unavailable, retrying", error=str(e), delay_s=delay)

    # ---- background: heartbeat, reaping, cancellation -----------------------------------
    def _heartbeat_loop(self) -> None:
        period = max(0.5, self.s.heartbeat_ttl_s / 3)
        while True:
            try:
                self._heartbeat_once()
            except redis.RedisError as e:
                self.log.warning("heartbeat failed", error=str(e))
            except Exception:  # noqa: BLE001 - the heartbeat must survive anything
                self.log.exception("heartbeat crashed")
            if self._stop.wait(period) and not self._held:
                return
            if self._stop.is_set():
                time.sleep(min(period, 1.0))

    def _heartbeat_once(self) -> None:
        with self._lock:
            held = list(self._held.values())
        with self.client.pipeline() as p:
            p.hset(self.keys.worker(self.name), "last_heartbeat", time.time())
            p.expire(self.keys.worker(self.name), int(self.s.heartbeat_ttl_s) + 1)
            p.hset(self.keys.models(), self.model, time.time())
            p.execute()
        lost = self.jobs.heartbeat([h.claim for h in held], worker=self.name, lease_s=self.s.heartbeat_ttl_s)
        for jid in lost:
            h = self._held.get(jid)
            if h and not h.abort.is_set():
                self.log.warning("lease lost (presumed dead); stopping job", job=jid)
                h.abort_reason = "lost"
                h.abort.set()
        for jid, dead in self.jobs.reap():
            self.stats["requeued"] += 1
            self.log.warning("re-queued job of a dead worker", job=jid, dead_worker=dead)

    def _poll_cancellations(self) -> None:
        with self._lock:
            if not self._held:
                return
            held = list(self._held.values())
        try:
            cancelled = {b.decode() for b in self.client.smembers(self.keys.cancelled())}
        except redis.RedisError:
            return
        for h in held:
            if h.batch_id in cancelled and not h.abort.is_set():
                self.log.info("batch cancelled: aborting job", batch=h.batch_id, job=h.claim.job_id)
                h.abort_reason = "cancel"
                h.abort.set()

    # ---- one job ------------------------------------------------------------------------
    def _run_job(self, held: _Held) -> None:
        claim = held.claim
        jlog = self.log.bind(job=claim.job_id, attempt=claim.attempt)
        outcome = "done"
        failed: str | None = None
        try:
            try:
                job, payload = with_reconnect(
                    lambda: decode_job(self.client, self.jobs, claim.job_id, outputs=self.outputs),
                    on_retry=self._redis_retry,
                )
            except RETRYABLE_ERRORS:
                raise  # Redis is down, the job is not foreign: re-queued below, never refused
            except Exception as e:  # noqa: BLE001 - anything not an lmdq payload is refused, never run
                jlog.error("refused job: not an lmdq job", error=str(e))
                self.stats["refused"] += 1
                outcome, failed = "done", f"refused by lmdq-worker: {e}"
                claim.job = None
                self._refuse(claim, str(e))
                return
            claim.job = job
            held.batch_id = payload.batch_id
            held.n_requests = len(payload.requests)
            with self._lock:
                self._requests_in_flight += held.n_requests - held.reserved
                held.reserved = held.n_requests
                self._last_job_size = held.n_requests
            jlog = jlog.bind(batch=payload.batch_id)
            outcome, failed = self._execute(held, payload, job, jlog)
            if outcome == "done" and payload.results_url and held.abort_reason != "lost":
                flush_results(self.client, self.keys, payload, jlog, on_retry=self._redis_retry)
            self.stats["jobs"] += 1
        except redis.RedisError as e:
            jlog.error("redis failed while running job; re-queueing", error=str(e))
            outcome = "requeue"
            held.abort.set()  # free the engine slots this job's requests still hold
        except Exception as e:  # noqa: BLE001 - a job failure must not kill the worker
            jlog.exception("job crashed; re-queueing")
            outcome, failed = "requeue", repr(e)
            held.abort.set()
        finally:
            try:
                if held.abort_reason == "lost":
                    pass  # another worker owns it now; our late results were no-ops or harmless
                elif outcome == "requeue":
                    with_reconnect(lambda: self.jobs.requeue(claim, worker=self.name), on_retry=self._redis_retry)
                    self.stats["requeued"] += 1
                elif claim.job is not None:
                    with_reconnect(
                        lambda: self.jobs.finish(claim, worker=self.name, failed=failed), on_retry=self._redis_retry
                    )
            except Exception:  # noqa: BLE001
                jlog.exception("could not release job; its lease will expire and another worker retries it")
            with self._slot:
                # Only our own entry: a re-queued job can already be re-claimed (same id) by this
                # worker's loop, and dropping THAT entry would hide a running job from heartbeat,
                # drain and burst exit.
                if self._held.get(claim.job_id) is held:
                    del self._held[claim.job_id]
                self._requests_in_flight -= held.reserved
                self._slot.notify_all()
            if self.health:
                self.health.set_in_flight(requests=max(0, self._requests_in_flight), jobs=len(self._held))

    def _refuse(self, claim: Claim, why: str) -> None:
        """Drop a foreign job from the queue: lease released, RQ marks it failed, nothing runs."""
        with_reconnect(lambda: self.jobs.finish(claim, worker=self.name), on_retry=self._redis_retry)
        try:
            recorded = self.jobs.mark_refused(claim.job_id, f"refused by lmdq-worker: {why}", ttl_s=self.s.result_ttl_s)
        except redis.RedisError as e:
            recorded = False
            self.log.warning("could not mark refused job failed in RQ", job=claim.job_id, error=str(e))
        if not recorded:
            self.log.warning("refused job has no RQ job hash; dropped from the queue", job=claim.job_id)

    def _write(self, result: Result) -> None:
        new = with_reconnect(lambda: self.store.write_result(result), on_retry=self._redis_retry)
        self.stats["results" if new else "duplicates"] += 1

    def _write_partial(self, result: Result) -> None:
        """Best effort: partial text is a progress hint, so a Redis outage skips it instead of
        failing the job (the final result, written with reconnect, is what must not be lost)."""
        try:
            self.store.write_partial(result)
        except RETRYABLE_ERRORS as e:
            self.log.debug("partial result not written", error=str(e))

    def _execute(self, held: _Held, payload: JobPayload, job: Any, jlog: Any) -> tuple[str, str | None]:
        """Run the job's unfinished requests; returns ('done'|'requeue', failure text)."""
        claim = held.claim
        enq = job.enqueued_at.timestamp() if job.enqueued_at else None
        started = time.time()
        bkey = self.keys.batch(payload.batch_id)
        indices = [r.index for r in payload.requests]  # never empty: JobPayload.requests has min_length 1
        # One round trip before the engine gets the job: RQ's started records, the batch's status and
        # which requests already have results (each round trip waits for the GIL behind the engine).
        with self.client.pipeline() as p:
            p.hmget(bkey, ["status", "expires_at"])
            p.hmget(self.keys.results(payload.batch_id), indices)
            self.jobs.mark_started(claim, self.name, int(self.s.heartbeat_ttl_s) + 60, pipe=p)
            (st, expires_at), have, *_ = p.execute()
        status = BatchStatus(st.decode()) if st else None
        if status in (BatchStatus.validating, BatchStatus.queued):
            self.store.transition(
                payload.batch_id,
                [BatchStatus.validating, BatchStatus.queued],
                BatchStatus.in_progress,
                "in_progress_at",
            )
        done = {i for i, v in zip(indices, have) if v is not None}
        todo = [r for r in payload.requests if r.index not in done]
        if len(todo) < len(payload.requests):
            jlog.info("resuming job: skipping requests that already have results", skipped=len(done))
        if not todo:
            return "done", None
        results = ResultBuilder(
            payload=payload,
            model=self.model,
            backend=self.engine.backend,
            worker=self.name,
            attempt=claim.attempt,
            enqueued_at=enq,
            started_at=started,
        )

        def close_all(status_: ResultStatus, code: str | None, msg: str | None) -> None:
            for r in todo:
                error = ErrorInfo(code=code, message=msg or code) if code else None
                self._write(results.build(r, status=status_, error=error))

        if status in (BatchStatus.cancelling, BatchStatus.cancelled):
            close_all(ResultStatus.cancelled, None, None)
            return "done", None
        if expires_at is not None and float(expires_at) < started:
            close_all(ResultStatus.expired, "expired", "not started within the batch's completion window")
            return "done", None
        if claim.attempt > self.s.max_attempts:
            close_all(
                ResultStatus.failed,
                "max_attempts_exceeded",
                f"job was attempted {claim.attempt - 1} times (max_attempts={self.s.max_attempts})",
            )
            return "done", f"max attempts ({self.s.max_attempts}) exceeded"

        live = [LiveRequest(req=r) for r in todo]
        ereqs = [
            EngineRequest(
                index=i,
                prompt=r.prompt,
                messages=[m.model_dump(exclude_none=True) for m in r.messages] if r.messages else None,
                endpoint=r.endpoint,
                params=payload.params.merged(r.params),
            )
            for i, r in enumerate(todo)
        ]
        finished: set[int] = set()
        try:
            for ev in self.engine.stream(ereqs, held.abort):
                self._on_event(ev, live[ev.index], results, held, finished)
        except EngineError as e:
            jlog.error("engine error; job will be retried", error=str(e))
            if claim.attempt >= self.s.max_attempts:
                rest = [lv.req for lv in live if lv.req.index not in finished]
                for r in rest:
                    self._write(
                        results.build(
                            r,
                            status=ResultStatus.failed,
                            finish_reason=FinishReason.error,
                            error=ErrorInfo(code="engine_error", message=str(e)),
                        )
                    )
                return "done", f"engine error after {claim.attempt} attempts: {e}"
            return "requeue", None
        if held.abort_reason in ("drain", "lost") and len(finished) < len(live):
            return "requeue", None
        return "done", None

    def _on_event(
        self, ev: EngineEvent, lv: LiveRequest, results: ResultBuilder, held: _Held, finished: set[int]
    ) -> None:
        now = time.time()
        if ev.text:
            lv.text.append(ev.text)
            lv.dirty = True
        if lv.first_token_at is None and (ev.generate_token_len > 0 or ev.text):
            # The first partial comes one interval after the first token, not with it: a one-token
            # partial tells a reader little, and writing 1024 of them while the engine fills up (one
            # Lua call each, behind the engine's GIL) delayed the last requests' start (sim, measured).
            lv.first_token_at = lv.last_partial = now
        lv.input_len = ev.input_token_len or lv.input_len
        lv.gen_len = ev.generate_token_len
        if ev.finish_reason is None:
            if lv.dirty and now - lv.last_partial >= self.s.partial_interval_s:
                lv.last_partial, lv.dirty = now, False
                self._write_partial(results.partial(lv))
            return
        reason = FinishReason(ev.finish_reason)
        if reason is FinishReason.abort and held.abort_reason in ("drain", "lost"):
            return  # not an answer: the job is re-queued and this request runs again
        finished.add(ev.index)
        status, error = final_status(ev, reason)
        logprobs = token_logprobs(ev)
        tensors = None
        if status is ResultStatus.completed:
            tensors, terr = self._tensors.put(ev, lv.req, results.payload, self.s.blob_url)
            if terr is not None:
                status, error, reason = ResultStatus.failed, terr, FinishReason.error
        result = results.final(
            lv, status=status, reason=reason, error=error, finished_at=now, logprobs=logprobs, tensors=tensors
        )
        self._write(result)
        if self.health:
            self.health.request_finished(
                status=status.value,
                input_tokens=lv.input_len,
                output_tokens=lv.gen_len,
                ttft_s=(lv.first_token_at - results.started_at) if lv.first_token_at else None,
                latency_s=now - results.started_at,
            )
