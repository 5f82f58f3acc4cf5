"""Standard Webhooks signatures (https://www.standardwebhooks.com): what lmdq sends and how to check it.

A tenant's secret is ``whsec_`` + base64 of 24 random bytes; the HMAC key is those bytes. Each try is
sent with ``webhook-id`` (the event id: the receiver's deduplication key), ``webhook-timestamp`` (Unix
seconds of this try) and ``webhook-signature``: ``v1,`` + base64 of HMAC-SHA256 over
``<id>.<timestamp>.<body>``. :func:`verify` is the receiver's side (docs/webhooks.md shows it standalone).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping

__all__ = ["SECRET_PREFIX", "InvalidSignature", "headers", "new_secret", "sign", "verify"]

SECRET_PREFIX = "whsec_"
TOLERANCE_S = 300
"""A receiver refuses a timestamp further than this from its clock (a replayed old request)."""


class InvalidSignature(ValueError):
    """A request whose signature, or timestamp, does not check."""


def new_secret() -> str:
    """A fresh tenant secret."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(24)).decode()


def _key(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX))


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value of one try."""
    mac = hmac.new(_key(secret), f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def headers(secret: str, msg_id: str, body: bytes, *, now: float | None = None) -> dict[str, str]:
    """The headers of one try (timestamp: now)."""
    ts = int(time.time() if now is None else now)
    return {"webhook-id": msg_id, "webhook-timestamp": str(ts), "webhook-signature": sign(secret, msg_id, ts, body),
            "content-type": "application/json"}


def verify(secret: str, hdrs: Mapping[str, str], body: bytes, *, now: float | None = None,
           tolerance_s: float = TOLERANCE_S) -> str:
    """Check a received request; returns its event id, or raises :class:`InvalidSignature`. ``hdrs`` with
    lower-case names. Any of several space-separated ``v1,`` signatures may match (a secret being rotated)."""
    try:
        msg_id, ts = hdrs["webhook-id"], int(hdrs["webhook-timestamp"])
        given = hdrs["webhook-signature"].split()
    except (KeyError, ValueError) as e:
        raise InvalidSignature(f"missing or malformed webhook header: {e}") from e
    if abs((time.time() if now is None else now) - ts) > tolerance_s:
        raise InvalidSignature("timestamp outside the tolerance")
    want = sign(secret, msg_id, ts, body)
    if not any(hmac.compare_digest(want, g) for g in given):
        raise InvalidSignature("no signature matches")
    return msg_id
