"""``lmdq-worker``: load one engine, drain its model's queues."""

from __future__ import annotations

import os
import sys
import time
from typing import Annotated, Any

import typer

from lmdq.cli.options import model_options
from lmdq.errors import run_cli
from lmdq.logs.config import configure_logging, get_logger, route_child_logs
from lmdq.logs.relay import install_relay
from lmdq.logs.tqdm_events import install as install_tqdm_events
from lmdq.redis.connection import connect, redact_url
from lmdq.worker.engine_config import EngineName, engine_flag_specs, unused_env
from lmdq.worker.settings import load_worker_settings
from lmdq.workers.registry import redis_answers

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  # plain click help, as lmdq-producer: rich cuts long option names at 80 columns
                  rich_markup_mode=None, context_settings={"max_content_width": 120})


@app.command()
@model_options(engine_flag_specs(), into="engine_settings")
def run(
    engine_settings: dict[str, Any],
    model: Annotated[str | None, typer.Option(help="model folder or hub id (default: embedded SmolLM2 on CPU)")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="name producers submit to (queue)")] = None,
    engine: Annotated[
        EngineName | None, typer.Option(help="the (engines) after an engine flag's help are those that take it")
    ] = None,
    burst: Annotated[bool | None, typer.Option("--burst/--no-burst", help="exit when the queues are empty")] = None,
    jobs_in_flight: Annotated[int | None, typer.Option(help="max jobs held at once (0 = auto)")] = None,
    prefetch_requests: Annotated[
        int | None, typer.Option(help="requests held beyond engine capacity (0 = one engine-full, at least a job)")
    ] = None,
    drain_timeout: Annotated[float | None, typer.Option(help="seconds to finish work after SIGTERM")] = None,
    heartbeat_ttl: Annotated[float | None, typer.Option(help="lease TTL: a dead worker's jobs rerun after it")] = None,
    max_attempts: Annotated[int | None, typer.Option()] = None,
    health_port: Annotated[str | None, typer.Option(
        help="HTTP /healthz /readyz /metrics: a port, 0 = off, auto = the first free one from 8000")] = None,
    worker_name: Annotated[str | None, typer.Option()] = None,
    redis_url: Annotated[str | None, typer.Option(help="env LMDQ_REDIS_URL, then REDIS_URL")] = None,
) -> None:
    """Run a worker until stopped (or, with --burst, until its queues are empty).

    Engine settings (--tp, --dtype, --sim-step-ms, ...) come from the engines' one declaration
    (lmdq.worker.engine_config); one the chosen engine does not take is an error (exit 2)."""
    flags: dict[str, Any] = {
        "model": model,
        "served_model_name": served_model_name,
        "engine": engine,
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
    s = load_worker_settings(**{k: v for k, v in flags.items() if v is not None}, **engine_settings)
    # JSON unless a terminal, decided on the real stderr, before the relay puts a pipe behind it
    fmt = "json" if s.log_format == "json" or (s.log_format == "auto" and not sys.stderr.isatty()) else "console"
    if fmt == "json":
        install_relay()  # any line a library or an engine child writes to fd 1/2 comes out as JSON too
    configure_logging(fmt, s.log_level)
    route_child_logs(fmt, s.log_level)  # LMDeploy's spawned engine process logs JSON too
    install_tqdm_events()  # LMDeploy's and transformers' progress bars: structured events, not terminal text
    if not s.worker_name:
        # One name for logs, Redis records and metrics labels.
        from lmdq.worker.runner import default_worker_name

        s.worker_name = default_worker_name()
    log = get_logger("lmdq.worker")
    if s.served_model_name:
        from lmdq.redis.keys import check_model_name

        check_model_name(s.served_model_name)  # before a model load of minutes: exit 2, one line
    ignored = unused_env(s.engine_name, os.environ)
    if ignored:
        log.warning("engine settings in the environment that this engine does not take; ignored",
                    engine=s.engine_name, env=ignored)
    # A blocking pool sized to the job threads: hundreds of jobs in flight never see "Too many connections".
    client = connect(s.redis_url, settings=s, max_connections=s.redis_pool_size)
    log.info("connected to redis", url=redact_url(s.redis_url))

    from lmdq.worker.engine_factory import build_engine, engine_capacity
    from lmdq.worker.runner import Worker

    health = None
    try:
        from lmdq.worker.health import WorkerHealth
    except ImportError:  # pragma: no cover - health endpoint is optional
        WorkerHealth = None  # noqa: N806
    t0 = time.monotonic()
    if WorkerHealth is not None and s.health_port:
        from lmdq.worker.engine_factory import served_model_name as serves
        from lmdq.worker.health_port import serve_health

        health = WorkerHealth(worker_name=s.worker_name, model=serves(s))
        port = serve_health(health, s.health_host, s.health_port)
        log.info("health endpoint", port=port, asked=s.health_port)
        health.set_redis_check(lambda: redis_answers(client))
    eng = build_engine(s)
    load_s = time.monotonic() - t0
    log.info("engine loaded", engine=eng.name, backend=eng.backend, model=eng.model_name, load_s=round(load_s, 2),
             config=s.engine_config.model_dump(mode="json"))
    warm_up = getattr(eng, "warm_up", None)
    if warm_up is not None:  # before /readyz turns ready: the first batch runs at full speed (issue 27)
        log.info("engine warmed up", **warm_up())
        load_s = time.monotonic() - t0
    from lmdq.worker.engine_factory import cpu_speed_note

    note = cpu_speed_note(eng)
    if note:
        log.warning(note, model=eng.model_name)
    worker = Worker(engine=eng, client=client, settings=s, health=health, capacity=engine_capacity(eng))
    if health is not None:
        health.set_engine_loaded(load_s)
    worker.install_signal_handlers()
    code = worker.run()
    if health is not None:
        health.shutdown()
    raise typer.Exit(code)


def main() -> None:
    run_cli(app)


if __name__ == "__main__":
    main()
