"""Redaction of URLs for messages and logs: total (never raises) and conservative (never leaks).

Why its own module: every error, log line and CLI message that mentions a URL goes through here, and
:mod:`lmdq.errors` and :mod:`lmdq.logs.config` need it without importing the Redis client code.

The rules, chosen so that a careless URL cannot leak a secret however it is malformed:

* The whole userinfo is replaced by ``***``: everything between ``://`` and the LAST ``@`` (a
  password may itself hold ``@``, ``/``, ``?`` or ``#``). The user name goes too: with a missing
  ``:`` (``redis://S3cret@host``) the "user name" IS the password.
* The host and port are kept only when they look like a host and a port; an empty host with a port
  (``redis://:S3cret``, the ``@`` forgotten) or any other oddity gives ``<unparseable redis URL>``.
* A path is kept only when it is plain (``/0``, ``/run/redis.sock``); query values only for keys
  known to be harmless (``ssl_cert_reqs``, ``db``, ...); a fragment never.
* ``scheme:/...`` without ``//`` is unparseable; so is anything without a scheme. Only well-known
  schemes are named (``S3cret:pw@host`` has a "scheme" too); others show as ``***``.
"""

from __future__ import annotations

import re

__all__ = ["redact_text", "redact_url", "UNPARSEABLE"]

UNPARSEABLE = "<unparseable URL>"

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]{0,15}")
_HOST_PORT = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]*)(?::(?P<port>[0-9]{1,5}))?")
_PLAIN_PATH = re.compile(r"(?!.*//)[A-Za-z0-9_.\-/~%+=,]*")  # no ':' and no '//': those may start credentials
_PLAIN_VALUE = re.compile(r"[A-Za-z0-9_.\-/]*")
# Query options of redis-py URLs whose values are never secrets (anything else is shown as ***).
_HARMLESS_QUERY_KEYS = frozenset({
    "db", "decode_responses", "health_check_interval", "protocol", "socket_connect_timeout",
    "socket_keepalive", "socket_timeout", "ssl_ca_certs", "ssl_ca_path", "ssl_cert_reqs", "ssl_certfile",
    "ssl_check_hostname", "ssl_min_version",
})
# Query keys shown by name (their values are always hidden): naming them helps, hiding them buys nothing.
_NAMED_QUERY_KEYS = _HARMLESS_QUERY_KEYS | frozenset({"password", "username", "client_name", "sentinel_password",
                                                   "sentinel_username"})
# For free text: a scheme and '://' (the URL parser below decides how much of the rest is URL).
_URL_START = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]{0,15}://")
_KNOWN_SCHEMES = frozenset({"redis", "rediss", "unix", "file", "s3", "s3a", "gs", "http", "https",
                            "redis+sentinel", "rediss+sentinel"})
_ALREADY_UNPARSEABLE = re.compile(r"<unparseable (?:[A-Za-z][A-Za-z0-9+.\-]{0,15} )?URL>")
_URL_END = re.compile(r"[\s'\"<>,;(){}]")


def redact_url(url: object) -> str:
    """``url`` safe to print: userinfo, secret-looking query values and fragments replaced by ``***``.

    Never raises, whatever ``url`` is (also not a string); when the URL cannot be taken apart with
    certainty, returns ``<unparseable SCHEME URL>`` (or ``<unparseable URL>``) and nothing else.
    """
    try:
        return _redact(url) if isinstance(url, str) else UNPARSEABLE
    except Exception:  # noqa: BLE001 - redaction must never be the thing that fails
        return UNPARSEABLE


def redact_text(text: object) -> str:
    """``text`` with every ``scheme://...`` in it redacted (a safety net for log lines and messages).

    A URL in free text has no clear end, so this errs on the side of hiding: from ``://`` it takes up
    to the last ``@`` of the line when there is one (a password may contain spaces), else up to the
    next whitespace, quote or punctuation that no host or path holds.
    """
    try:
        s = text if isinstance(text, str) else str(text)
        out: list[str] = []
        pos = 0
        for m in _URL_START.finditer(s):
            if m.start() < pos:
                continue
            rest = s[m.end():].split("\n", 1)[0]  # one line: a message's other lines are not this URL
            at = rest.rfind("@")
            end_rel = at + 1 if at >= 0 else 0
            stop = _URL_END.search(rest, end_rel)
            end = m.end() + (stop.start() if stop else len(rest))
            while end > m.end() + end_rel and s[end - 1] in ".:!?":  # sentence punctuation, not URL
                end -= 1
            out.append(s[pos:m.start()])
            out.append(redact_url(s[m.start():end]))
            pos = end
        out.append(s[pos:])
        return "".join(out)
    except Exception:  # noqa: BLE001 - redaction must never be the thing that fails
        return "<text withheld: could not be redacted>"


def _unparseable(scheme: str) -> str:
    return f"<unparseable {scheme} URL>" if scheme.lower() in _KNOWN_SCHEMES else UNPARSEABLE


def _redact(url: str) -> str:
    if _ALREADY_UNPARSEABLE.fullmatch(url):
        return url  # idempotent: a log line may redact an already redacted URL
    colon = url.find(":")
    scheme = url[:colon] if colon > 0 else ""
    if not _SCHEME.fullmatch(scheme) and scheme != "***":  # '***': a scheme this module already hid
        return UNPARSEABLE
    if scheme.lower() not in _KNOWN_SCHEMES:  # 'S3cret:pw@host' has a "scheme" too
        if not url.startswith("//", colon + 1):
            return UNPARSEABLE
        scheme = "***"
    elif not url.startswith("//", colon + 1):
        return _unparseable(scheme)
    rest = url[colon + 3:]
    at = rest.rfind("@")
    userinfo = at >= 0
    after = rest[at + 1:] if userinfo else rest
    end = min((i for i in (after.find(c) for c in "/?#") if i >= 0), default=len(after))
    host_port, tail = after[:end], after[end:]
    for hp in host_port.split(",") if scheme.lower().endswith("+sentinel") else [host_port]:  # host,host,...
        m = _HOST_PORT.fullmatch(hp)
        if m is None or (m.group("port") is not None and not m.group("host")):
            return _unparseable(scheme)
    path, _, fragment_part = tail.partition("#")
    path, qmark, query = path.partition("?")
    if not _PLAIN_PATH.fullmatch(path):
        path = "/***"
    out = f"{scheme}://{'***@' if userinfo else ''}{host_port}{path}"
    if qmark:
        out += "?" + "&".join(_redact_query_item(item) for item in query.split("&"))
    if "#" in tail:
        out += "#***" if fragment_part else "#"
    return out


def _redact_query_item(item: str) -> str:
    key, eq, value = item.partition("=")
    if key.lower() not in _NAMED_QUERY_KEYS:
        return "***"
    if not eq:
        return key
    if key.lower() in _HARMLESS_QUERY_KEYS and _PLAIN_VALUE.fullmatch(value):
        return f"{key}={value}"
    return f"{key}=***"
