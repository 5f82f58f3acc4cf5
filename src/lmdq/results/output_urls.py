"""Where a worker may write: the output URLs a job names (results sink, blob store), checked.

A job's ``results_url`` / ``blob_url`` decide where a worker writes files, and a job can be pushed by
anyone with queue access. So a worker writes only (1) to the URL the producer put in the batch record
(see :func:`lmdq.jobs.decode.decode_job`) and (2) only if that URL falls under a prefix the operator
allowed on the worker: ``LMDQ_ALLOWED_OUTPUT_URLS`` plus the worker's own ``LMDQ_BLOB_URL`` and
``LMDQ_RESULTS_URL``.

Only what lmdq supports is accepted: a local folder (a path, or ``file://`` + path) and ``s3://``.
Local paths are resolved (``..`` and symlinks followed) before the prefix check, and the worker
writes to the resolved path, so neither a ``..`` nor a symlink swapped in later moves it outside.
S3 keys take no ``.``/``..``/empty segments. Prefixes match whole path segments: ``/data/out`` allows
``/data/out/x``, not ``/data/out-evil``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from urllib.parse import urlsplit

from lmdq.errors import SubmitRejected
from lmdq.logs.redaction import redact_url

__all__ = [
    "OutputPolicy",
    "OutputUrlRejected",
    "Place",
    "Scheme",
    "check_submit_urls",
    "parse_output_url",
    "prefixes_from_csv",
    "shown_output_url",
]

MAX_URL_CHARS = 2048
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


class OutputUrlRejected(ValueError):
    """An output URL lmdq will not write to (unsupported, malformed, or outside the allowed prefixes)."""


class Scheme(str, Enum):
    """The storage kinds lmdq writes to (see :mod:`lmdq.results.blobs`)."""

    local = "local"
    s3 = "s3"


@dataclass(frozen=True)
class Place:
    """A normalised output location: a resolved local folder, or an S3 bucket and key segments."""

    scheme: Scheme
    root: str  # '/' for local, the bucket for s3
    parts: tuple[str, ...]

    @property
    def url(self) -> str:
        """The URL to write to: the resolved local path, or ``s3://bucket/key``."""
        if self.scheme is Scheme.local:
            return "/" + "/".join(self.parts)
        return f"s3://{self.root}/" + "/".join(self.parts) if self.parts else f"s3://{self.root}"

    def under(self, prefix: Place) -> bool:
        """Whether this location is ``prefix`` or inside it (whole segments)."""
        n = len(prefix.parts)
        return (self.scheme, self.root) == (prefix.scheme, prefix.root) and self.parts[:n] == prefix.parts


def shown(url: str) -> str:
    """A URL cut for messages: no user info, query or fragment (no secret ends up in a log)."""
    safe = _CONTROL.sub("?", url[:200])
    if "@" in safe or "?" in safe or "#" in safe:
        try:
            p = urlsplit(safe)
            host = p.netloc.rsplit("@", 1)[-1]
            return f"{p.scheme}://{host}{p.path}" if p.scheme else p.path
        except ValueError:
            return "<unprintable URL>"
    return safe + ("..." if len(url) > 200 else "")


def _has_credentials(url: str) -> bool:
    """Whether a results/blob URL carries anything secret-shaped: user info (``s3://KEY:SECRET@bucket``)
    or a query or fragment (``?X-Amz-Signature=...``, ``?token=...``). A plain folder path is not a URL:
    an ``@`` in a path is just a character."""
    if "://" not in url:
        return False
    netloc = url.split("://", 1)[1].split("/", 1)[0]
    return "@" in netloc or "?" in url or "#" in url


def check_submit_urls(results_url: str | None, blob_url: str | None) -> None:
    """Refuse (:class:`SubmitRejected`, nothing enqueued) an output URL with credentials in it.

    Why refuse instead of strip: the URL is stored in the batch record, copied into every job, shown by
    ``status`` and logged by workers; a secret in it would be everywhere Redis is readable. Workers take
    S3 credentials from their environment (``AWS_*``, an instance role), never from a batch."""
    for flag, url in (("--results-url", results_url), ("--blob-url", blob_url)):
        if url and _has_credentials(url):
            raise SubmitRejected(
                f"{flag}: {redact_url(url)!r} holds credentials (user info, a query or a fragment); nothing "
                "was enqueued. Give workers S3 credentials through their environment (AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY, an instance role), not in the URL"
            )


def shown_output_url(url: str | None) -> str | None:
    """A results/blob URL as ``status`` prints it: a folder as is, a URL redacted (a batch recorded by an
    older lmdq may hold credentials)."""
    if url is None or "://" not in url:
        return url
    return redact_url(url) if _has_credentials(url) else url


def parse_output_url(url: object) -> Place:
    """Normalise ``url`` or raise :class:`OutputUrlRejected` saying why.

    Local paths are resolved with ``os.path.realpath`` (relative ones against the working folder).
    """
    if not isinstance(url, str) or not url:
        raise OutputUrlRejected("expected a non-empty string")
    if len(url) > MAX_URL_CHARS:
        raise OutputUrlRejected(f"{len(url)} characters, over {MAX_URL_CHARS}")
    if _CONTROL.search(url):
        raise OutputUrlRejected(f"{shown(url)!r}: control characters (NUL, newline...) are not allowed")
    if "::" in url:
        raise OutputUrlRejected(f"{shown(url)!r}: chained fsspec URLs are not supported")
    m = _SCHEME.match(url)
    scheme = m.group(1).lower() if m else ""
    if scheme in ("", "file"):
        return _local(url, scheme)
    if scheme == "s3":
        return _s3(url)
    raise OutputUrlRejected(f"{shown(url)!r}: scheme {scheme!r} is not supported (a local folder or s3://)")


def _local(url: str, scheme: str) -> Place:
    path = url
    if scheme:
        p = urlsplit(url)
        if not url.lower().startswith("file://") or p.netloc not in ("", "localhost") or p.query or p.fragment:
            raise OutputUrlRejected(f"{shown(url)!r}: expected file:///absolute/path")
        path = p.path
    real = os.path.realpath(path)
    return Place(Scheme.local, "/", tuple(x for x in real.split("/") if x))


def _s3(url: str) -> Place:
    p = urlsplit(url)
    if not url.startswith("s3://") or p.query or p.fragment or "@" in p.netloc or ":" in p.netloc:
        raise OutputUrlRejected(f"{shown(url)!r}: expected s3://bucket/prefix (no credentials, port or query)")
    if not _S3_BUCKET.match(p.netloc):
        raise OutputUrlRejected(f"{shown(url)!r}: {p.netloc!r} is not a valid S3 bucket name")
    segs = p.path.strip("/").split("/") if p.path.strip("/") else []
    if any(s in ("", ".", "..") for s in segs):
        raise OutputUrlRejected(f"{shown(url)!r}: empty, '.' or '..' segments are not allowed in S3 keys")
    return Place(Scheme.s3, p.netloc, tuple(segs))


def prefixes_from_csv(value: str) -> tuple[str, ...]:
    """``LMDQ_ALLOWED_OUTPUT_URLS``: comma-separated prefixes, each checked now (so a typo stops the
    worker at start, not every job later)."""
    out = tuple(x.strip() for x in value.split(",") if x.strip())
    for x in out:
        try:
            parse_output_url(x)
        except OutputUrlRejected as e:
            raise ValueError(f"LMDQ_ALLOWED_OUTPUT_URLS: {e}") from e
    return out


class OutputPolicy:
    """The prefixes a worker may write under; :meth:`check` turns an output URL into where to write."""

    def __init__(self, allowed: Iterable[str | None]) -> None:
        self.allowed = tuple(parse_output_url(a) for a in allowed if a)

    @classmethod
    def for_worker(cls, allowed_csv: str, own_blob_url: str | None, own_results_url: str | None = None
                   ) -> OutputPolicy:
        """What the operator configured: ``LMDQ_ALLOWED_OUTPUT_URLS`` plus the worker's ``LMDQ_BLOB_URL`` and
        the cluster's ``LMDQ_RESULTS_URL`` (a sink every batch uses by default is one workers may write to)."""
        return cls((*prefixes_from_csv(allowed_csv), own_blob_url, own_results_url))

    def check(self, url: str) -> str:
        """The normalised URL to write to, or :class:`OutputUrlRejected` when it is not allowed."""
        place = parse_output_url(url)
        if not any(place.under(a) for a in self.allowed):
            allowed = ", ".join(a.url for a in self.allowed) or "none configured"
            raise OutputUrlRejected(
                f"{shown(url)!r} is outside the worker's allowed output prefixes ({allowed}); "
                "the operator allows more with LMDQ_ALLOWED_OUTPUT_URLS"
            )
        return place.url
