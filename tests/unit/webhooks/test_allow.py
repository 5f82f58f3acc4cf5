"""The allow list (LMDQ_WEBHOOK_ALLOW): compared by parts, never as text."""

from __future__ import annotations

import pytest

from lmdq.webhooks.allow import AllowList, WebhookRefused


@pytest.mark.parametrize(("url", "ok"), [
    ("https://hooks.example.com/lmdq", True),
    ("https://hooks.example.com/lmdq/batch?x=1", True),
    ("https://hooks.example.com/lmdqx", False),  # a path at or below the entry's, not a text prefix
    ("https://hooks.example.com:443/lmdq", True),
    ("https://hooks.example.com:8443/lmdq", False),
    ("http://hooks.example.com/lmdq", False),
    ("https://a.svc.example.org/any", True),
    ("https://svc.example.org/any", False),
    ("http://127.0.0.1:8000/", False),  # port 80 allowed, not 8000
    ("http://127.0.0.1/x", True),
    ("https://user:pw@hooks.example.com/lmdq", False),
    ("ftp://hooks.example.com/lmdq", False),
])
def test_allow_list_rules(url: str, ok: bool) -> None:
    allow = AllowList("https://hooks.example.com/lmdq, https://*.svc.example.org, http://127.0.0.1")
    if ok:
        assert allow.check(url) == url
    else:
        with pytest.raises(WebhookRefused):
            allow.check(url)
    with pytest.raises(WebhookRefused, match="empty"):
        AllowList("").check("https://hooks.example.com/lmdq")
