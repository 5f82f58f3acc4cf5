"""The small interface every engine implements, so the worker loop is engine-agnostic.

An engine is loaded ONCE per worker process and then serves many concurrent ``stream`` calls,
one per job in flight, from different threads. ``stream`` yields per-request events as they
happen (text deltas, cumulative token counts, a final event carrying ``finish_reason``), which
is what lets the worker store each result the moment it finishes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from lmdq.contract import Endpoint, ErrorCode, FinishReason, GenerationParams

__all__ = [
    "Borrowed",
    "Engine",
    "EngineContractError",
    "EngineDead",
    "EngineError",
    "EngineEvent",
    "EngineRequest",
    "engine_capacity",
    "error_code",
]


class EngineContractError(TypeError):
    """An engine (or its registration) does not implement the contract: a programming error, raised
    at once and loudly (never papered over with a default such as one slot of capacity)."""


class EngineError(RuntimeError):
    """The engine failed as a whole (not one request): the job is retried elsewhere/later."""


class EngineDead(EngineError):
    """The engine is gone for good (its process died, its RPC channel is dead): not a fault of the
    requests it held. The worker stops claiming, re-queues held work without charging its attempts
    and exits non-zero so its supervisor starts a fresh process with a fresh engine."""


@dataclass(frozen=True)
class EngineRequest:
    """One prompt handed to an engine; ``index`` is its position in this ``stream`` call."""

    index: int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    endpoint: Endpoint = Endpoint.chat
    params: GenerationParams = field(default_factory=GenerationParams)
    #: endpoint ``score`` only: the texts to score after the prompt
    continuations: tuple[str, ...] | None = None
    #: the LoRA adapter it runs with (a name the engine was given with ``--adapter``); None: the base model
    adapter: str | None = None

    @property
    def raw(self) -> bool:
        """Raw prompts skip the chat template (OpenAI /v1/completions or ``--raw``; a ``score`` request's
        ``prompt`` is raw text too, its ``messages`` are templated; an ``embedding``'s text is always raw)."""
        return self.endpoint in (Endpoint.completion, Endpoint.embedding) or (
            self.endpoint is Endpoint.score and self.messages is None)


@dataclass
class EngineEvent:
    """Progress of one request. ``text`` is a DELTA; token counts are cumulative.

    The last event of a request has ``finish_reason`` set (:class:`FinishReason`); error events also
    carry ``error_code``/``error_message``: an :class:`ErrorCode` (LMDeploy's names, e.g.
    ``context_length_exceeded``), or a code the engine library reported that lmdq does not know yet,
    kept verbatim.
    """

    index: int
    text: str = ""
    input_token_len: int = 0
    generate_token_len: int = 0
    finish_reason: FinishReason | None = None
    error_code: ErrorCode | str | None = None
    error_message: str | None = None
    #: on the final event only, when asked for: per generated token (token_id, logprob, [(id, lp), ...])
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    #: on the final event only, when asked for: name -> 2-D array-like ([tokens, vocab] / [tokens, hidden]),
    #: e.g. {"logits": ..., "last_hidden_state": ...}; the worker writes them to the blob store
    tensors: dict[str, Any] | None = None
    #: endpoint ``score``, on the final event: per continuation (sum logprob, tokens, is_greedy or None)
    scores: list[tuple[float, int, bool | None]] | None = None
    #: endpoint ``reward``, on the final event: the reward model's score
    reward: float | None = None
    #: endpoint ``embedding``, on the final event: the text's vector (floats each exactly a float32: the result
    #: stores float32, :func:`lmdq.contract.encode_embedding`)
    embedding: list[float] | None = None
    #: the request was not streamed (its whole text comes on the final event): there is no first-token time
    whole: bool = False
    #: on the final event: prompt tokens the engine computed for this request (not reused from a prefix cache
    #: or another request's prefill); None when the engine cannot tell
    prefill_token_len: int | None = None

    def __post_init__(self) -> None:
        # An engine may name the reason by its string ('stop'): it is the enum from here on, and a reason
        # outside the contract fails here, in the engine's thread, naming itself.
        if self.finish_reason is not None and not isinstance(self.finish_reason, FinishReason):
            self.finish_reason = FinishReason(self.finish_reason)


class Engine(Protocol):
    """What the worker needs from an engine (the registry checks an engine class against it:
    :func:`lmdq.worker.engines.registry.check_engine_class`)."""

    #: the registry name it was registered under ('lmdeploy' | 'transformers' | 'sim' | a plug-in's)
    name: str
    #: what results report as ``backend``: 'turbomind' | 'pytorch' | 'transformers' | 'sim'
    backend: str
    #: the model name results report (``--served-model-name``)
    model_name: str
    #: sequences it runs at once (continuous-batching slots): the worker keeps this many requests in it
    capacity: int

    def stream(self, requests: Sequence[EngineRequest], abort: threading.Event) -> Iterator[EngineEvent]:
        """Generate for all ``requests`` at once, yielding events interleaved across them.

        Must be safe to call from several threads at once. When ``abort`` is set, every request
        of this call that has not finished ends promptly with ``finish_reason='abort'`` (requests
        not started yet included). Each request gets exactly one final event.
        """
        ...

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` encodes to (no special tokens); used by tests and benchmarks."""
        ...

    def alive(self) -> bool:
        """False once the engine can no longer serve (dead engine process, closed). Cheap: the
        worker asks before every claim, so a dead engine stops the claiming at once."""
        ...

    def close(self) -> None:
        """Release the engine (``pipe.close()`` for LMDeploy). Idempotent."""
        ...


class Borrowed:
    """Lend an engine to a Worker without letting the Worker's teardown close it
    (benchmarks and tests run several workers on one loaded engine)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.name, self.backend, self.model_name = engine.name, engine.backend, engine.model_name
        self.capacity = engine_capacity(engine)

    def stream(self, requests: Sequence[EngineRequest], abort: threading.Event) -> Iterator[EngineEvent]:
        return self._engine.stream(requests, abort)

    def count_tokens(self, text: str) -> int:
        return self._engine.count_tokens(text)

    def alive(self) -> bool:
        return self._engine.alive()

    def close(self) -> None:
        """Deliberately a no-op: the owner closes the engine."""


def engine_capacity(engine: Engine) -> int:
    """``engine.capacity``, checked: an engine without a positive int ``capacity`` (one that calls it
    ``max_batch``, say) is an :class:`EngineContractError`, not a worker quietly running one slot."""
    capacity = getattr(engine, "capacity", None)
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise EngineContractError(
            f"engine {getattr(engine, 'name', type(engine).__name__)!r} has capacity={capacity!r}: the Engine "
            "contract asks for a positive int (the sequences it runs at once)")
    return capacity


def error_code(code: str | None) -> ErrorCode | str | None:
    """A code an engine library reported, as lmdq's :class:`ErrorCode` when it is one of them; an
    unknown one is kept verbatim (LMDeploy adds codes; a result must still say what it said)."""
    if code is None:
        return None
    try:
        return ErrorCode(code)
    except ValueError:
        return code
