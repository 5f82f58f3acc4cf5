"""A SIMULATED continuous-batching engine, for queue, fault and load tests (no model, no GPU).

It behaves like a real continuous-batching server where it matters for lmdq: one scheduler
thread advances every running sequence by one token per ``step_ms`` "decode step", at most
``max_batch`` sequences run at once and new ones join as others finish, so keeping it busy
across job boundaries is exactly as hard as keeping a GPU busy. Text is deterministic from the
prompt; a request produces exactly ``max_new_tokens`` tokens unless a stop word applies.
A prompt containing ``[[sim:error]]`` ends with an internal error, ``[[sim:engine-error]]``
raises :class:`EngineError` for the whole call (fault tests). A prompt containing ``[[sim:poison]]``
(:attr:`SimEngine.poison_marker`) KILLS the engine when it is admitted, as a prompt that crashes a
real engine's process would: every in-flight stream raises :class:`EngineDead`, ``alive()`` turns
False and every later ``stream`` call raises too. :meth:`SimEngine.kill` does the same from outside.

Rich outputs are SIMULATED too, with the real engines' shapes (see docs/outputs.md): ``logprobs=k``
gives per generated token a deterministic fake chosen id in ``[0, sim_vocab)`` with a fake logprob
(<= 0) and k descending alternatives (the chosen one first); ``output_logits`` gives a float32 array
``[generated, sim_vocab]`` ('generation') or ``[input + generated - 1, sim_vocab]`` ('all');
``output_last_hidden_state`` the same rows with ``sim_hidden`` columns; values are seeded noise.
``response_format`` json_schema / json_object makes the whole output a minimal instance of the
schema (:func:`minimal_instance`: every listed property, each with a small legal value), emitted as
one "token" and finishing with 'stop'; regex is NOT simulated (the output stays the usual words).
Endpoint ``embedding`` answers at once with a deterministic unit vector of ``sim_hidden`` float32s drawn
from the text (:func:`sim_embedding`: the same text gives the same vector on every worker), for load tests.

Prefix caching is SIMULATED as LMDeploy's block-granular cache (``--sim-prefix-cache-tokens``): a
prompt's words are cut into blocks of ``--sim-prefix-block`` tokens, each keyed by a hash chained
over the blocks before it, held in an LRU of ``prefix_cache_tokens // prefix_block`` blocks. At
admission the leading blocks found in the LRU are cached; the rest of the prompt is prefilled and
its blocks enter the LRU. ``prefilled_tokens`` / ``cached_tokens`` count the tokens each way
(deterministic for a given admission order: tests assert on them, never on time), and
``--sim-prefill-us-per-token`` stalls the decode loop for the prefilled tokens, as a real prefill
does. The counters are logged when the engine closes ("sim engine closed").

Step counters, for tests that must not depend on wall-clock timing: :attr:`SimEngine.steps` counts
decode steps and :attr:`SimEngine.occupancy` keeps, per recent step, how many sequences ran in it,
so a test can check that slots freed in one step were refilled for the next one.
"""

from __future__ import annotations

import hashlib
import json
import math
import queue
import random
import threading
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from lmdq.contract import Endpoint, ErrorCode, FinishReason
from lmdq.worker.engine_config import SimConfig
from lmdq.worker.engines.base import EngineDead, EngineError, EngineEvent, EngineRequest
from lmdq.worker.engines.registry import BenchEntry, EngineSpec, EngineTarget

__all__ = ["SIM_CONTEXT_LEN", "SPEC", "SimEngine", "minimal_instance", "sim_embedding"]

#: Steps whose occupancy :attr:`SimEngine.occupancy` keeps (a long-running sim worker must not grow).
OCCUPANCY_STEPS = 100_000

#: The simulated model's own context length: its session_len when the config leaves it unset (as a real
#: engine falls back to its model's max_position_embeddings).
SIM_CONTEXT_LEN = 32768

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


SIM_IMAGE_TOKENS = 64
"""Simulated tokens per image part (issue 48): an image is a prompt block of this many tokens named by a
hash of its bytes, so the same image twice hits the simulated prefix cache as a VLM's vision tokens would."""


def _image_words(url: str) -> str:
    h = hashlib.blake2b(url.encode(), digest_size=4).hexdigest()
    return " ".join(f"img{h}.{k}" for k in range(SIM_IMAGE_TOKENS))


def _content_text(content: Any) -> str:
    """A message's content as the sim's prompt text: each image part as its block of image tokens."""
    if not isinstance(content, list):
        return str(content)
    return " ".join(_image_words(p["image_url"]["url"]) if p.get("type") == "image_url" else str(p.get("text", ""))
                    for p in content if isinstance(p, dict))


def _prompt_text(req: EngineRequest) -> str:
    if req.prompt is not None:
        return req.prompt if req.raw else f"user: {req.prompt}\nassistant:"
    parts = [f"{m.get('role')}: {_content_text(m.get('content'))}" for m in req.messages or []]
    return "\n".join(parts) + "\nassistant:"


@dataclass
class _Seq:
    req: EngineRequest
    out: queue.SimpleQueue[EngineEvent | BaseException]
    abort: threading.Event
    input_len: int
    words_in: list[str]  # the prompt's simulated tokens (prefix cache blocks)
    max_new: int
    seed: bytes
    stop_words: list[str]
    emit_every: int  # the engine's (SimConfig.emit_every)
    words: list[str] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # chars of text already emitted
    n: int = 0
    done: bool = False
    extra: dict[str, str] = field(default_factory=dict)
    guided: str | None = None  # the minimal JSON instance the output must be
    logprobs: int | None = None
    output_logits: str | None = None
    output_hidden: str | None = None


class SimEngine:
    name = "sim"
    backend = "sim"
    model_name: str
    capacity: int
    #: a request whose prompt contains this kills the engine when admitted (fault tests)
    poison_marker = "[[sim:poison]]"
    #: result reuse (issue 47): the sim's output is a function of the prompt and params, so a seeded
    #: sampled request gives the same answer every run
    repeats_seeds = True

    def __init__(self, config: SimConfig | None = None, /, *, model_name: str = "sim", **overrides: Any) -> None:
        """``config`` (default: :class:`SimConfig`'s defaults) with ``overrides`` over it, by field or flag
        name (``step_ms=1`` or ``sim_step_ms=1``): the settings are declared once, in SimConfig."""
        cfg = SimConfig.from_values(config, **overrides)
        self.config = cfg
        self.model_name = model_name
        self.step_s = cfg.step_ms / 1000.0
        # Python work per step that holds the GIL (LMDeploy's PyTorch engine schedules, samples and
        # detokenizes in Python in the worker's process): lets the sim show GIL contention.
        self.step_cpu_s = cfg.step_cpu_ms / 1000.0
        self.max_batch = cfg.max_batch
        self.capacity = cfg.max_batch  # the Engine contract's name for it
        self.session_len = cfg.session_len if cfg.session_len is not None else SIM_CONTEXT_LEN
        self.emit_every = cfg.emit_every
        self.sim_vocab = cfg.vocab
        self.sim_hidden = cfg.hidden
        self._pending: deque[_Seq] = deque()
        self._active: list[_Seq] = []
        self._cv = threading.Condition()
        self._closed = False
        self._dead: str | None = None  # why the simulated engine died, once it has
        self.steps = 0
        self.prefix_block = cfg.prefix_block
        self._cache_blocks = cfg.prefix_cache_tokens // cfg.prefix_block
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.prefill_s_per_token = cfg.prefill_us_per_token / 1e6
        #: prompt tokens prefilled (not found in the prefix cache) and found cached, since start
        self.prefilled_tokens = 0
        self.cached_tokens = 0
        self._prefill_backlog = 0  # tokens prefilled since the last decode step (their time is owed)
        #: sequences that ran in each of the last OCCUPANCY_STEPS decode steps (oldest first)
        self.occupancy: deque[int] = deque(maxlen=OCCUPANCY_STEPS)
        #: the step in which the most recently admitted sequence ran first (-1: none yet)
        self.last_admit_step = -1
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
        scored: list[EngineEvent] = []
        for r in requests:
            text = _prompt_text(r)
            if "[[sim:engine-error]]" in text:
                raise EngineError("simulated engine failure")
            if not r.endpoint.generates:
                scored.append(_sim_score(r, text, self.count_tokens, self.sim_hidden))
                continue
            p = r.params.resolved()
            guided = _guided_text(p["response_format"])
            seqs.append(
                _Seq(
                    req=r,
                    out=out,
                    abort=abort,
                    input_len=self.count_tokens(text),
                    words_in=text.split(),
                    max_new=int(p["max_new_tokens"]),
                    seed=hashlib.sha256(text.encode()).digest(),
                    stop_words=list(p["stop_words"] or []),
                    emit_every=self.emit_every,
                    guided=guided,
                    logprobs=p["logprobs"],
                    output_logits=p["output_logits"],
                    output_hidden=p["output_last_hidden_state"],
                )
            )
        if self._dead is not None:
            raise EngineDead(self._dead)
        for ev in scored:  # scores need no decode step: they answer at once, in request order
            yield EngineEvent(index=ev.index, finish_reason=FinishReason.abort) if abort.is_set() else ev
        if not seqs:
            return
        with self._cv:
            if self._dead is not None:
                raise EngineDead(self._dead)
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

    def alive(self) -> bool:
        """Alive until closed or killed."""
        return not self._closed and self._dead is None

    def kill(self, why: str = "simulated engine death (killed from outside)") -> None:
        """Fault-test hook: the engine dies now, as if its process had been SIGKILLed."""
        with self._cv:
            if self._dead is None:
                self._dead = why
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            first = not self._closed
            self._closed = True
            self._cv.notify()
        if first:
            structlog.get_logger("lmdq.sim").info("sim engine closed", **self.stats())

    def stats(self) -> dict[str, int]:
        """Prefix-cache counters (prompt tokens prefilled / found cached) and decode steps so far."""
        return {"prefilled_tokens": self.prefilled_tokens, "cached_tokens": self.cached_tokens, "steps": self.steps}

    def _prefill(self, s: _Seq) -> None:
        """Look ``s``'s prompt up in the simulated prefix cache and count what must be prefilled."""
        words, blk = s.words_in, self.prefix_block
        hit = 0
        if self._cache_blocks:
            lru = self._lru
            key = 0
            missed = False
            for b in range(len(words) // blk):
                key = hash((key, *words[b * blk : (b + 1) * blk]))
                if not missed and key in lru:
                    hit += 1
                else:
                    missed = True
                lru[key] = None
                lru.move_to_end(key)
            while len(lru) > self._cache_blocks:
                lru.popitem(last=False)
        cached = min(hit * blk, len(words))
        self.cached_tokens += cached
        self.prefilled_tokens += len(words) - cached
        self._prefill_backlog += len(words) - cached

    # -- scheduler ------------------------------------------------------------------------
    @staticmethod
    def _words(s: _Seq) -> list[str]:
        """The whole deterministic output, drawn once at admission (cheap per decode step)."""
        return random.Random(s.seed).choices(_WORDS, k=s.max_new)

    def _rich(self, s: _Seq) -> tuple[list[tuple[int, float, list[tuple[int, float]]]] | None, dict[str, Any] | None]:
        """Simulated logprobs and tensors for the final event (deterministic from the prompt)."""
        logprobs = None
        if s.logprobs is not None:
            rng = random.Random(s.seed + b"logprobs")
            logprobs = []
            for _ in range(s.n):
                chosen = rng.randrange(self.sim_vocab)
                lp = -round(rng.random() * 2.0, 6)
                top = [(chosen, lp)]
                while len(top) < min(s.logprobs, self.sim_vocab):
                    cand = rng.randrange(self.sim_vocab)
                    if all(cand != t for t, _ in top):
                        top.append((cand, top[-1][1] - round(0.1 + rng.random(), 6)))
                logprobs.append((chosen, lp, top if s.logprobs > 0 else []))
        tensors: dict[str, Any] = {}
        for key, mode, width in (("logits", s.output_logits, self.sim_vocab),
                                 ("last_hidden_state", s.output_hidden, self.sim_hidden)):
            if mode is None:
                continue
            import numpy as np

            rows = s.n if mode == "generation" else max(0, s.input_len + s.n - 1)
            rng_np = np.random.default_rng(int.from_bytes(s.seed[:8], "little") + len(key))
            tensors[key] = rng_np.standard_normal((rows, width), dtype=np.float32)
        return logprobs, tensors or None

    def _finish(self, s: _Seq, reason: FinishReason, code: ErrorCode | None = None, msg: str | None = None) -> None:
        s.done = True
        if reason is FinishReason.abort and s.words:
            s.text = " ".join(s.words[: s.n])
        logprobs, tensors = self._rich(s) if reason is not FinishReason.error else (None, None)
        s.out.put(
            EngineEvent(
                index=s.req.index,
                text=s.text[s.sent :],
                input_token_len=s.input_len,
                generate_token_len=s.n,
                finish_reason=reason,
                error_code=code,
                error_message=msg,
                logprobs=logprobs,
                tensors=tensors,
            )
        )
        s.sent = len(s.text)

    def _admit(self, s: _Seq) -> bool:
        """Requests that end before decoding (context length, injected errors, aborted)."""
        if s.abort.is_set():
            self._finish(s, FinishReason.abort)
            return False
        if s.input_len >= self.session_len:
            self._finish(
                s,
                FinishReason.error,
                ErrorCode.context_length_exceeded,
                f"prompt has {s.input_len} tokens, session_len is {self.session_len}",
            )
            return False
        if self.poison_marker in (s.req.prompt or str(s.req.messages)):
            self._dead = f"simulated engine death: poison prompt (request {s.req.index} of its call)"
            return False
        if "[[sim:error]]" in (s.req.prompt or str(s.req.messages)):
            self._finish(s, FinishReason.error, ErrorCode.internal_error, "simulated per-request failure")
            return False
        s.max_new = min(s.max_new, self.session_len - s.input_len)
        self._prefill(s)
        if s.guided is not None:
            s.max_new = 1  # the whole JSON instance is one simulated "token"
            s.words = [s.guided]
            return True
        s.words = self._words(s)
        return True

    def _step(self, s: _Seq) -> None:
        if s.abort.is_set():
            self._finish(s, FinishReason.abort)
            return
        s.n += 1
        if s.stop_words:
            # Only stop words need the text every step; otherwise it is built when emitted.
            s.text = " ".join(s.words[: s.n])
            for w in s.stop_words:
                pos = s.text.find(w)
                if pos >= 0:
                    s.text = s.text[:pos].rstrip()
                    self._finish(s, FinishReason.stop)
                    return
        if s.n >= s.max_new:
            s.text = " ".join(s.words[: s.n])
            self._finish(s, FinishReason.stop if s.guided is not None else FinishReason.length)
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
                while not self._closed and self._dead is None and not self._pending and not self._active:
                    self._cv.wait()
                    next_tick = time.monotonic()
                if self._closed or self._dead is not None:
                    err = EngineDead(self._dead) if self._dead is not None else EngineError("sim engine closed")
                    for s in [*self._active, *self._pending]:
                        s.out.put(err)
                    self._active, self._pending = [], deque()
                    return
                while self._pending and len(self._active) < self.max_batch:
                    s = self._pending.popleft()
                    if self._admit(s):
                        self._active.append(s)
                        self.last_admit_step = self.steps
                    elif self._dead is not None:  # a poison prompt: it and everything in flight fail
                        s.out.put(EngineDead(self._dead))
                        break
                if self._dead is not None:
                    continue
                active = list(self._active)
                prefill, self._prefill_backlog = self._prefill_backlog, 0
            # One decode step for every running sequence, then wait out the rest of the step (and the
            # prefill of the prompts just admitted: it holds up the whole batch, as on a GPU).
            next_tick += self.step_s + prefill * self.prefill_s_per_token
            delay = next_tick - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                next_tick = time.monotonic()  # behind: like a busy GPU, don't bank time
            if self.step_cpu_s:
                end = time.thread_time() + self.step_cpu_s
                while time.thread_time() < end:
                    pass
            for s in active:
                self._step(s)
            self.occupancy.append(len(active))
            self.steps += 1
            with self._cv:
                self._active = [s for s in self._active if not s.done]


def _unit(*parts: str) -> float:
    """A deterministic number in [0, 1) from text (the sim's stand-in for a model's opinion)."""
    digest = hashlib.sha256("\x1f".join(parts).encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


_HASH: Any = hashlib.sha256
"""The sim's hash (a test counts the bytes it is fed)."""


def _prefix_units(text: str, words: list[str]) -> list[float]:
    """``[_unit(text, *words[:k + 1]) for k in range(len(words))]`` in linear time: one running hash of
    text and the words so far, copied for each word's digest, instead of re-hashing every prefix (a
    100,000-character continuation took 15 s)."""
    h = _HASH(text.encode("utf-8", "surrogatepass"))
    out = []
    for w in words:
        h.update(("\x1f" + w).encode("utf-8", "surrogatepass"))
        out.append(int.from_bytes(h.copy().digest()[:8], "big") / 2**64)
    return out


def sim_embedding(text: str, dim: int) -> list[float]:
    """A deterministic unit vector of ``dim`` float32 values drawn from ``text`` (SHAKE-256 as the noise):
    the sim's stand-in for an embedding model, equal for equal texts, apart for different ones."""
    raw = hashlib.shake_256(text.encode("utf-8", "surrogatepass")).digest(4 * dim)
    xs = [int.from_bytes(raw[4 * i : 4 * i + 4], "little") / 2**31 - 1.0 for i in range(dim)]
    norm = math.sqrt(sum(x * x for x in xs)) or 1.0
    return array("f", [x / norm for x in xs]).tolist()  # each exactly a float32, as a model's output is


def _sim_score(r: EngineRequest, text: str, count: Any, hidden: int) -> EngineEvent:
    """SIMULATED scores, deterministic from the text: each continuation word (a sim token) costs a logprob
    in (-8, 0] drawn from (prompt, words so far); a continuation is "greedy" when every word costs less
    than 1 nat. A reward is in [-5, 5) from the whole chat. ``[[sim:error]]`` fails the request as usual."""
    if "[[sim:error]]" in text:
        return EngineEvent(index=r.index, finish_reason=FinishReason.error, error_code=ErrorCode.internal_error,
                           error_message="simulated request failure")
    if r.endpoint is Endpoint.reward:
        return EngineEvent(index=r.index, input_token_len=count(text), finish_reason=FinishReason.stop,
                           reward=round(10 * _unit("reward", text) - 5, 6), whole=True)
    if r.endpoint is Endpoint.embedding:
        return EngineEvent(index=r.index, input_token_len=count(text), finish_reason=FinishReason.stop,
                           embedding=sim_embedding(text, hidden), whole=True)
    scores: list[tuple[float, int, bool | None]] = []
    for cont in r.continuations or ():
        words = cont.split() or [cont]
        costs = [8 * u for u in _prefix_units(text, words)]
        scores.append((-round(sum(costs), 6), len(words), all(c < 1.0 for c in costs)))
    return EngineEvent(index=r.index, input_token_len=count(text), finish_reason=FinishReason.stop, scores=scores,
                       whole=True)


def _guided_text(response_format: Any) -> str | None:
    """The simulated output of a json_schema/json_object request (None: not simulated)."""
    if response_format is None:
        return None
    from lmdq.contract import ResponseFormat
    from lmdq.guided import schema_of

    rf = ResponseFormat.model_validate(response_format)
    if rf.type == "regex":
        return None
    schema = schema_of(rf)
    if not isinstance(schema, dict):  # a boolean schema: `true` accepts anything
        return "{}"
    return json.dumps(minimal_instance(schema))


def minimal_instance(schema: dict[str, Any]) -> Any:
    """A small value valid against common JSON schemas: const/enum first, else the first anyOf/oneOf
    branch, else by type — every listed property of an object, strings of ``minLength`` 'a's, numbers at
    their minimum (or 0), ``minItems`` array items. $ref, patterns and formats are not interpreted."""
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return minimal_instance(schema[key][0])
    if schema.get("allOf"):
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            merged.update(part)
        return minimal_instance(merged)
    typ = schema.get("type", "object" if "properties" in schema else None)
    if isinstance(typ, list):
        typ = next((t for t in typ if t != "null"), "null")
    if typ == "object":
        props = schema.get("properties") or {}
        return {name: minimal_instance(sub if isinstance(sub, dict) else {}) for name, sub in props.items()}
    if typ == "array":
        items = schema.get("items")
        item = items if isinstance(items, dict) else {}
        return [minimal_instance(item) for _ in range(int(schema.get("minItems", 0)))]
    if typ == "string":
        return "a" * int(schema.get("minLength", 0))
    if typ in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        if low is None:
            return 0
        value = low + 1 if "minimum" not in schema else low
        return int(math.ceil(value)) if typ == "integer" else value
    if typ == "boolean":
        return False
    if typ == "null":
        return None
    return {}


def _build(config: SimConfig, target: EngineTarget) -> SimEngine:
    return SimEngine(config, model_name=target.served_model_name)


def _bench_label(config: SimConfig, engine: object, label: str) -> str:
    knobs = f"step={config.step_ms}ms,max_batch={config.max_batch}"
    if config.emit_every != SimConfig().emit_every or config.step_cpu_ms:
        knobs += f",emit_every={config.emit_every},step_cpu={config.step_cpu_ms}ms"
    return f"sim({knobs})"


SPEC = EngineSpec(
    name="sim", settings=SimConfig, factory=_build, engine=SimEngine,
    served_name=lambda model: model or "sim",
    bench=BenchEntry(label=_bench_label, needs_model=False),
    summary="simulated continuous batching, no model (queue, fault and load tests)",
)
