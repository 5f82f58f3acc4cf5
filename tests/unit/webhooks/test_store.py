"""The outbox on a real Redis: leased claims, tries counted at claim, a lost lease's result ignored, dead events."""

from __future__ import annotations

import json

import redis

from lmdq.redis.keys import Keys
from lmdq.webhooks.store import WebhookStore


def test_claim_lease_finish(client: redis.Redis, prefix: str) -> None:
    s = WebhookStore(client, keys=Keys(prefix))
    assert s.add("evt_a", url="http://h/x", tenant="t", body='{"id":"evt_a"}')
    assert not s.add("evt_a", url="http://h/y", tenant="t", body="{}")  # an id is made once
    (c,) = s.claim(10, lease_s=60, token="one")
    assert (c.id, c.url, c.tenant, c.body, c.tries) == ("evt_a", "http://h/x", "t", '{"id":"evt_a"}', 1)
    assert s.claim(10, lease_s=60, token="two") == []  # leased: no one else takes it
    assert not s.finish("evt_a", token="two", outcome="ok")  # not the holder: nothing changes
    assert s.finish("evt_a", token="one", outcome="retry", delay_s=0)
    (c,) = s.claim(10, lease_s=0, token="three")  # lease 0: due again at once, as a lapsed lease is
    assert c.tries == 2
    (c,) = s.claim(10, lease_s=60, token="four")
    assert c.tries == 3 and not s.finish("evt_a", token="three", outcome="ok")  # three lost its lease
    assert s.finish("evt_a", token="four", outcome="ok")
    assert s.pending() == [] and s.claim(10, lease_s=60, token="five") == []


def test_dead_events_and_secrets(client: redis.Redis, prefix: str) -> None:
    s = WebhookStore(client, keys=Keys(prefix))
    s.add("evt_b", url="http://h/x", tenant="t", body="{}")
    (c,) = s.claim(1, lease_s=60, token="k")
    assert s.finish(c.id, token="k", outcome="dead", error="HTTP 503")
    assert s.pending() == [] and s.dead()["evt_b"]["tries"] == 1 and s.dead()["evt_b"]["error"] == "HTTP 503"
    assert json.loads(s.dead()["evt_b"]["event"])["url"] == "http://h/x"
    assert s.secret("t") is None
    assert s.ensure_secret("t", "whsec_AAAA") == "whsec_AAAA"
    assert s.ensure_secret("t", "whsec_BBBB") == "whsec_AAAA"  # the first one stays
    s.set_secret("t", "whsec_CCCC")
    assert s.secret("t") == "whsec_CCCC"
