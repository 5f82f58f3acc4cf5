"""A SIMULATED continuous-batching engine, for queue, fault and load tests (no model, no GPU).

It behaves like a real continuous-batching server where it matters for lmdq: one scheduler
thread advances every running sequence by one token per ``step_ms`` "decode step", at most
``max_batch`` sequences run at once and new ones join as others finish, so keeping it busy
across job boundaries is exactly as hard as keeping a GPU busy. Text is deterministic from the
prompt; a request produces exactly ``max_new_tokens`` tokens unless a stop word applies.
A prompt containing ``[[sim:error]]`` ends with an internal error, ``[[sim:engine-error]]``
raises :class:`EngineError` for the whole call (fault tests).
"""

from __future__ import annotations

import hashlib
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from worker.engines.base import EngineError, EngineEvent, EngineRequest

__all__ = ["SimEngine"]

_WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
    "red",
    "green",
    "blue",
    "amber",
    "violet",
]


def _prompt_text(req: EngineRequest) -> str:
    if req.prompt is not None:
        return req.prompt if req.raw else f"user: {req.prompt}\nassistant:"
    parts = [f"{m.get('role')}: {m.get('content')}" for m in req.messages or []]
    return "\n".join(parts) + "\nassistant:"


@dataclass
class _Seq:
    req: EngineRequest
    out: queue.SimpleQueue[EngineEvent | BaseException]
    abort: threading.Event
    input_len: int
    max_new: int
    seed: bytes
    stop_words: list[str]
    words: list[str] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # chars of text already emitted
    n: int = 0
    done: bool = False
    emit_every: int = 16
    extra: dict[str, str] = field(default_factory=dict)


class SimEngine:
    name = "sim"
    backend = "sim"

    def __init__(
        self,
        *,
        model_name: str = "sim",
        step_ms: float = 5.0,
        max_batch: int = 256,
        session_len: int = 32768,
        emit_every: int = 64,
    ) -> None:
        self.model_name = model_name
        self.step_s = step_ms / 1000.0
        self.max_batch = max_batch
        self.session_len = session_len
        self.emit_every = emit_every
        self._pending: deque[_Seq] = deque()
        self._active: list[_Seq] = []
        self._cv = threading.Condition()
        self._closed = False
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="sim-scheduler", daemon=True)
        self._thread.start()

    # -- public ---------------------------------------------------------------------------
    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def stream(self, requests: Sequence[EngineRequest], abort: threading.Event) -> Iterator[EngineEvent]:
        if self._closed:
            raise EngineError("sim engine is closed")
        out: queue.SimpleQueue[EngineEvent | BaseException] = queue.SimpleQueue()
        seqs = []
        for r in requests:
            text = _prompt_text(r)
            if "[[sim:engine-error]]" in text:
                raise EngineError("simulated engine failure")
            p = r.params.resolved()
            seqs.append(
                _Seq(
                    req=r,
                    out=out,
                    abort=abort,
                    input_len=self.count_tokens(text),
                    max_new=int(p["max_new_tokens"]),
                    seed=hashlib.sha256(text.encode()).digest(),
                    stop_words=list(p["stop_words"] or []),
                    emit_every=self.emit_every,
                )
            )
        with self._cv:
            self._pending.extend(seqs)
            self._cv.notify()
        remaining = len(seqs)
        while remaining:
            ev = out.get()
            if isinstance(ev, BaseException):
                raise ev
            if ev.finish_reason is not None:
                remaining -= 1
            yield ev

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    # -- scheduler ------------------------------------------------------------------------
    @staticmethod
    def _words(s: _Seq) -> list[str]:
        """The whole deterministic output, drawn once at admission (cheap per decode step)."""
        return random.Random(s.seed).choices(_WORDS, k=s.max_new)

    def _finish(self, s: _Seq, reason: str, code: str | None = None, msg: str | None = None) -> None:
        s.done = True
        if reason == "abort" and s.words:
            s.text = " ".join(s.words[: s.n])
        s.out.put(
            EngineEvent(
                index=s.req.index,
                text=s.text[s.sent :],
                input_token_len=s.input_len,
                generate_token_len=s.n,
                finish_reason=reason,
                error_code=code,
                error_message=msg,
            )
        )
        s.sent = len(s.text)

    def _admit(self, s: _Seq) -> bool:
        """Requests that end before decoding (context length, injected errors, aborted)."""
        if s.abort.is_set():
            self._finish(s, "abort")
            return False
        if s.input_len >= self.session_len:
            self._finish(
                s,
                "error",
                "context_length_exceeded",
                f"prompt has {s.input_len} tokens, session_len is {self.session_len}",
            )
            return False
        if "[[sim:error]]" in (s.req.prompt or str(s.req.messages)):
            self._finish(s, "error", "internal_error", "simulated per-request failure")
            return False
        s.max_new = min(s.max_new, self.session_len - s.input_len)
        s.words = self._words(s)
        return True

    def _step(self, s: _Seq) -> None:
        if s.abort.is_set():
            self._finish(s, "abort")
            return
        s.n += 1
        if s.stop_words:
            # Only stop words need the text every step; otherwise it is built when emitted.
            s.text = " ".join(s.words[: s.n])
            for w in s.stop_words:
                pos = s.text.find(w)
                if pos >= 0:
                    s.text = s.text[:pos].rstrip()
                    self._finish(s, "stop")
                    return
        if s.n >= s.max_new:
            s.text = " ".join(s.words[: s.n])
            self._finish(s, "length")
        elif s.n == 1 or s.n % s.emit_every == 0:
            s.text = " ".join(s.words[: s.n])
            # Hold back a possible stop-word prefix: emit only text that can no longer change.
            safe = len(s.text) - max((len(w) for w in s.stop_words), default=0)
            if safe > s.sent:
                s.out.put(
                    EngineEvent(
                        index=s.req.index,
                        text=s.text[s.sent : safe],
                        input_token_len=s.input_len,
                        generate_token_len=s.n,
                    )
                )
                s.sent = safe
            elif s.n == 1:
                s.out.put(EngineEvent(index=s.req.index, input_token_len=s.input_len, generate_token_len=s.n))

    def _loop(self) -> None:
        next_tick = time.monotonic()
        while True:
            with self._cv:
                while not self._closed and not self._pending and not self._active:
                    self._cv.wait()
                    next_tick = time.monotonic()
                if self._closed:
                    for s in [*self._active, *self._pending]:
                        s.out.put(EngineError("sim engine closed"))
                    return
                while self._pending and len(self._active) < self.max_batch:
                    s = self._pending.popleft()
                    if self._admit(s):
                        self._active.append(s)
                active = list(self._active)
            # One decode step for every running sequence, then wait out the rest of the step.
            next_tick += self.step_s
            delay = next_tick - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                next_tick = time.monotonic()  # behind: like a busy GPU, don't bank time
            for s in active:
                self._step(s)
            self.steps += 1
            with self._cv:
                self._active = [s for s in self._active if not s.done]
