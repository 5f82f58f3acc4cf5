"""A test-only engine, written by following docs/architecture.md "Adding an engine" step by step.

It echoes each prompt back (the last user message for a chat request), word by word, optionally in
capitals and cut to ``--echo-max-words``: enough to show an engine that lmdq knows only through the
registry serving a real batch. It is registered from the test (an entry point in a dist-info the test
writes, as ``pip install`` writes one from ``[project.entry-points."lmdq.engines"]``), never by any lmdq
file.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import ClassVar

from pydantic import Field

from lmdq.contract import ErrorCode, FinishReason
from lmdq.worker.engine_config import EngineConfig
from lmdq.worker.engines.base import EngineError, EngineEvent, EngineRequest
from lmdq.worker.engines.registry import BenchEntry, EngineSpec, EngineTarget


# Step 1: the settings class, one field per setting; the prefix keeps its flags its own.
class EchoConfig(EngineConfig):
    """The echo engine's settings: --echo-slots, --echo-upper, --echo-max-words (LMDQ_ECHO_*)."""

    flag_prefix: ClassVar[str] = "echo_"

    slots: int = Field(default=4, ge=1, le=1024, description="requests echoed at once (the engine's capacity)")
    upper: bool = Field(default=False, description="echo in capitals")
    max_words: int = Field(default=64, ge=1, description="words echoed at most; more ends with finish_reason length")


# Step 2: the engine class, every field of the Engine contract declared on the class.
class EchoEngine:
    """Echoes prompts: one event per word, then the final event with its FinishReason."""

    name = "echo"
    backend = "echo"
    model_name: str
    capacity: int

    def __init__(self, config: EchoConfig, *, model_name: str) -> None:
        self.config = config
        self.model_name = model_name
        self.capacity = config.slots
        self._closed = False

    def _text(self, r: EngineRequest) -> str:
        if r.prompt is not None:
            return r.prompt
        users = [m.get("content") for m in (r.messages or []) if m.get("role") == "user"]
        return str(users[-1]) if users else ""

    def stream(self, requests: Sequence[EngineRequest], abort: threading.Event) -> Iterator[EngineEvent]:
        if self._closed:
            raise EngineError("engine is closed")
        for r in requests:
            if abort.is_set():
                yield EngineEvent(index=r.index, finish_reason=FinishReason.abort)
                continue
            text = self._text(r)
            if not text.strip():
                yield EngineEvent(index=r.index, finish_reason=FinishReason.error, error_code=ErrorCode.bad_request,
                                  error_message="nothing to echo: the prompt is empty")
                continue
            words = (text.upper() if self.config.upper else text).split()
            limit = min(self.config.max_words, r.params.resolved().get("max_new_tokens") or self.config.max_words)
            out = words[:limit]
            for n, word in enumerate(out, 1):
                yield EngineEvent(index=r.index, text=(" " if n > 1 else "") + word,
                                  input_token_len=len(words), generate_token_len=n)
            reason = FinishReason.length if len(words) > limit else FinishReason.stop
            yield EngineEvent(index=r.index, input_token_len=len(words), generate_token_len=len(out),
                              finish_reason=reason)

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def alive(self) -> bool:
        return not self._closed

    def close(self) -> None:
        self._closed = True


# Step 3: the spec the registry reads everything from.
def _build(config: EchoConfig, target: EngineTarget) -> EchoEngine:
    return EchoEngine(config, model_name=target.served_model_name)


SPEC = EngineSpec(
    name="echo",
    settings=EchoConfig,
    factory=_build,
    engine=EchoEngine,
    served_name=lambda model: model or "echo",
    bench=BenchEntry(label=lambda config, engine, label: f"echo(slots={config.slots})", needs_model=False),
    summary="echoes each prompt back (a test-only sample engine)",
)
