"""The API server's settings: ``LMDQ_*`` env vars, declared once each (tests/test_settings.py).

The server submits batches exactly as ``lmdq-producer submit`` does, so it takes every producer
setting (batch size, known models, input limits, results sink, TTL) from
:class:`~lmdq.submission.settings.ProducerSettings` and adds only what HTTP needs.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr

from lmdq.submission.settings import ProducerSettings

__all__ = ["ApiSettings"]


class ApiSettings(ProducerSettings):
    api_host: str = Field(default="127.0.0.1", description="address lmdq-api listens on (0.0.0.0 in containers)")
    api_port: int = Field(default=8080, ge=0, le=65535, description="port lmdq-api listens on (0: any free port; "
                          "8080, apart from the worker's health port 8000 and the exporter's 9464)")
    api_keys: SecretStr | None = Field(
        default=None, description="API keys as comma-separated tenant:key pairs (LMDQ_API_KEYS); kept only hashed"
    )
    api_keys_file: Path | None = Field(
        default=None, description="a file of tenant:key lines (LMDQ_API_KEYS_FILE; # comments), e.g. a mounted "
        "Kubernetes Secret; read with LMDQ_API_KEYS, both may be given"
    )
    api_files_dir: Path = Field(
        default=Path("lmdq-files"), description="folder uploaded files and batch output files are written to "
        "(streamed, never held in memory); shared by every lmdq-api replica"
    )
    api_model: str | None = Field(
        default=None, description="served model every batch runs on, whatever its lines' body.model says "
        "(as `submit --model`); unset: the lines' body.model must be a known model"
    )
    api_image_root: Path | None = Field(
        default=None, description="the one folder a batch's image_url parts may name local paths in "
        "(LMDQ_API_IMAGE_ROOT; relative paths resolve against it, symlinks may not lead out); unset: local image "
        "paths are refused, only data: URLs, s3:// and http(s):// (a tenant must not read the server's files)"
    )
    api_max_upload_bytes: int = Field(default=8 << 30, ge=1, description="largest file POST /v1/files accepts")
    api_file_ttl_s: int = Field(
        default=30 * 24 * 3600, ge=60, description="how long uploaded and output files are kept (OpenAI's "
        "expires_at; DELETE /v1/files/{id} removes one sooner)"
    )
    api_submit_lease_s: int = Field(
        default=60, ge=1, le=3600, description="how long a replica's hold on a submission lasts unrenewed "
        "(LMDQ_API_SUBMIT_LEASE_S): once a replica that was submitting a batch stopped, another one (or it, "
        "restarted) runs the submission again after this; the re-run resumes a batch left half staged"
    )
    api_poll_interval_s: float = Field(
        default=0.5, gt=0, le=60, description="how often the server looks for batches that ended (to write their "
        "output files) and for submissions a stopped replica left half done"
    )
    api_idle_timeout_s: int = Field(
        default=5, ge=1, le=3600, description="how long a kept-alive connection may sit idle between requests "
        "before the server closes it"
    )
    api_header_timeout_s: float = Field(
        default=10, gt=0, le=3600, description="how long a client has to send a request's headers, from its "
        "connection (or the request's first byte); a connection that sends nothing or trickles is closed"
    )
    api_body_timeout_s: float = Field(
        default=30, gt=0, le=3600, description="the longest gap between two received pieces of a request body "
        "(an upload): a client that stalls or trickles slower is closed and its partial file removed"
    )
    api_max_uploads: int = Field(
        default=16, ge=1, le=100_000, description="uploads (POST /v1/files) in progress at once; one more is "
        "answered 503 with Retry-After (the SDKs retry it)"
    )
    api_max_connections: int = Field(
        default=1000, ge=1, le=1_000_000, description="client connections held open at once (kept under the "
        "process's open-file limit); over it, the oldest connection with no request in progress is closed, "
        "or else the new one"
    )
    api_webhooks: str = Field(
        default="", description="each tenant's default webhook (issue 48, docs/webhooks.md): tenant=URL entries, "
        "comma separated; a batch's own `webhook` wins; each URL must be in LMDQ_WEBHOOK_ALLOW"
    )
    api_backlog: int = Field(
        default=2048, ge=1, le=65535, description="connections the kernel queues for lmdq-api to accept (listen "
        "backlog)"
    )
