"""The deliverer: exponential backoff, and a redirect never followed (it could leave the allow list)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import redis

from lmdq.redis.keys import Keys
from lmdq.webhooks.delivery import Deliverer, DeliveryPolicy
from lmdq.webhooks.store import WebhookStore


def test_backoff_doubles_up_to_its_cap() -> None:
    p = DeliveryPolicy(backoff_s=5, backoff_max_s=60)
    assert [p.delay_s(n) for n in range(1, 7)] == [5, 10, 20, 40, 60, 60]


@pytest.fixture()
def redirector() -> Iterator[tuple[str, list[str]]]:
    hits: list[str] = []

    class H(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            hits.append(self.path)
            self.send_response(307)
            self.send_header("location", "/elsewhere")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *a: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", hits
    srv.shutdown()
    srv.server_close()


def test_a_redirect_is_a_failed_try_not_followed(client: redis.Redis, prefix: str,
                                                 redirector: tuple[str, list[str]]) -> None:
    origin, hits = redirector
    store = WebhookStore(client, keys=Keys(prefix))
    store.ensure_secret("default", "whsec_" + "A" * 32)
    store.add("evt_r", url=f"{origin}/hook", tenant="default", body="{}")
    d = Deliverer(store, DeliveryPolicy(allow=f"{origin}/hook", backoff_s=30))
    assert d.run_once() == 1
    assert hits == ["/hook"] and store.pending() == ["evt_r"] and d.delivered == 0  # due again in 30 s


def test_a_destination_off_the_list_is_not_called(client: redis.Redis, prefix: str,
                                                  redirector: tuple[str, list[str]]) -> None:
    origin, hits = redirector
    store = WebhookStore(client, keys=Keys(prefix))
    store.ensure_secret("default", "whsec_" + "A" * 32)
    store.add("evt_x", url=f"{origin}/hook", tenant="default", body="{}")
    d = Deliverer(store, DeliveryPolicy(allow="https://hooks.example.com", backoff_s=30))
    assert d.run_once() == 1 and hits == [] and store.pending() == ["evt_x"]
