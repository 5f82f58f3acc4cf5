"""``lmdq-worker``: load one engine, drain its model's queues."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from lmdq.worker.settings import WorkerSettings

from lmdq.connection import connect, redact_url
from lmdq.errors import run_cli
from lmdq.logs import configure_logging, get_logger

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command()
def run(
    model: Annotated[str | None, typer.Option(help="model folder or hub id (default: embedded SmolLM2 on CPU)")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="name producers submit to (queue)")] = None,
    engine: Annotated[str | None, typer.Option(help="lmdeploy | transformers | sim")] = None,
    backend: Annotated[str | None, typer.Option(help="auto | turbomind | pytorch (lmdeploy)")] = None,
    tp: Annotated[int | None, typer.Option(help="tensor parallel GPUs")] = None,
    dtype: Annotated[str | None, typer.Option(help="auto | float16 | bfloat16 | float32")] = None,
    session_len: Annotated[int | None, typer.Option()] = None,
    max_batch_size: Annotated[int | None, typer.Option()] = None,
    cache_max_entry_count: Annotated[float | None, typer.Option()] = None,
    quant_policy: Annotated[int | None, typer.Option(help="0 | 4 | 8 (KV cache quantization)")] = None,
    chat_template: Annotated[str | None, typer.Option(help="LMDeploy template name, or a Jinja file")] = None,
    eager_mode: Annotated[bool | None, typer.Option("--eager-mode/--no-eager-mode")] = None,
    mp_engine: Annotated[
        bool | None, typer.Option("--mp-engine/--no-mp-engine", help="pytorch: engine loop in its own process")
    ] = None,
    raw: Annotated[bool | None, typer.Option("--raw/--no-raw", help="never apply the chat template")] = None,
    device: Annotated[str | None, typer.Option(help="transformers engine: auto | cpu | cuda")] = None,
    sim_step_ms: Annotated[float | None, typer.Option(help="sim engine: ms per decode step")] = None,
    sim_max_batch: Annotated[int | None, typer.Option(help="sim engine: concurrent sequences")] = None,
    burst: Annotated[bool | None, typer.Option("--burst/--no-burst", help="exit when the queues are empty")] = None,
    jobs_in_flight: Annotated[int | None, typer.Option(help="max jobs held at once (0 = auto)")] = None,
    prefetch_requests: Annotated[
        int | None, typer.Option(help="requests held beyond engine capacity (0 = max(job size, capacity/2))")
    ] = None,
    drain_timeout: Annotated[float | None, typer.Option(help="seconds to finish work after SIGTERM")] = None,
    heartbeat_ttl: Annotated[float | None, typer.Option(help="lease TTL: a dead worker's jobs rerun after it")] = None,
    max_attempts: Annotated[int | None, typer.Option()] = None,
    health_port: Annotated[int | None, typer.Option(help="HTTP /healthz /readyz /metrics (0 = off)")] = None,
    worker_name: Annotated[str | None, typer.Option()] = None,
    redis_url: Annotated[str | None, typer.Option(help="env LMDQ_REDIS_URL, then REDIS_URL")] = None,
) -> None:
    """Run a worker until stopped (or, with --burst, until its queues are empty)."""
    flags: dict[str, Any] = {
        "model": model,
        "served_model_name": served_model_name,
        "engine": engine,
        "backend": backend,
        "tp": tp,
        "dtype": dtype,
        "session_len": session_len,
        "max_batch_size": max_batch_size,
        "cache_max_entry_count": cache_max_entry_count,
        "quant_policy": quant_policy,
        "chat_template": chat_template,
        "eager_mode": eager_mode,
        "mp_engine": mp_engine,
        "raw": raw,
        "device": device,
        "sim_step_ms": sim_step_ms,
        "sim_max_batch": sim_max_batch,
        "burst": burst,
        "jobs_in_flight": jobs_in_flight,
        "prefetch_requests": prefetch_requests,
        "drain_timeout_s": drain_timeout,
        "heartbeat_ttl_s": heartbeat_ttl,
        "max_attempts": max_attempts,
        "health_port": health_port,
        "worker_name": worker_name,
        "redis_url": redis_url,
    }
    s = WorkerSettings(**{k: v for k, v in flags.items() if v is not None})
    configure_logging(s.log_format, s.log_level)
    if not s.worker_name:
        # One name for logs, Redis records and metrics labels.
        from lmdq.worker.runner import default_worker_name

        s.worker_name = default_worker_name()
    log = get_logger("lmdq.worker")
    client = connect(s.redis_url, settings=s)
    log.info("connected to redis", url=redact_url(s.redis_url))

    from lmdq.worker.engine_factory import build_engine, engine_capacity
    from lmdq.worker.runner import Worker

    health = None
    try:
        from lmdq.worker.health import WorkerHealth
    except ImportError:  # pragma: no cover - health endpoint is optional
        WorkerHealth = None  # type: ignore[assignment,misc]  # noqa: N806
    t0 = time.monotonic()
    name_hint = s.served_model_name or s.model or "default"
    if WorkerHealth is not None and s.health_port:
        health = WorkerHealth(worker_name=s.worker_name, model=name_hint)
        port = health.serve(s.health_host, s.health_port)
        log.info("health endpoint", port=port)
        health.set_redis_check(lambda: bool(client.ping()))
    eng = build_engine(s)
    load_s = time.monotonic() - t0
    log.info("engine loaded", engine=eng.name, backend=eng.backend, model=eng.model_name, load_s=round(load_s, 2))
    worker = Worker(engine=eng, client=client, settings=s, health=health, capacity=engine_capacity(eng))
    if health is not None:
        health.set_engine_loaded(load_s)
        health.set_queue_depth_fn(lambda: worker.jobs.queue_depth(worker.queues))
    worker.install_signal_handlers()
    code = worker.run()
    if health is not None:
        health.shutdown()
    raise typer.Exit(code)


def main() -> None:
    run_cli(app)


if __name__ == "__main__":
    main()
