"""The worker's life: bootstrap → loop → teardown, with one long-lived engine and many jobs in flight.

Bootstrap registers the worker and starts its heartbeat thread. The loop claims jobs while the engine
has room (so the next job's requests start while the last one's tail still decodes) and hands each to
a thread running one :class:`~lmdq.worker.attempt.JobAttempt`. Teardown drains within
``drain_timeout`` (re-queueing the rest), deregisters and closes the engine.

Faults end the process, not requests: when the engine dies the worker stops claiming at once,
re-queues what it holds without charging it, fails its health checks and exits with
:data:`~lmdq.worker.outcomes.EXIT_ENGINE_DEAD` so its supervisor starts a fresh one.

How many jobs to claim is :mod:`lmdq.worker.admission`; one job attempt :mod:`lmdq.worker.attempt`;
writing results through store faults :mod:`lmdq.results.writer`. Every Redis call goes through
lmdq's core objects (:class:`~lmdq.jobs.queue.JobQueue`, :class:`~lmdq.results.store.ResultStore`,
:class:`~lmdq.registry.store.WorkerRegistry`).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
import structlog

from lmdq.contract import BatchStatus, ErrorCode, ErrorInfo, Result, ResultStatus, Timings
from lmdq.jobs import reads
from lmdq.jobs.decode import OutputNotAllowed, Prefetched, UndecodableJob, decode_job, prefetch
from lmdq.jobs.idle_roster import IdleRoster
from lmdq.jobs.queue import Charge, Claim, FairShare, JobQueue
from lmdq.jobs.wakeup import WakeUp
from lmdq.redis.connection import RETRYABLE_ERRORS, with_reconnect
from lmdq.redis.keys import InvalidModelName, Keys, check_model_name, queue_names
from lmdq.registry.store import WorkerRegistry
from lmdq.results.output_urls import OutputPolicy
from lmdq.results.sink import pending_count
from lmdq.results.store import ResultStore
from lmdq.results.worker_sink import EVERY_ENTRY_S, ResultsSink
from lmdq.results.writer import ResultWriter, WriteAbandoned, is_store_refusal
from lmdq.webhooks.delivery import Deliverer, DeliveryPolicy
from lmdq.webhooks.store import WebhookStore
from lmdq.worker.admission import Admission, EngineGate
from lmdq.worker.attempt import Held, JobAttempt, engine_alive
from lmdq.worker.engines.base import Engine, engine_capacity
from lmdq.worker.idle import IdleWaiter
from lmdq.worker.outcomes import EXIT_ENGINE_DEAD, AbortReason, AttemptEnd, Outcome
from lmdq.worker.reuse import ReuseHook
from lmdq.worker.samples import engine_rows
from lmdq.worker.settings import WorkerSettings

__all__ = ["Worker", "default_worker_name"]

log = structlog.get_logger("lmdq.worker")

_REQUEUED = {Outcome.retry: Charge.attempt, Outcome.requeue: Charge.none, Outcome.crashed: Charge.crash}
"""Outcomes that put the job back on its queue, and what that costs it."""

_REDIS_WARN_EVERY_S = 30.0
"""Warnings about an unreachable Redis are repeated at most this often while it stays away."""

_AFTER_DEATH_S = 30.0
#: after that, how long job threads get to notice they must give up writes Redis keeps refusing (the
#: Kubernetes grace period covers drain + _AFTER_DEATH_S + this + the engine's close: tests/test_deploy.py)
GIVE_UP_WAIT_S = 10.0
"""How long a worker whose engine died waits for its job threads to re-queue their jobs."""


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
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = engine
        self.client = client
        self.s = settings
        self.keys = Keys(settings.key_prefix)
        self.store = ResultStore(client, keys=self.keys, ttl_s=settings.result_ttl_s)
        self.jobs = JobQueue(client, keys=self.keys, job_ttl_s=settings.result_ttl_s,
                             max_job_bytes=settings.max_job_bytes)
        self.outputs = OutputPolicy.for_worker(settings.allowed_output_urls, settings.blob_url,
                                               settings.results_url)
        try:
            self.model = check_model_name(engine.model_name)  # the name is its queues' key: one rule for all
        except InvalidModelName as e:
            raise InvalidModelName(f"{e}; serve the model under a name that follows it: --served-model-name "
                                   "(LMDQ_SERVED_MODEL_NAME)") from None
        self.queues = queue_names(self.model, self.keys.prefix)
        #: every model name this worker answers: its own, then each LoRA adapter it serves (``--adapter``)
        self.served = [self.model, *(a for a in getattr(engine, "adapters", {}) if a != self.model)]
        self.name = settings.worker_name or default_worker_name()
        self.registry = WorkerRegistry(client, keys=self.keys, name=self.name, model=self.model,
                                       ttl_s=settings.heartbeat_ttl_s, adapters=self.served[1:])
        self.health = health
        #: requests the engine runs at once: ``capacity`` when given (tests and benches cap it), else the
        #: engine's own (the contract's ``capacity``; an engine without one fails here, loudly)
        self.capacity = capacity if capacity is not None else engine_capacity(engine)
        if self.capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {self.capacity}")
        self.max_jobs = settings.max_jobs
        self.admission = Admission(capacity=self.capacity, max_jobs=self.max_jobs,
                                   prefetch_requests=settings.prefetch_requests)
        self.gate = EngineGate()
        # idle workers of the model: a claim takes only a fair share while others have nothing (entries
        # outlive a missed renewal: the idle block plus a heartbeat TTL)
        self.roster = IdleRoster(client, keys=self.keys, model=self.model, name=self.name,
                                 ttl_s=max(settings.idle_wait_s, settings.poll_interval_s) + settings.heartbeat_ttl_s)
        self._held: dict[str, Held] = {}
        self._lock = threading.Lock()
        self._slot = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._force = threading.Event()
        self._give_up = threading.Event()
        self._dead: str | None = None  # why the engine is gone, once it is
        self.log = log.bind(worker=self.name, model=self.model)
        self.sink = ResultsSink(client, self.keys, store=self.store, outputs=self.outputs, log=self.log,
                                timeout_s=settings.sink_timeout_s, retry_max_s=settings.sink_retry_max_s,
                                ttl_s=settings.result_ttl_s, stopping=self._stop, on_retry=self._redis_retry)
        self.writer = ResultWriter(self.store, log=self.log, give_up=self._give_up, sink=self.sink)
        #: result reuse (issue 47): the worker keys are computed at start (run), before any claim
        self.reuse = ReuseHook(client, keys=self.keys, engine=engine, settings=settings, served=self.served,
                               log=self.log)
        self.attempt = JobAttempt(engine=engine, jobs=self.jobs, store=self.store, writer=self.writer,
                                  settings=settings, worker=self.name, gate=self.gate, health=health, clock=clock,
                                  request_done=self._request_done, reuse=self.reuse)
        #: jobs: attempts that ran; finished/failed_jobs: jobs released as done (RQ's job counts)
        self._counts = {"jobs": 0, "requeued": 0, "refused": 0, "finished": 0, "failed_jobs": 0}
        #: an idle worker's sleep in Redis (None: polls every poll_interval_s; set up by run())
        self.idle: IdleWaiter | None = None
        self._heartbeat_failing = False
        self._last_redis_warning = -_REDIS_WARN_EVERY_S
        self._warn_lock = threading.Lock()

    @property
    def stats(self) -> dict[str, int]:
        """Counters the worker logs when it stops (``duplicates``: finals the store already had)."""
        w = self.writer.stats
        return {**self._counts, "results": w["results"], "duplicates": w["duplicates"],
                "store_episodes": w["store_episodes"], **self.sink.stats}

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
        with self._slot:  # an idle loop sleeps on it for up to idle_wait_s
            self._slot.notify_all()

    def run(self) -> int:
        """Bootstrap → loop → teardown. Returns the process exit code: 0, or
        :data:`EXIT_ENGINE_DEAD` when the engine died."""
        self.registry.register(pid=os.getpid())
        self.reuse.start()
        hb = threading.Thread(target=self._heartbeat_loop, name="lmdq-heartbeat", daemon=True)
        hb.start()
        # Shard writes that failed (here or on any worker) are retried until they land: lmdq.results.worker_sink
        threading.Thread(target=self.sink.sweep_loop, args=(self._stop,), name="lmdq-sink-sweeper",
                         daemon=True).start()
        threading.Thread(target=self._staging_watch_loop, name="lmdq-staging-watch", daemon=True).start()
        # Webhook events (any batch's, any worker's: lmdq.webhooks) are sent from a thread of their own, so a
        # slow or dead receiver never holds a job
        self.webhooks = Deliverer(WebhookStore(self.client, keys=self.keys), DeliveryPolicy.of(self.s),
                                  name=self.name).start()
        if self.s.idle_wait_s > 0 and not self.s.burst:  # a burst worker exits when idle instead
            wakeup = WakeUp(self.client, keys=self.keys, model=self.model, block_s=self.s.idle_wait_s,
                            also=self.served[1:])
            self.idle = IdleWaiter(wakeup, self._slot, log=self.log)
        self.log.info("worker started", queues=self.queues, capacity=self.capacity, burst=self.s.burst)
        try:
            self._loop()
        finally:
            self._teardown()
        return EXIT_ENGINE_DEAD if self._dead is not None else 0

    def _claim(self, room: int) -> tuple[list[Claim], int]:
        """Up to ``room`` jobs, no more than the fair share while other workers of the model are idle
        (:func:`lmdq.worker.admission.fair_share`, judged inside the claim's own script call: one round
        trip): from this model's queues, then (a worker serving LoRA adapters) each adapter's, each claimed
        under its own model's name (its in-flight list, so a re-queue wakes that model). Returns the claims
        and the share."""
        with self._lock:
            held = len(self._held)
        claimed, n = self.jobs.claim_fair(self.queues, model=self.model, worker=self.name,
                                          lease_s=self.s.heartbeat_ttl_s, n=room,
                                          fair=FairShare(roster=self.roster.key, member=self.roster.name, held=held))
        for name in self.served[1:]:
            if len(claimed) >= n:
                break
            claimed += self.jobs.claim_many(queue_names(name, self.keys.prefix), model=name, worker=self.name,
                                            lease_s=self.s.heartbeat_ttl_s, n=n - len(claimed))
        return claimed, n

    def _room(self) -> int:
        """Jobs to claim now: none while the engine is dead, the store refuses writes or a suspect job
        waits to run alone."""
        if self._dead is not None or self.writer.refusing.is_set() or self.gate.exclusive_wanted:
            return 0
        with self._lock:
            room: int = self.admission.room(len(self._held))
        return room

    def _loop(self) -> None:
        last_cancel_poll = 0.0
        backoff = 0.1
        while not self._stop.is_set():
            if not engine_alive(self.engine):
                self.engine_died("the engine reports it is no longer alive")
                return
            if self.health:
                self.health.beat()
            now = time.monotonic()
            if now - last_cancel_poll > 0.5:
                last_cancel_poll = now
                self._poll_cancellations()
            claimed: list[Claim] = []
            room = self._room()
            idle = not self._held
            share = room
            if room:
                try:
                    claimed, share = self._claim(room)
                    backoff = 0.1
                except RETRYABLE_ERRORS as e:
                    # Redis is away: wait for it however long it takes (never exit with jobs held),
                    # but on the stop event, so SIGTERM still drains promptly.
                    self._redis_retry(e, backoff)
                    self._stop.wait(backoff)
                    backoff = min(5.0, backoff * 2)
                    continue
            if claimed:
                self._leave_roster()
                if idle and len(claimed) >= share:
                    self._pass_wake_on()
                pre = self._prefetch(claimed)
                for c in claimed:
                    held = Held(claim=c, prefetched=pre.get(c.job_id))
                    with self._lock:
                        held.reserved = self.admission.reserve()  # corrected once the payload is read
                        self._held[c.job_id] = held
                    # One daemon thread per held job (at most jobs_in_flight): a thread stuck in a dead
                    # engine's stream can never keep the process from exiting with its code.
                    threading.Thread(target=self._run_job, args=(held,), name=f"lmdq-job-{c.job_id}",
                                     daemon=True).start()
                continue
            if room and not self._held:
                self._enter_roster()
            with self._slot:
                if self.s.burst and not self._held and room:
                    if self._queues_empty():
                        self.log.info("burst: queues empty, exiting")
                        return
                # Busy (jobs held): an empty claim is retried when a job finishes (notify) or after
                # busy_poll_interval_s. Polling Redis every poll_interval_s here costs GIL time that
                # LMDeploy's in-process scheduler needs (measured: ~1 ms of Python per claim call).
                if self.idle is not None and not self._held and room:
                    # Idle: sleep in Redis until a submit, re-queue or reap leaves a token, at most
                    # idle_wait_s; SIGTERM and stop() notify _slot, so a drain does not wait for it.
                    self.idle.wait(self._stop)
                    continue
                self._slot.wait(max(self.s.poll_interval_s, self.s.busy_poll_interval_s) if self._held
                                else self.s.poll_interval_s)

    def _prefetch(self, claimed: list[Claim]) -> dict[str, Prefetched]:
        """The claimed jobs' reads (each job and its batch's record), all in ONE round trip
        (:func:`lmdq.jobs.decode.prefetch`), for their threads to decode. A Redis error leaves each thread
        to read its own job, as it would have, through its own retries."""
        try:
            return prefetch(self.jobs, [c.job_id for c in claimed])
        except redis.RedisError:
            return {}

    def _enter_roster(self) -> None:
        """About to sleep holding nothing: count as idle for the model's other workers' claims."""
        try:
            self.roster.enter(time.monotonic())
        except redis.RedisError:
            pass  # only a fair share missed: the claims report Redis outages themselves

    def _leave_roster(self) -> None:
        try:
            self.roster.leave()
        except redis.RedisError:
            pass  # its entry expires by itself; meanwhile peers only claim a little less

    def _pass_wake_on(self) -> None:
        """This idle worker claimed a full share: more may be queued, so wake the next idle worker
        (one token wakes one worker; a batch wakes them one after another, not all at once)."""
        if self.idle is None:
            return
        try:
            self.idle.wakeup.notify()
        except redis.RedisError:
            pass  # a missed wake-up only delays: idle workers claim at the end of each block anyway

    def _queues_empty(self) -> bool:
        """Burst mode's exit test; an unreachable Redis counts as 'maybe not empty'."""
        try:
            return self.jobs.queue_depth(self.queues) == 0
        except RETRYABLE_ERRORS as e:
            self._redis_retry(e, self.s.poll_interval_s)
            return False

    def engine_died(self, why: str) -> None:
        """The engine is gone for good: claim nothing more, stop every held job (each is re-queued
        without charging it), fail the health checks, and end the loop (the process then exits
        with EXIT_ENGINE_DEAD). Idempotent: the first reason is the one reported."""
        with self._slot:
            if self._dead is not None:
                return
            self._dead = why
            held = list(self._held.values())
            self._slot.notify_all()
        if self.health is not None:
            self.health.mark_engine_dead(why)
        for h in held:
            h.stop(AbortReason.engine_dead)
        self._stop.set()

    def _last_webhooks(self) -> None:
        """Stop the delivery thread, then one last pass: a burst worker that ended a batch tells its webhook
        before it exits (an event whose receiver is down stays in Redis for the next deliverer)."""
        hooks: Deliverer | None = getattr(self, "webhooks", None)
        if hooks is None:
            return
        hooks.stop(timeout_s=self.s.webhook_timeout_s + 1)
        try:
            hooks.run_once()
        except Exception as e:  # noqa: BLE001 - the events stay in Redis for the next deliverer; the exit goes on
            self.log.warning("webhook last pass failed", error=f"{type(e).__name__}: {e}"[:200])

    def _teardown(self) -> None:
        if self.s.burst and not self._stop.is_set() and self._dead is None:
            self._sweep_before_exit()
        if self.health:
            self.health.mark_draining()
        with self._slot:
            if self._dead is None:
                deadline = time.monotonic() + self.s.drain_timeout_s
                while self._held and time.monotonic() < deadline and not self._force.is_set() and self._dead is None:
                    self._slot.wait(0.2)
            # The drain is over: a shard not confirmed by now is not waited for, and nothing seals any
            # more; those jobs keep their results in Redis (lmdq.results.worker_sink).
            self.sink.close()
            if self._held:
                if self._dead is None:
                    self.log.warning("drain timeout: aborting and re-queueing held jobs", jobs=list(self._held))
                for h in self._held.values():
                    h.stop(AbortReason.drain)
            end = time.monotonic() + _AFTER_DEATH_S
            while self._held and time.monotonic() < end:
                self._slot.wait(0.2)
            if self._held:
                # Job threads stuck writing to a Redis that still refuses: give their writes up. Their
                # leases expire and another worker runs what they had not stored.
                self._give_up.set()
                end = time.monotonic() + GIVE_UP_WAIT_S
                while self._held and time.monotonic() < end:
                    self._slot.wait(0.2)
        self._stop.set()  # also ends the heartbeat thread (a burst exit never set it)
        self._last_webhooks()
        if self.idle is not None:
            self.idle.close()
        try:
            self._leave_roster()
            self.registry.deregister()
        except redis.RedisError:
            pass
        self.engine.close()
        self.sink.report_shutdown()
        if self._dead is not None:
            self.log.error(f"engine died: {self._dead}; exiting so the supervisor restarts the worker",
                           exit_code=EXIT_ENGINE_DEAD, requeued=self._counts["requeued"])
        self.log.info("worker stopped", **self.stats)

    def _sweep_before_exit(self) -> None:
        """A burst worker may be the last one running: it tries every scheduled shard write once before
        it exits (those still failing stay scheduled, their results readable in Redis). A signal ends
        the attempt at once: the drain that follows closes the sink, and nothing is lost by stopping."""
        def sweep() -> None:
            try:
                left = pending_count(self.client, self.keys)
                if left:
                    self.sink.sweep_once(ahead_s=EVERY_ENTRY_S, limit=left)
            except redis.RedisError as e:
                self._redis_retry(e, 0.0)

        t = threading.Thread(target=sweep, name="lmdq-sink-last-sweep", daemon=True)
        t.start()
        while t.is_alive() and not self._stop.is_set():
            t.join(0.2)

    def _redis_retry(self, e: Exception, delay: float) -> None:
        """One warning per outage (at most one per ``_REDIS_WARN_EVERY_S``), not one per retry: the
        loop, the job threads and the sink all retry through the same outage."""
        now = time.monotonic()
        with self._warn_lock:  # not self._lock: the loop calls this while holding it
            warn = now - self._last_redis_warning >= _REDIS_WARN_EVERY_S
            if warn:
                self._last_redis_warning = now
        if warn:
            self.log.warning("redis unavailable, retrying", error=str(e), delay_s=delay)
        else:
            self.log.debug("redis unavailable, retrying", error=str(e), delay_s=delay)

    # ---- background: heartbeat, reaping, cancellation -----------------------------------
    def _heartbeat_loop(self) -> None:
        period = max(0.5, self.s.heartbeat_ttl_s / 3)
        while True:
            try:
                self._heartbeat_once()
                if self._heartbeat_failing:
                    self._heartbeat_failing = False
                    self.log.info("heartbeat recovered")
            except redis.RedisError as e:
                # One line per episode: a Redis that refuses writes for a minute must not print 60.
                if not self._heartbeat_failing:
                    self._heartbeat_failing = True
                    self.log.warning("heartbeat failed", error=str(e), refused=is_store_refusal(e))
            except Exception:  # noqa: BLE001 - the heartbeat must survive anything
                self.log.exception("heartbeat crashed")
            if self._stop.wait(period) and not self._held:
                return
            if self._stop.is_set():
                time.sleep(min(period, 1.0))

    def _staging_watch_loop(self) -> None:
        """Batches whose submit died while staging them (issue 44) are ended here once their staging lease
        lapsed (their unstaged requests fail as ``submit_interrupted``), on a thread of its own: answering a
        large batch's requests must never delay the heartbeat that keeps this worker's leases."""
        from lmdq.submission.ledger import BatchLedger

        ledger = BatchLedger(self.client, keys=self.keys, ttl_s=self.s.result_ttl_s,
                             max_job_bytes=self.s.max_job_bytes, staging_lease_s=self.s.staging_lease_s)
        period = max(0.5, min(self.s.heartbeat_ttl_s / 3, self.s.staging_lease_s / 2))
        while not self._stop.wait(period):
            try:
                for batch_id in ledger.notice_interrupted():
                    self.log.warning("ended a batch whose submit died while staging it", batch=batch_id)
            except Exception as e:  # noqa: BLE001 - tried again next period
                self.log.warning("staging watch failed", error_type=type(e).__name__, error=str(e)[:300])

    def _heartbeat_once(self) -> None:
        with self._lock:
            held = {jid: h for jid, h in self._held.items() if not h.released}
        # Leases first: they are what keeps the jobs ours (and their script goes through even when
        # Redis is out of memory); the worker's own record and the reaping come after.
        lost = self.jobs.heartbeat([h.claim for h in held.values()], worker=self.name,
                                   lease_s=self.s.heartbeat_ttl_s)
        for jid in lost:
            h = held.get(jid)
            with self._lock:
                current = self._held.get(jid)
            # A job that finished between the snapshot and the script released its own lease: that
            # is not a loss. Only the same, still running attempt can have lost its lease.
            if h is None or h.released or current is not h:
                continue
            if held[jid].stop(AbortReason.lost):
                self.log.warning("lease lost (presumed dead); stopping job", job=jid)
        for jid, dead in self.jobs.reap():
            self._counts["requeued"] += 1
            self.log.warning("re-queued job of a dead worker", job=jid, dead_worker=dead)
        self.registry.beat(busy=bool(held), done=self._counts["finished"], failed=self._counts["failed_jobs"])

    def _poll_cancellations(self) -> None:
        with self._lock:
            if not self._held:
                return
            held = list(self._held.values())
        try:
            cancelled = self.registry.cancelled_batches()
        except redis.RedisError:
            return
        for h in held:
            if h.batch_id in cancelled and h.stop(AbortReason.cancel):
                self.log.info("batch cancelled: aborting job", batch=h.batch_id, job=h.claim.job_id)

    # ---- one job ------------------------------------------------------------------------
    def _run_job(self, held: Held) -> None:
        claim = held.claim
        jlog = self.log.bind(job=claim.job_id, attempt=claim.attempt, run=claim.run)
        end = AttemptEnd(Outcome.requeue)
        output_refusal: str | None = None
        try:
            try:
                job, payload = with_reconnect(
                    lambda: decode_job(self.client, self.jobs, claim.job_id, outputs=self.outputs,
                                       prefetched=_take(held)),
                    on_retry=self._redis_retry,
                )
            except RETRYABLE_ERRORS:
                raise  # Redis is down, the job is not foreign: re-queued below, never refused
            except UndecodableJob as e:  # genuine, but this worker cannot read it: answer each request, don't run
                jlog.error("job this worker cannot decode: failing its requests (undecodable_job)", error=str(e),
                           batch=e.batch.id, requests=len(e.requests))
                self._counts["refused"] += 1
                end = AttemptEnd(Outcome.refused)
                claim.job = None
                self._answer_undecodable(e)
                self._refuse(claim, str(e))
                return
            except OutputNotAllowed as e:  # genuine, but writes where this worker may not: answer, don't run
                jlog.error("batch's output URL is not allowed on this worker: failing its requests", error=str(e))
                job, payload, output_refusal = e.job, e.payload, str(e)
            except Exception as e:  # noqa: BLE001 - anything not an lmdq payload is refused, never run
                jlog.error("refused job: not an lmdq job", error=str(e))
                self._counts["refused"] += 1
                end = AttemptEnd(Outcome.refused)
                claim.job = None
                self._refuse(claim, str(e))
                return
            claim.job = job
            if payload.model not in self.served:  # genuine (it matches its batch), but not this model's to answer
                end = AttemptEnd(Outcome.refused)  # released here: _release leaves it alone
                moved = with_reconnect(lambda: self.jobs.move_to_model(claim, worker=self.name, model=payload.model,
                                                                       origin=job.origin),
                                       on_retry=self._redis_retry)
                jlog.warning("job of another model: moved to that model's queue, not run", its_model=payload.model,
                             batch=payload.batch_id, queue=moved)
                return
            held.batch_id = payload.batch_id
            held.n_requests = engine_rows(payload)  # n sequences for a request with params.n = n
            with self._slot:
                held.reserved = self.admission.resize(held.reserved, held.n_requests)
                if self.admission.job_fits():  # smaller than guessed (the first jobs): claim more now
                    self._slot.notify_all()
            jlog = jlog.bind(batch=payload.batch_id)
            end = self.attempt.run(held, payload, job, jlog, output_refusal=output_refusal)
            self._counts["jobs"] += 1
        except WriteAbandoned as e:
            jlog.warning("stopping while Redis refuses writes: job left to its lease, another worker re-runs it",
                         error=str(e))
            end = AttemptEnd(Outcome.lost)
            held.abort.set()
        except redis.RedisError as e:
            jlog.error("redis failed while running job; re-queueing", error=str(e))
            end = AttemptEnd(Outcome.requeue)
            held.abort.set()  # free the engine slots this job's requests still hold
        except Exception:  # noqa: BLE001 - a job failure must not kill the worker
            # Neither the engine's fault nor Redis' (e.g. the blob store refusing tensors, a bug): charged
            # like an engine error, so a job that crashes every time ends after max_attempts instead of
            # re-running in a tight loop.
            jlog.exception("job crashed; re-queueing (charged as an attempt)")
            end = AttemptEnd(Outcome.retry)
            held.abort.set()
        finally:
            if end.outcome is Outcome.crashed:  # first: the other held jobs must stop at once
                self.engine_died(end.error or f"it failed job {claim.job_id} mid-stream")
            self._release(held, end, jlog)
            with self._slot:
                # Only our own entry: a re-queued job can already be re-claimed (same id) by this
                # worker's loop, and dropping THAT entry would hide a running job from heartbeat,
                # drain and burst exit.
                if self._held.get(claim.job_id) is held:
                    del self._held[claim.job_id]
                self.admission.release(held.reserved)
                self._slot.notify_all()
            if self.health:
                self.health.set_in_flight(requests=max(0, self.admission.requests_in_flight), jobs=len(self._held))

    def _request_done(self, held: Held, n: int = 1) -> None:
        """``n`` of ``held``'s requests left the engine (or were answered from reuse): their slots count as
        free now, not when the whole job (its slowest request, then its result writes and release) is done.
        The claimer is woken only once a whole job fits, so claims stay one per job's worth of freed slots."""
        with self._slot:
            n = min(n, held.reserved)
            if n > 0:
                held.reserved -= n
                self.admission.release(n)
                if self.admission.job_fits():
                    self._slot.notify_all()

    def _release(self, held: Held, end: AttemptEnd, jlog: Any) -> None:
        """Give the job back (re-queue, charged or not) or release it as done, per the outcome."""
        held.released = True
        claim = held.claim
        if end.outcome in (Outcome.lost, Outcome.refused) or held.abort_reason is AbortReason.lost:
            return  # another worker owns it now (our late results were no-ops), or it is not a job
        try:
            if end.outcome in _REQUEUED:
                charge = _REQUEUED[end.outcome]
                if charge is Charge.crash and not held.in_engine:
                    charge = Charge.none  # it never reached the engine that died
                owned = self.writer.call(
                    lambda: self.jobs.release(claim, worker=self.name, requeue=True, charge=charge, killer=end.killer),
                    "re-queue job",
                )
                if owned:
                    self._counts["requeued"] += 1
                    try:
                        self.jobs.record_requeued([claim.job_id])
                    except redis.RedisError:
                        pass  # RQ's display records only
            elif claim.job is not None:
                # one round trip: the release and RQ's end records (lmdq.jobs.queue.JobQueue.release_ended)
                owned, recorded = self.writer.call(
                    lambda: self.jobs.release_ended(claim, worker=self.name, failed=end.failure), "release job")
                if owned:
                    self._counts["failed_jobs" if end.failure else "finished"] += 1
                    if not recorded:
                        self.writer.call(lambda: self.jobs.record_end(claim, failed=end.failure), "record job end")
                    if held.forget:
                        self.writer.call(lambda: self.jobs.forget(claim.job_id), "drop finished job")
        except WriteAbandoned:
            jlog.warning("job not released (stopping while Redis refuses writes); its lease will expire")
        except Exception:  # noqa: BLE001
            jlog.exception("could not release job; its lease will expire and another worker retries it")

    def _answer_undecodable(self, e: UndecodableJob) -> None:
        """One ``failed`` result per request of a job no worker of this build can decode, so its batch ends
        (exactly once: a request that has a result already keeps it). The reason says what to change;
        ``lmdq-producer retry`` re-runs the requests once workers can read them."""
        now = time.time()
        status = with_reconnect(lambda: reads.batch_status(self.client, self.keys, e.batch.id),
                                on_retry=self._redis_retry)
        cancelled = status in (BatchStatus.cancelling.value.encode(), BatchStatus.cancelled.value.encode())
        error = None if cancelled else ErrorInfo(code=ErrorCode.undecodable_job, message=str(e))
        results = [Result(batch_id=e.batch.id, custom_id=cid, index=i, model=e.batch.model, worker=self.name,
                          status=ResultStatus.cancelled if cancelled else ResultStatus.failed, error=error,
                          timings=Timings(enqueued_at=e.batch.created_at, finished_at=now))
                   for i, cid in e.requests]
        with_reconnect(lambda: self.store.write_results(results), on_retry=self._redis_retry)

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


def _take(held: Held) -> Prefetched | None:
    """``held``'s prefetched reads, once: a retry after a Redis error reads the job afresh."""
    pre, held.prefetched = held.prefetched, None
    return pre
