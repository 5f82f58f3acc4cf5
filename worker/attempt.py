"""One attempt at one job: read where it stands, apply the batch's policy, stream it through the engine.

Policy first, from ONE store round trip (:meth:`lmdq.jobs.queue.JobQueue.begin`): requests that already
have results are skipped (a resumed job), a cancelled batch's requests end ``cancelled``, a batch
past its completion window (by the Redis server's clock) ends them ``expired``, a job out of attempts
or runs ends them ``failed``. Then the engine: every event of a request goes to the result writer,
the final one as the request's answer.

How the attempt ends is an :class:`~lmdq.worker.outcomes.Outcome`. Faults are not failures: an engine
error for the job's requests is charged (``retry``), an engine death, a drain or a lost lease is not.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmdq.contract import BatchStatus, ErrorCode, ErrorInfo, FinishReason, JobPayload, Request, Result, ResultStatus
from lmdq.gates.keeper import GateKeeper
from lmdq.jobs.decode import Prefetched
from lmdq.jobs.queue import Claim, JobQueue
from lmdq.redis.keys import BatchField
from lmdq.results.store import ResultStore
from lmdq.results.writer import PendingWrite, ResultWriter
from lmdq.worker.admission import EngineGate
from lmdq.worker.engines.base import Engine, EngineDead, EngineError, EngineEvent
from lmdq.worker.engines.engine_health import EngineHealth
from lmdq.worker.images import resolve_images
from lmdq.worker.outcomes import MAX_RUNS, SUSPECT_AFTER_CRASHES, AbortReason, AttemptEnd, Outcome
from lmdq.worker.plan_recorder import PlanRecorder
from lmdq.worker.result_builder import LiveRequest, ResultBuilder, final_status, token_logprobs
from lmdq.worker.reuse import ReuseHook
from lmdq.worker.samples import SampleSet, fan_out
from lmdq.worker.settings import WorkerSettings
from lmdq.worker.tensor_store import TensorStore

__all__ = ["DEATH_WINDOW_S", "Held", "JobAttempt", "engine_alive"]

_STOPPED = (AbortReason.drain, AbortReason.lost, AbortReason.engine_dead)
"""Abort reasons after which an aborted request is not an answer: the job runs again."""

DEATH_WINDOW_S = 1.0
"""How long a job whose stream raised ``EngineError`` waits for the other jobs in the engine to fail
too (then the engine is dead and none is charged) before it counts the error as its own."""


def engine_alive(engine: Engine) -> bool:
    """``engine.alive()``; a wrapper that predates it (a test double lending an engine) counts as
    alive, so death is then detected from its errors alone."""
    alive = getattr(engine, "alive", None)
    return True if alive is None else bool(alive())


@dataclass
class Held:
    """A job this worker holds, as the loop, the heartbeat and the job's thread all see it."""

    claim: Claim
    batch_id: str = ""
    n_requests: int = 0
    abort: threading.Event = field(default_factory=threading.Event)
    abort_reason: AbortReason | None = None
    #: requests counted against engine capacity for this job
    reserved: int = 0
    #: its requests were handed to the engine (an engine death counts against it only then)
    in_engine: bool = False
    #: its lease is being released: a heartbeat that finds the lease gone is not news
    released: bool = False
    #: its results are all in a shard and none is to be retried: its job hash (the prompts) can go
    #: once the job is released (see lmdq.results.sink)
    forget: bool = False
    #: final results queued for the writer (ResultWriter.final_async), waited for before the attempt ends
    writes: list[PendingWrite] = field(default_factory=list)
    #: issue 47, a batch with ``--reuse``: its requests' identities (index -> identity, the qualifying ones)
    #: and the completed results this attempt computed, recorded in the reuse index when the job ends
    reuse_ids: dict[int, bytes] = field(default_factory=dict)
    fresh: list[Result] = field(default_factory=list)
    #: its reads, made with the other jobs of its claim in one round trip (lmdq.jobs.decode.prefetch); None:
    #: the job's thread reads it itself
    prefetched: Prefetched | None = None

    def stop(self, reason: AbortReason) -> bool:
        """Abort the job's in-flight requests for ``reason`` (the first reason wins). True if new."""
        if self.abort.is_set():
            return False
        self.abort_reason = reason
        self.abort.set()
        return True


class _EngineGone(Exception):
    """A request ended with an error while the engine reports itself dead: not the request's fault."""


class JobAttempt:
    """Runs held jobs on one engine (one instance per worker, called from many job threads)."""

    def __init__(
        self,
        *,
        engine: Engine,
        jobs: JobQueue,
        store: ResultStore,
        writer: ResultWriter,
        settings: WorkerSettings,
        worker: str,
        gate: EngineGate,
        health: Any | None = None,
        clock: Callable[[], float] = time.time,
        request_done: Callable[[Held, int], None] | None = None,
        reuse: ReuseHook | None = None,
    ) -> None:
        self.engine = engine
        self.jobs = jobs
        self.store = store
        self.writer = writer
        self.s = settings
        self.worker = worker
        self.gate = gate
        self.health = health
        #: the worker's clock: result timings only (leases and expiry use the Redis server's)
        self.clock = clock
        #: called (from the job's thread) as each request's final event arrives, BEFORE its result is
        #: written: its engine slot is free now, and the worker's claimer should know at once
        self.request_done = request_done
        #: belt and braces for an engine that dies without saying so: every job in the engine raising
        #: EngineError at once (at least two, no request finishing in between) is the engine's death,
        #: and none of those jobs is charged an attempt; the same rule the engines keep for requests
        self.watch = EngineHealth(min_units=2)
        #: result reuse (issue 47): answers a ``--reuse`` batch's requests from the index before the engine
        self.reuse = reuse
        self._tensors = TensorStore()
        #: output lengths and tok/s for later batches' plans (issue 46)
        self.plan = PlanRecorder.for_attempt(self)
        #: a gated job's results judged as it ends (canary, rolling window: lmdq.gates)
        self.gates = GateKeeper(store)

    def run(self, held: Held, payload: JobPayload, job: Any, jlog: Any, *,
            output_refusal: str | None = None) -> AttemptEnd:
        """One attempt. ``output_refusal``: the batch names an output URL this worker may not write to
        (:class:`lmdq.jobs.decode.OutputNotAllowed`): its unfinished requests end ``failed`` with
        ``output_url_not_allowed`` instead of running, and the job ends failed (never retried).

        A job that ends (done or failed, its lease still ours) is sealed by the writer that wrote its
        results: with a results URL its shard is written and its records leave Redis
        (:meth:`ResultWriter.seal`); ``held.forget`` then says whether its job hash can go too."""
        end = self._run(held, payload, job, jlog, output_refusal=output_refusal)
        sealed = False
        if end.outcome in (Outcome.done, Outcome.failed) and held.abort_reason is not AbortReason.lost:
            self.writer.call(lambda: self.gates.job_ended(payload, jlog), "judge quality gates")
            entry = self.writer.seal(payload, jlog)
            held.forget = entry is not None and entry.all_completed()
            sealed = entry is not None and payload.results_url is not None
        if self.reuse is not None and held.fresh:
            self.reuse.record(payload, held.fresh, held.reuse_ids, sealed=sealed)
        return end

    def _run(self, held: Held, payload: JobPayload, job: Any, jlog: Any, *,
             output_refusal: str | None) -> AttemptEnd:
        claim = held.claim
        enq = job.enqueued_at.timestamp() if job.enqueued_at else None
        started = self.clock()
        indices = [r.index for r in payload.requests]  # never empty: JobPayload.requests has min_length 1
        start = self.writer.call(
            lambda: self.jobs.begin(claim, batch_id=payload.batch_id, indices=indices, worker=self.worker,
                                    ttl_s=int(self.s.heartbeat_ttl_s) + 60,
                                    job_no=payload.job_no if payload.results_url else None),
            "start job",
        )
        if start.status in (BatchStatus.validating, BatchStatus.queued):
            self.writer.call(
                lambda: self.store.batches.transition(payload.batch_id, [BatchStatus.validating, BatchStatus.queued],
                                              BatchStatus.in_progress, BatchField.in_progress_at),
                "mark batch in progress",
            )
        todo = [r for r in payload.requests if r.index not in start.finished]
        if len(todo) < len(payload.requests):
            jlog.info("resuming job: skipping requests that already have results", skipped=len(start.finished))
        if not todo:
            return AttemptEnd(Outcome.done)
        results = ResultBuilder(
            payload=payload,
            # the job's model: the base model's name, or one of its adapters' (--adapter) this worker serves
            model=payload.model if payload.model in getattr(self.engine, "adapters", {}) else self.engine.model_name,
            backend=self.engine.backend,
            worker=self.worker,
            attempt=min(claim.attempt, self.s.max_attempts),
            enqueued_at=enq,
            started_at=started,
        )

        def close_all(reqs: list[Request], status: ResultStatus, code: ErrorCode | None, msg: str | None) -> None:
            error = ErrorInfo(code=code, message=msg or code) if code else None
            self.writer.wait([self.writer.final_async(results.build(r, status=status, error=error,
                                                                    finished_at=self.clock())) for r in reqs])

        if start.status in (BatchStatus.cancelling, BatchStatus.cancelled):
            close_all(todo, ResultStatus.cancelled, None, None)
            return AttemptEnd(Outcome.done)
        if start.expired:
            close_all(todo, ResultStatus.expired, ErrorCode.expired, "not started within the batch's completion window")
            return AttemptEnd(Outcome.done)
        if output_refusal is not None:
            close_all(todo, ResultStatus.failed, ErrorCode.output_url_not_allowed,
                      f"{output_refusal} (the operator allows workers to write there with LMDQ_ALLOWED_OUTPUT_URLS)")
            return AttemptEnd(Outcome.failed, f"output URL not allowed: {output_refusal}")
        if claim.attempt > self.s.max_attempts:
            close_all(todo, ResultStatus.failed, ErrorCode.max_attempts_exceeded,
                      f"the engine failed this job {claim.charges} times (max_attempts={self.s.max_attempts})")
            return AttemptEnd(Outcome.failed, f"max attempts ({self.s.max_attempts}) exceeded")
        if claim.run > MAX_RUNS:
            close_all(todo, ResultStatus.failed, ErrorCode.max_runs_exceeded,
                      f"the job was started {claim.run - 1} times without finishing (limit {MAX_RUNS})")
            return AttemptEnd(Outcome.failed, f"max runs ({MAX_RUNS}) exceeded")
        if claim.killer is not None:
            killer = [r for r in todo if r.index == claim.killer]
            if killer:
                jlog.error("request killed the engine while running alone: failing it", index=claim.killer,
                           crashes=claim.crashes)
                close_all(killer, ResultStatus.failed, ErrorCode.engine_crash,
                          "the engine died while running this request alone (after this job was in the engine "
                          f"for {claim.crashes} engine deaths)")
                todo = [r for r in todo if r.index != claim.killer]
                if not todo:
                    return AttemptEnd(Outcome.done)
        if self.reuse is not None and payload.reuse_ttl_s is not None:
            todo = self._reuse(held, payload, todo, enq, jlog)
            if not todo:
                return AttemptEnd(Outcome.done)
        if claim.crashes >= SUSPECT_AFTER_CRASHES:
            return self._run_alone(held, payload, todo, results, jlog)
        with self.gate.shared(held.abort) as entered:
            if not entered:
                return self._stopped(held)
            return self._stream(held, payload, todo, results, jlog)

    def _reuse(self, held: Held, payload: JobPayload, todo: list[Request], enq: float | None,
               jlog: Any) -> list[Request]:
        """Answer what the reuse index holds (issue 47); returns the requests left for the engine."""
        assert self.reuse is not None
        held.reuse_ids = self.reuse.identities(payload, todo)
        if not held.reuse_ids:
            return todo
        hits = self.reuse.answers(payload, todo, held.reuse_ids, worker=self.worker,
                                  attempt=min(held.claim.attempt, self.s.max_attempts), enqueued_at=enq,
                                  now=self.clock())
        if not hits:
            return todo
        # the whole job's hits in one write from this thread (exactly once each: the results script refuses a
        # request that already has its result, e.g. from an attempt killed half-way)
        self.writer.finals(list(hits.values()))
        if self.request_done is not None:
            self.request_done(held, len(hits))
        jlog.info("answered from reuse", reused=len(hits), left=len(todo) - len(hits))
        return [r for r in todo if r.index not in hits]

    def _run_alone(self, held: Held, payload: JobPayload, todo: list[Request], results: ResultBuilder,
                   jlog: Any) -> AttemptEnd:
        """A suspect job: alone in the engine, one request at a time, so a death names its request."""
        jlog.warning("job was in the engine at repeated engine deaths: running it alone, one request at a time",
                     crashes=held.claim.crashes, requests=len(todo))
        with self.gate.exclusive(held.abort) as entered:
            if not entered:
                return self._stopped(held)
            for r in todo:
                if held.abort.is_set():
                    return self._stopped(held)  # the rest runs again (or is cancelled) on the next claim
                end = self._stream(held, payload, [r], results, jlog)
                if end.outcome is Outcome.crashed:
                    return AttemptEnd(Outcome.crashed, killer=r.index, error=end.error)
                if end.outcome is not Outcome.done:
                    return end
        return AttemptEnd(Outcome.done)

    def _stopped(self, held: Held) -> AttemptEnd:
        """Stopped before its requests reached the engine: runs again, uncharged."""
        if held.abort_reason is AbortReason.lost:
            return AttemptEnd(Outcome.lost)
        return AttemptEnd(Outcome.requeue)

    def _stream(self, held: Held, payload: JobPayload, todo: list[Request], results: ResultBuilder,
                jlog: Any) -> AttemptEnd:
        self.plan.enter(payload)
        try:
            return self._stream_once(held, payload, todo, results, jlog)
        finally:  # every result handed to the writer is in Redis before the job can be released
            self.plan.leave()
            self.writer.wait(held.writes)

    def _stream_once(self, held: Held, payload: JobPayload, todo: list[Request], results: ResultBuilder,
                     jlog: Any) -> AttemptEnd:
        claim = held.claim
        live = [LiveRequest(req=r) for r in todo]
        # image parts: read each referenced image now and hand the engine data: URLs (worker/images.py); a
        # request whose image cannot be read fails alone (invalid_image), the others run
        with_images, bad_images = resolve_images(todo, max_bytes=self.s.max_image_bytes,
                                                 timeout_s=self.s.sink_timeout_s)
        if bad_images:
            keep = [pos for pos in range(len(todo)) if pos not in bad_images]
            for pos, why in bad_images.items():
                jlog.warning("image unreadable: request fails", index=todo[pos].index, error=why)
                held.writes.append(self.writer.final_async(results.build(
                    todo[pos], status=ResultStatus.failed, finish_reason=FinishReason.error,
                    error=ErrorInfo(code=ErrorCode.invalid_image, message=why), finished_at=self.clock())))
            with_images = {keep.index(pos): msgs for pos, msgs in with_images.items()}
            todo = [todo[pos] for pos in keep]
            live = [LiveRequest(req=r) for r in todo]
            if not todo:
                return AttemptEnd(Outcome.done)
        # n > 1: n engine requests per request, side by side, gathered into one result (worker/samples.py)
        ereqs, slots, sample_sets, refused = fan_out(todo, payload.params, with_images or None)
        adapter = payload.model if payload.model in getattr(self.engine, "adapters", {}) else None
        if adapter is not None:  # a job of one of this worker's LoRA adapters (--adapter): each request runs with it
            ereqs = [dataclasses.replace(e, adapter=adapter) for e in ereqs]
        #: positions in ``todo`` whose final result is written
        finished: set[int] = set()
        if held.abort.is_set() or not engine_alive(self.engine):
            return self._stopped(held)  # never reached the engine: no crash to count against it
        for pos, why in refused.items():
            finished.add(pos)
            held.writes.append(self.writer.final_async(results.build(
                todo[pos], status=ResultStatus.failed, finish_reason=FinishReason.error,
                error=ErrorInfo(code=ErrorCode.unsupported_feature, message=why), finished_at=self.clock())))
        held.in_engine = True
        self.watch.begin()
        counted = True
        try:
            for ev in self.engine.stream(ereqs, held.abort) if ereqs else ():
                pos, sample = slots[ev.index]
                self._on_event(ev, live[pos], results, held, finished, pos, sample, sample_sets.get(pos))
        except (EngineDead, _EngineGone) as e:
            jlog.warning("engine died while running job; it runs again on a fresh engine, uncharged", error=str(e))
            return AttemptEnd(Outcome.crashed, error=str(e))
        except EngineError as e:
            counted = False
            epoch = self.watch.end_engine_error()
            # did every other job in the engine fail at the same moment?
            dead = self.watch.wait_verdict(epoch, DEATH_WINDOW_S)
            if dead or not engine_alive(self.engine) or held.abort_reason is AbortReason.engine_dead:
                jlog.warning("engine error with the engine dead; job runs again, uncharged", error=str(e))
                return AttemptEnd(Outcome.crashed, error=str(e))
            jlog.error("engine error; job will be retried", error=str(e))
            if claim.attempt >= self.s.max_attempts:
                for pos, lv in enumerate(live):
                    if pos not in finished:
                        self.writer.final(results.build(
                            lv.req, status=ResultStatus.failed, finish_reason=FinishReason.error,
                            error=ErrorInfo(code=ErrorCode.engine_error, message=str(e)), finished_at=self.clock()))
                return AttemptEnd(Outcome.failed, f"engine error after {claim.attempt} attempts: {e}")
            return AttemptEnd(Outcome.retry)
        finally:
            if counted:  # the job left the engine without an engine error: it says nothing about the engine
                self.watch.end_neutral()
        if len(finished) < len(live):
            if held.abort_reason is AbortReason.engine_dead:
                return AttemptEnd(Outcome.crashed)
            if held.abort_reason is AbortReason.lost:
                return AttemptEnd(Outcome.lost)
            if held.abort_reason is not AbortReason.drain:
                # A stream that ended without a final event for every request (an engine bug): never
                # release a job with requests left unanswered; run them again.
                jlog.warning("engine stream ended with requests unanswered; re-queueing",
                             unanswered=len(live) - len(finished))
            return AttemptEnd(Outcome.requeue)
        return AttemptEnd(Outcome.done)

    def _on_event(
        self, ev: EngineEvent, lv: LiveRequest, results: ResultBuilder, held: Held, finished: set[int],
        pos: int, sample: int = 0, samples: SampleSet | None = None,
    ) -> None:
        """One engine event of the request at ``pos`` (its sample ``sample`` when it has n > 1)."""
        now = self.clock()
        if samples is not None:
            self._on_sample_event(ev, lv, results, held, finished, pos, sample, samples, now)
            return
        reason = self._advance(ev, lv, results, held, now, text=True, generated=ev.generate_token_len)
        if reason is None:
            return
        finished.add(pos)
        status, error = final_status(ev, reason)
        logprobs = token_logprobs(ev)
        tensors = None
        if status is ResultStatus.completed:
            self.watch.ok()
            tensors, terr = self._tensors.put(ev, lv.req, results.payload, self.s.blob_url)
            if terr is not None:
                status, error, reason = ResultStatus.failed, terr, FinishReason.error
        result = results.final(
            lv, status=status, reason=reason, error=error, finished_at=now, logprobs=logprobs, tensors=tensors, ev=ev
        )
        if ev.prefill_token_len is not None:
            result.prefill_token_len = ev.prefill_token_len
        held.writes.append(self.writer.final_async(result))
        if status is ResultStatus.completed and lv.req.index in held.reuse_ids:
            held.fresh.append(result)
        self._account(lv, results, status, lv.gen_len, ev.prefill_token_len, now)

    def _advance(self, ev: EngineEvent, lv: LiveRequest, results: ResultBuilder, held: Held, now: float, *,
                 text: bool, generated: int) -> FinishReason | None:
        """What every engine event does first, a plain request's and one of n samples' alike: its text (when
        ``text``) and token counts onto the live request, a partial when one is due; at an end, the two ends
        that are not the request's answer. Returns the finish reason of an end to write (its engine slot is
        free by then), None for an event that is not one: one more token, or an end that is the stop's or
        the engine's. One step, so that both paths stop, re-queue and see a dead engine the same way."""
        if text and ev.text:
            lv.text.append(ev.text)
            lv.dirty = True
        if lv.first_token_at is None and not ev.whole and (ev.generate_token_len > 0 or ev.text):
            # The first partial comes one interval after the first token, not with it: a one-token
            # partial tells a reader little, and writing 1024 of them while the engine fills up (one
            # Lua call each, behind the engine's GIL) delayed the last requests' start (sim, measured).
            lv.first_token_at = lv.last_partial = now
        lv.input_len = ev.input_token_len or lv.input_len
        lv.gen_len = generated
        if ev.finish_reason is None:
            if lv.dirty and now - lv.last_partial >= self.s.partial_interval_s:
                lv.last_partial, lv.dirty = now, False
                self.writer.partial(results.partial(lv))
            return None
        reason: FinishReason = ev.finish_reason
        if reason is FinishReason.abort and held.abort_reason in _STOPPED:
            return None  # not an answer: the job is re-queued and this request runs again
        if reason is FinishReason.error and not engine_alive(self.engine):
            # An engine that died may fail its in-flight requests one by one before it says so (as
            # LMDeploy's RPC errors did): those errors are the engine's, not the requests'.
            raise _EngineGone(ev.error_message or ev.error_code or "request failed as the engine died")
        if self.request_done is not None:
            self.request_done(held, 1)
        return reason

    def _account(self, lv: LiveRequest, results: ResultBuilder, status: ResultStatus, generated: int,
                 prefilled: int | None, now: float) -> None:
        self.plan.request(results.payload, lv.req, generated=generated, completed=status is ResultStatus.completed,
                          prefilled=lv.input_len if prefilled is None else prefilled)
        if self.health:
            self.health.request_finished(
                status=status.value,
                input_tokens=lv.input_len,
                output_tokens=generated,
                ttft_s=(lv.first_token_at - results.started_at) if lv.first_token_at else None,
                latency_s=now - results.started_at,
                prefill_tokens=lv.input_len if prefilled is None else prefilled,
            )

    def _on_sample_event(self, ev: EngineEvent, lv: LiveRequest, results: ResultBuilder, held: Held,
                         finished: set[int], pos: int, sample: int, samples: SampleSet, now: float) -> None:
        """An event of one of the n samples: the request's result is written once, when all n have ended."""
        samples.delta(sample, ev)
        # partials show sample 0's text (what the final ``text`` repeats); admission counts samples, so the
        # slot _advance frees is this sample's; a stopped job runs the whole request (all n samples) again
        reason = self._advance(ev, lv, results, held, now, text=sample == 0, generated=samples.generated)
        if reason is None:
            return
        status, error = final_status(ev, reason)
        if status is ResultStatus.completed:
            self.watch.ok()
        if not samples.end(sample, ev, reason, status, error, token_logprobs(ev)):
            return
        finished.add(pos)
        got = samples.samples()
        status, error = samples.outcome(got)
        first = got[0]
        result = results.final(lv, status=status, reason=first.finish_reason or reason, error=error,
                               finished_at=now, logprobs=first.logprobs, tensors=None)
        result.text = first.text
        result.generate_token_len = sum(s.generate_token_len for s in got)
        result.samples = got
        known = [s.prefill_token_len for s in got]
        result.prefill_token_len = None if None in known else sum(k for k in known if k is not None)
        held.writes.append(self.writer.final_async(result))
        if status is ResultStatus.completed and lv.req.index in held.reuse_ids:
            held.fresh.append(result)
        self._account(lv, results, status, samples.generated, result.prefill_token_len, now)
