"""Build the ONE engine a worker keeps for its whole life, from settings."""

from __future__ import annotations

from pathlib import Path

from lmdq.worker.engines.base import Engine
from lmdq.worker.settings import WorkerSettings

__all__ = ["build_engine", "engine_capacity"]


def build_engine(s: WorkerSettings) -> Engine:
    """No ``--model`` means the embedded default: SmolLM2-135M-Instruct on the transformers engine."""
    engine = s.engine or ("transformers" if s.model is None else "lmdeploy")
    if engine == "sim":
        from lmdq.worker.engines.sim import SimEngine

        return SimEngine(
            model_name=s.served_model_name or s.model or "sim",
            step_ms=s.sim_step_ms,
            max_batch=s.sim_max_batch,
            session_len=s.session_len or 32768,
        )
    if engine == "transformers":
        from lmdq.worker.default_model import DEFAULT_MODEL_NAME, ensure_default_model
        from lmdq.worker.engines.transformers_engine import TransformersEngine

        path = Path(s.model) if s.model else ensure_default_model()
        name = s.served_model_name or (Path(s.model).name if s.model else DEFAULT_MODEL_NAME)
        return TransformersEngine(
            model_path=path,
            served_model_name=name,
            device=s.device,
            dtype=s.dtype,
            chat_template=s.chat_template,
            session_len=s.session_len,
        )
    from lmdq.worker.engines.lmdeploy_engine import LMDeployEngine

    if s.model is None:
        raise ValueError("--engine lmdeploy needs --model (a model folder or hub id)")
    return LMDeployEngine(
        model_path=s.model,
        served_model_name=s.served_model_name,
        backend=s.backend,
        tp=s.tp,
        dtype=s.dtype,
        session_len=s.session_len,
        max_batch_size=s.max_batch_size,
        cache_max_entry_count=s.cache_max_entry_count,
        quant_policy=s.quant_policy,
        chat_template=s.chat_template,
        eager_mode=s.eager_mode,
        mp_engine=s.mp_engine,
        raw=s.raw,
    )


def engine_capacity(engine: Engine) -> int:
    """How many sequences the engine runs at once (continuous batching slots)."""
    return int(getattr(engine, "capacity", None) or getattr(engine, "max_batch", None) or 1)
