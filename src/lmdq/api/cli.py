"""``lmdq-api``: serve the OpenAI-compatible Files + Batches API (uvicorn)."""

from __future__ import annotations

from typing import Any

import typer

from lmdq.cli.options import model_options
from lmdq.cli.run import run_cli
from lmdq.errors import EXIT_CODES_HELP
from lmdq.flags import FlagSpec, settings_flags
from lmdq.settings import load_or_refuse

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None, epilog=EXIT_CODES_HELP,
                  help="Serve lmdq's OpenAI-compatible Files + Batches API.")


def _flags() -> list[FlagSpec]:
    """--host, --port (ApiSettings' api_host / api_port) and --redis-url, from their fields. The keys are
    env vars or a file only: a flag would show them to anyone who can list processes."""
    from lmdq.api.settings import ApiSettings

    return settings_flags(ApiSettings, ["api_host", "api_port", "redis_url"], flat=lambda n: n.removeprefix("api_"))


@app.command()
@model_options(_flags(), into="given")
def serve(given: dict[str, Any]) -> None:
    """Serve /v1/files and /v1/batches for the tenants of LMDQ_API_KEYS / LMDQ_API_KEYS_FILE."""
    from lmdq.api.app import create_app
    from lmdq.api.auth import load_keyring
    from lmdq.api.backend import Backend
    from lmdq.api.server import serve as serve_app
    from lmdq.api.settings import ApiSettings
    from lmdq.logs.config import configure_logging

    s = load_or_refuse(ApiSettings, **given)
    configure_logging(s.log_format, s.log_level)
    keyring = load_keyring(s.api_keys.get_secret_value() if s.api_keys else None, s.api_keys_file)
    app_ = create_app(s, keyring, Backend(s))
    serve_app(app_, s)  # uvicorn with lmdq-api's timeouts and connection caps (lmdq.api.server)


def main() -> None:
    run_cli(app)
