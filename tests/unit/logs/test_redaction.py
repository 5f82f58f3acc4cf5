"""lmdq.logs.redaction: total, idempotent, and never leaks a secret however the URL is malformed."""

from __future__ import annotations

import pytest

from lmdq.logs.redaction import UNPARSEABLE, redact_text, redact_url

SECRET = "S3cret"


@pytest.mark.parametrize("url, want", [
    ("redis://localhost:6379/0", "redis://localhost:6379/0"),
    (f"redis://user:{SECRET}@h:6379/0", "redis://***@h:6379/0"),
    (f"redis://{SECRET}@h", "redis://***@h"),
    (f"redis://:p@ss/{SECRET}@h:1/2", "redis://***@h:1/2"),
    (f"rediss://h/0?ssl_cert_reqs=none&password={SECRET}&x={SECRET}", "rediss://h/0?ssl_cert_reqs=none&password=***&***"),
    (f"https://h/p#{SECRET}", "https://h/p#***"),
    (f"s3://bucket/a//{SECRET}", "s3://bucket/***"),
    (f"{SECRET}:pw@host", UNPARSEABLE),
    (f"redis://:{SECRET}", "<unparseable redis URL>"),
    (f"redis:/{SECRET}", "<unparseable redis URL>"),
    (f"weird://{SECRET}@h", "***://***@h"),
    ("redis+sentinel://a:1,b:2/m", "redis+sentinel://a:1,b:2/m"),
])
def test_redact_url(url: str, want: str) -> None:
    assert redact_url(url) == want
    assert SECRET not in redact_url(url)


@pytest.mark.parametrize("bad", [None, 5, b"redis://x:S3cret@h", "", "::::", "\x00", "redis://[::1"])
def test_never_raises_and_never_leaks(bad: object) -> None:
    out = redact_url(bad)
    assert isinstance(out, str) and SECRET not in out


def test_idempotent() -> None:
    for url in [f"redis://u:{SECRET}@h:1/0", f"redis://:{SECRET}", f"x{SECRET}"]:
        once = redact_url(url)
        assert redact_url(once) == once


def test_redact_text_finds_urls_in_free_text() -> None:
    line = f"connect to redis://u:{SECRET} with space@h:6379/0. then https://ok.example/p, done"
    out = redact_text(line)
    assert SECRET not in out
    assert out.endswith("https://ok.example/p, done") and "redis://***@h:6379/0." in out
    assert redact_text("no url here") == "no url here"
    assert redact_text(12) == "12"


def test_redact_text_stays_on_one_line() -> None:
    out = redact_text(f"a redis://h/0\nb user@{SECRET}")
    assert out.splitlines()[1] == f"b user@{SECRET}"  # not a URL: the next line is not swallowed
