"""lmdq.redis.replies: untrusted replies decode without raising."""

from __future__ import annotations

import redis

from lmdq.redis.replies import reply_text


def test_bytes_str_and_other_values_become_text() -> None:
    assert reply_text(b"abc") == "abc"
    assert reply_text("abc") == "abc"
    assert reply_text(7) == "7"
    assert reply_text("é".encode()) == "é"


def test_bad_utf8_is_replaced_not_raised() -> None:
    assert reply_text(b"ok\xff\xfe") == "ok\ufffd\ufffd"


def test_a_hostile_value_read_from_a_real_server(client: redis.Redis, prefix: str) -> None:
    client.set(f"{prefix}:x", b"\xc3(bad")
    assert reply_text(client.get(f"{prefix}:x")) == "\ufffd(bad"
