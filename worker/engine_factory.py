"""Build the ONE engine a worker keeps for its whole life, from settings."""

from __future__ import annotations

from pathlib import Path

from lmdq.worker.engines.base import Engine
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
    it, so it must be the real name, not a placeholder."""
    if s.served_model_name:
        return s.served_model_name
    engine = s.engine_name
    if engine == "sim":
        return s.model or "sim"
    if engine == "transformers" and not s.model:
        from lmdq.worker.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    if not s.model:
        raise ValueError("--engine lmdeploy needs --model (a model folder or hub id)")
    return Path(s.model.rstrip("/")).name if engine == "lmdeploy" else Path(s.model).name


def build_engine(s: WorkerSettings) -> Engine:
    """The engine ``s.engine_name`` names, from its own config (``s.lmdeploy`` / ``.transformers`` / ``.sim``).

    No ``--model`` means the embedded default: SmolLM2-135M-Instruct on the transformers engine."""
    engine = s.engine_name
    if engine == "sim":
        from lmdq.worker.engines.sim import SimEngine

        return SimEngine(s.sim, model_name=s.served_model_name or s.model or "sim")
    if engine == "transformers":
        from lmdq.worker.default_model import DEFAULT_MODEL_NAME, ensure_default_model
        from lmdq.worker.engines.transformers_engine import TransformersEngine

        path = Path(s.model) if s.model else ensure_default_model()
        name = s.served_model_name or (Path(s.model).name if s.model else DEFAULT_MODEL_NAME)
        return TransformersEngine(s.transformers, model_path=path, served_model_name=name)
    from lmdq.worker.engines.lmdeploy_engine import LMDeployEngine

    if s.model is None:
        raise ValueError("--engine lmdeploy needs --model (a model folder or hub id)")
    return LMDeployEngine(s.lmdeploy, model_path=s.model, served_model_name=s.served_model_name)


def engine_capacity(engine: Engine) -> int:
    """How many sequences the engine runs at once (continuous batching slots)."""
    return int(getattr(engine, "capacity", None) or getattr(engine, "max_batch", None) or 1)
