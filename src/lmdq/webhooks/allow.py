"""Which destinations a webhook may name: the allow list (``LMDQ_WEBHOOK_ALLOW``).

Why a list at all: a webhook makes lmdq's workers and API send requests to a URL a submitter chose; left
open, that is a way into whatever the cluster's network reaches (metadata services, internal admin
ports). The operator names what is allowed, comma separated; an entry is a URL prefix compared by parts,
never as text (``http://127.0.0.1:80`` does not admit ``http://127.0.0.1:8000``): same scheme, same host
(case-insensitive; ``*.example.com`` admits any subdomain, not example.com itself), same port (the
scheme's default when absent), and the URL's path at or below the entry's. Empty: no webhook is
allowed. Checked at submit (one line, nothing enqueued) and again before each try (the list may have
shrunk since). Redirects are never followed (a redirect could leave the list).
"""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["AllowList", "WebhookRefused"]

_DEFAULT_PORT = {"http": 80, "https": 443}


class WebhookRefused(ValueError):
    """A webhook URL outside the allow list, or not an http(s) URL; the message is one line."""


def _parts(url: str) -> tuple[str, str, int, str]:
    u = urlsplit(url.strip())
    scheme = u.scheme.lower()
    if scheme not in _DEFAULT_PORT or not u.hostname:
        raise WebhookRefused(f"expected an http:// or https:// URL with a host, got {_shown(url)!r}")
    if u.username or u.password:
        raise WebhookRefused("a webhook URL carries no credentials (the signature authenticates lmdq)")
    try:
        port = u.port or _DEFAULT_PORT[scheme]
    except ValueError as e:
        raise WebhookRefused(f"bad port in {_shown(url)!r}") from e
    return scheme, u.hostname.lower(), port, u.path or "/"


def _shown(url: str) -> str:
    """The URL without its query (it may hold a token) for messages."""
    return url.split("?", 1)[0][:200]


class AllowList:
    """The parsed ``LMDQ_WEBHOOK_ALLOW``."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.entries = [_parts(e) for e in (x.strip() for x in spec.split(",")) if e]

    def check(self, url: str) -> str:
        """``url`` when allowed; else :class:`WebhookRefused` with one line saying why."""
        scheme, host, port, path = _parts(url)
        for e_scheme, e_host, e_port, e_path in self.entries:
            if scheme != e_scheme or port != e_port:
                continue
            if e_host.startswith("*."):
                if not host.endswith(e_host[1:]):
                    continue
            elif host != e_host:
                continue
            base = e_path.rstrip("/")
            if path == base or path.startswith(base + "/") or e_path == "/":
                return url.strip()
        if not self.entries:
            raise WebhookRefused(f"{_shown(url)!r}: no webhook destination is allowed (LMDQ_WEBHOOK_ALLOW is empty)")
        raise WebhookRefused(f"{_shown(url)!r} is not in LMDQ_WEBHOOK_ALLOW")
