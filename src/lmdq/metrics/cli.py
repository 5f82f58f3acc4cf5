"""``python -m lmdq.metrics``: the queue exporter (:mod:`lmdq.metrics.exporter`) as a command of
its own; ``lmdq-producer exporter`` is the same with the producer's ``--redis-url``. Every flag is an
``ExporterSettings`` field (``EXPORTER_FLAGS``) plus ``--redis-url``."""

from __future__ import annotations

from typing import Any

import typer

from lmdq.cli.options import model_options
from lmdq.cli.run import run_cli
from lmdq.flags import settings_flags
from lmdq.metrics.exporter import EXPORTER_FLAGS, ExporterSettings, load_settings, run

__all__ = ["command", "main"]


@model_options([*EXPORTER_FLAGS, *settings_flags(ExporterSettings, ["redis_url"])], into="flags")
def command(flags: dict[str, Any]) -> None:
    """Serve queue depth, running jobs, live workers and batch counts per model on /metrics, read
    from Redis every --interval-s by one collector. Run ONE per Redis (it needs no GPU; it works at
    zero workers)."""
    from lmdq.logs.config import configure_logging

    s = load_settings(**flags)
    configure_logging(s.log_format, s.log_level)
    run(s)


def main() -> None:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
    app.command()(command)
    run_cli(app)


if __name__ == "__main__":
    main()
