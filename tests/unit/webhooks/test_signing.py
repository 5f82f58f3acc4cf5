"""Standard Webhooks signatures: what lmdq signs is what a receiver's own HMAC checks, and nothing else passes."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest

from lmdq.webhooks.signing import InvalidSignature, headers, new_secret, sign, verify


def test_the_signature_is_hmac_sha256_of_id_timestamp_body() -> None:
    secret = new_secret()
    assert secret.startswith("whsec_") and len(base64.b64decode(secret[6:])) == 24
    key = base64.b64decode(secret[6:])
    mac = hmac.new(key, b"evt_1.1700000000.{\"a\":1}", hashlib.sha256).digest()
    assert sign(secret, "evt_1", 1700000000, b'{"a":1}') == "v1," + base64.b64encode(mac).decode()


def test_verify_accepts_its_own_and_refuses_tampering_replay_and_other_secrets() -> None:
    secret, body = new_secret(), b'{"id":"evt_1"}'
    h = headers(secret, "evt_1", body, now=1_700_000_000)
    assert h["webhook-id"] == "evt_1" and h["webhook-timestamp"] == "1700000000"
    assert verify(secret, h, body, now=1_700_000_100) == "evt_1"
    with pytest.raises(InvalidSignature):
        verify(secret, h, body + b" ", now=1_700_000_100)
    with pytest.raises(InvalidSignature):
        verify(new_secret(), h, body, now=1_700_000_100)
    with pytest.raises(InvalidSignature, match="tolerance"):
        verify(secret, h, body, now=1_700_000_000 + 301)
    with pytest.raises(InvalidSignature):
        verify(secret, {**h, "webhook-id": "evt_2"}, body, now=1_700_000_000)
    with pytest.raises(InvalidSignature, match="missing"):
        verify(secret, {"webhook-id": "evt_1"}, body)
    # a rotation: several signatures, any one matching is enough
    both = {**h, "webhook-signature": f"v1,AAAA {h['webhook-signature']}"}
    assert verify(secret, both, body, now=1_700_000_000) == "evt_1"
