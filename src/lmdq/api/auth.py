"""Bearer API keys: operator-configured ``tenant:key`` pairs, kept only as SHA-256 digests.

Keys are long random secrets, so a fast digest compared in constant time is enough (no password
hashing needed); the plain keys are dropped once hashed, and no error or log line ever carries
one (a bad key is reported as "invalid API key", never echoed). Every request names its tenant
through the key it presents; the stores scope every id by that tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from pathlib import Path

from lmdq.errors import BadSetting

__all__ = ["KeyRing", "load_keyring"]

_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_MIN_KEY_LEN = 16


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class KeyRing:
    """Which tenant a bearer key belongs to."""

    def __init__(self, pairs: Iterable[tuple[str, str]]) -> None:
        self._by_digest: dict[bytes, str] = {}
        for tenant, key in pairs:
            self._by_digest[_digest(key)] = tenant

    def __len__(self) -> int:
        return len(self._by_digest)

    @property
    def tenants(self) -> set[str]:
        return set(self._by_digest.values())

    def tenant_of(self, key: str) -> str | None:
        """The key's tenant, or None. Every stored digest is compared (constant time each), so the
        time taken does not say which, or whether any, digest matched."""
        d = _digest(key)
        found: str | None = None
        for stored, tenant in self._by_digest.items():
            if hmac.compare_digest(stored, d):
                found = tenant
        return found


def _parse(text: str, where: str, *, sep: str) -> list[tuple[str, str]]:
    """``tenant:key`` entries; errors name the entry's position, never its key."""
    out: list[tuple[str, str]] = []
    entries = text.split(sep)
    for n, raw in enumerate(entries, start=1):
        entry = raw.strip()
        if not entry or entry.startswith("#"):
            continue
        tenant, colon, key = entry.partition(":")
        tenant, key = tenant.strip(), key.strip()
        at = f"{where} entry {n}" if sep == "," else f"{where}:{n}"
        if not colon or not key:
            raise BadSetting(f"invalid setting {at}: expected tenant:key")
        if not _TENANT.match(tenant):
            raise BadSetting(f"invalid setting {at}: tenant: expected 1-64 of A-Z a-z 0-9 _ . - "
                             "(starting with a letter or digit)")
        if len(key) < _MIN_KEY_LEN:
            raise BadSetting(f"invalid setting {at}: the key of tenant {tenant!r} is shorter than {_MIN_KEY_LEN} "
                             "characters; use a long random key (e.g. `openssl rand -hex 24`)")
        out.append((tenant, key))
    return out


def load_keyring(keys: str | None, keys_file: Path | None) -> KeyRing:
    """The keys of ``LMDQ_API_KEYS`` and ``LMDQ_API_KEYS_FILE`` together; none at all is an error (an
    API with no keys would be open to anyone who can reach it)."""
    pairs = _parse(keys, "LMDQ_API_KEYS", sep=",") if keys else []
    if keys_file is not None:
        try:
            text = keys_file.read_text()
        except OSError as e:
            raise BadSetting(f"invalid setting LMDQ_API_KEYS_FILE: cannot read {keys_file}: {e.strerror or e}") from e
        pairs += _parse(text, str(keys_file), sep="\n")
    digests: dict[bytes, str] = {}
    for tenant, key in pairs:
        other = digests.setdefault(_digest(key), tenant)
        if other != tenant:
            raise BadSetting(f"invalid setting: tenants {other!r} and {tenant!r} have the same key")
    ring = KeyRing(pairs)
    if not len(ring):
        raise BadSetting("no API keys: set LMDQ_API_KEYS (tenant:key,...) or LMDQ_API_KEYS_FILE")
    return ring
