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

from lmdq.contract import Endpoint, GenerationParams

__all__ = ["Borrowed", "Engine", "EngineDead", "EngineEvent", "EngineRequest", "EngineError"]


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

    @property
    def raw(self) -> bool:
        """Raw prompts skip the chat template (OpenAI /v1/completions or ``--raw``)."""
        return self.endpoint is Endpoint.completion


@dataclass
class EngineEvent:
    """Progress of one request. ``text`` is a DELTA; token counts are cumulative.

    The last event of a request has ``finish_reason`` set ('stop' | 'length' | 'error' | 'abort');
    error events also carry ``error_code``/``error_message`` (LMDeploy's names, e.g.
    'context_length_exceeded').
    """

    index: int
    text: str = ""
    input_token_len: int = 0
    generate_token_len: int = 0
    finish_reason: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    #: on the final event only, when asked for: per generated token (token_id, logprob, [(id, lp), ...])
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    #: on the final event only, when asked for: name -> 2-D array-like ([tokens, vocab] / [tokens, hidden]),
    #: e.g. {"logits": ..., "last_hidden_state": ...}; the worker writes them to the blob store
    tensors: dict[str, Any] | None = None
    #: the request was not streamed (its whole text comes on the final event): there is no first-token time
    whole: bool = False


class Engine(Protocol):
    """What the worker needs from an engine."""

    #: 'lmdeploy' | 'transformers' | 'sim'
    name: str
    #: what results report as ``backend``: 'turbomind' | 'pytorch' | 'transformers' | 'sim'
    backend: str
    #: the model name results report (``--served-model-name``)
    model_name: str

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
        self.capacity = getattr(engine, "capacity", None) or getattr(engine, "max_batch", None) or 1

    def stream(self, requests: Sequence[EngineRequest], abort: threading.Event) -> Iterator[EngineEvent]:
        return self._engine.stream(requests, abort)

    def count_tokens(self, text: str) -> int:
        return self._engine.count_tokens(text)

    def alive(self) -> bool:
        return self._engine.alive()

    def close(self) -> None:
        """Deliberately a no-op: the owner closes the engine."""
