"""Build the ONE engine a worker keeps for its whole life, from settings, through the engine registry."""

from __future__ import annotations

from lmdq.worker.engines.base import Engine, engine_capacity
from lmdq.worker.engines.registry import EngineTarget, engine_spec
from lmdq.worker.settings import WorkerSettings

__all__ = ["build_engine", "cpu_speed_note", "engine_capacity", "served_model_name"]


def cpu_speed_note(engine: Engine) -> str | None:
    """What a first user on the CPU engine should know before waiting a minute for one answer: it
    decodes token by token on the CPU (SmolLM2-135M: 512 tokens took 52 s on a laptop), and a
    request without ``max_new_tokens`` may generate up to 512 (None: not a CPU engine)."""
    device = getattr(engine, "device", None)
    if engine.name != "transformers" or getattr(device, "type", None) != "cpu":
        return None
    return ("CPU engine: answers are generated token by token on the CPU (about 10 tokens/s per request for the "
            "135M demo model on a laptop), and a request without max_new_tokens may generate up to 512 tokens, "
            "about a minute; submit with --max-new-tokens 64 (or params.max_new_tokens) for a quick try")


def served_model_name(s: WorkerSettings) -> str:
    """The name the engine :func:`build_engine` builds will serve (its queue, results' ``model``),
    known before it loads: the health endpoint answers during the load and labels its metrics with
    it, so it must be the real name, not a placeholder. ``--served-model-name``, else the engine's
    registered ``served_name(--model)``."""
    if s.served_model_name:
        return s.served_model_name
    try:
        return engine_spec(s.engine_name).served_name(s.model)
    except ValueError as e:
        raise ValueError(f"--engine {s.engine_name} {e}") from None


def build_engine(s: WorkerSettings) -> Engine:
    """The engine ``s.engine_name`` names, by its registered factory, from its own config
    (``s.engine_config``); its capacity is checked here, before any job is claimed."""
    spec = engine_spec(s.engine_name)
    engine = spec.factory(s.engine_config, EngineTarget(model=s.model, served_model_name=served_model_name(s),
                                                        adapters=s.adapters))
    engine_capacity(engine)  # a contract breach is a start-up error, not a worker with one slot
    return engine
