"""``lmdq-worker``: load one engine, drain its model's queues."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import typer

from lmdq.cli.options import model_options
from lmdq.cli.run import run_cli
from lmdq.flags import own_fields, settings_flags
from lmdq.logs.config import configure_logging, get_logger, route_child_logs
from lmdq.logs.relay import install_relay
from lmdq.logs.tqdm_events import install as install_tqdm_events
from lmdq.redis.connection import connect, redact_url
from lmdq.registry.store import redis_answers
from lmdq.settings import CommonSettings
from lmdq.worker.engine_settings import engine_flag_specs, unused_env
from lmdq.worker.heap import freeze_heap
from lmdq.worker.settings import WorkerSettings, load_worker_settings

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  # plain click help, as lmdq-producer: rich cuts long option names at 80 columns
                  rich_markup_mode=None, context_settings={"max_content_width": 120})


#: The worker loop's flags: one per field WorkerSettings declares (engine configs aside: their fields are the
#: engine flags below) plus the connection's; name, type, default and help all from the field.
WORKER_FLAGS = settings_flags(WorkerSettings, [*own_fields(WorkerSettings, CommonSettings), "redis_url"])


@app.command()
@model_options([*WORKER_FLAGS, *engine_flag_specs()], into="given")
def run(given: dict[str, Any]) -> None:
    """Run a worker until stopped (or, with --burst, until its queues are empty).

    Every flag is also an LMDQ_ env var (flag > env > default): the worker loop's come from
    lmdq.worker.settings.WorkerSettings, the engine settings (--tp, --dtype, --sim-step-ms, ...) from the
    engines' one declaration (lmdq.worker.engine_config); one the chosen engine does not take is an error
    (exit 2)."""
    s = load_worker_settings(**given)
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
    if s.gil_switch_interval_ms is not None:  # before the engine starts its threads (issue 27, TurboMind)
        sys.setswitchinterval(s.gil_switch_interval_ms / 1000.0)
        log.info("gil switch interval", ms=round(sys.getswitchinterval() * 1000.0, 3))
    # A blocking pool sized to the job threads: hundreds of jobs in flight never see "Too many connections".
    client = connect(s.redis_url, settings=s, max_connections=s.redis_pool_size)
    log.info("connected to redis", url=redact_url(s.redis_url))

    from lmdq.worker.engine_factory import build_engine, engine_capacity
    from lmdq.worker.engines.base import Engine
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
    if s.model:  # hashed beside the engine's load, not after it (lmdq.worker.reuse.start_weights_fingerprint)
        from lmdq.worker.reuse import start_weights_fingerprint

        start_weights_fingerprint(s.model)
    if s.runs_engine_process:  # the engine in a child of its own (issue 27: TurboMind shares no GIL with the worker)
        from lmdq.worker.engine_factory import served_model_name
        from lmdq.worker.engines.engine_process import EngineProcess

        eng: Engine = EngineProcess.start(s, log_format=fmt, served_model_name=served_model_name(s))
    else:
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
    log.debug("heap frozen", objects=freeze_heap())  # after start-up: full collections skip it (lmdq.worker.heap)
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
