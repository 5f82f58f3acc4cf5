"""Delivering webhook events: a thread any lmdq process may run (each worker does, and the HTTP API).

Why a thread of its own: a receiver may be slow or down, and a worker's job must never wait on it. The
thread claims due events from the outbox (:mod:`lmdq.webhooks.store`, leased), signs each try with its
tenant's secret (:mod:`lmdq.webhooks.signing`), POSTs it, and reports: a 2xx answer delivers it; any other
answer, a timeout or a refused connection schedules the next try after ``backoff_s * 2**(tries-1)``
(capped at ``backoff_max_s``); after ``max_tries`` the event is given up (kept in the dead set, logged). No
jitter: every deliverer already picks events from one schedule, so retries of one event never pile up, and
tests can count on the delays. The destination is checked against the allow list again before each try,
and redirects are not followed. Secrets and URL queries are never logged.
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any

from lmdq.logs.config import get_logger
from lmdq.logs.redaction import redact_url
from lmdq.settings import CommonSettings, default_of
from lmdq.webhooks.allow import AllowList, WebhookRefused
from lmdq.webhooks.signing import headers
from lmdq.webhooks.store import Claimed, WebhookStore

__all__ = ["Deliverer", "DeliveryPolicy"]

log = get_logger("lmdq.webhooks")


@dataclass(frozen=True)
class DeliveryPolicy:
    """How tries are spaced and bounded (the ``LMDQ_WEBHOOK_*`` settings)."""

    allow: str = default_of(CommonSettings, "webhook_allow")
    backoff_s: float = default_of(CommonSettings, "webhook_backoff_s")
    backoff_max_s: float = default_of(CommonSettings, "webhook_backoff_max_s")
    max_tries: int = default_of(CommonSettings, "webhook_max_tries")
    timeout_s: float = default_of(CommonSettings, "webhook_timeout_s")
    lease_s: float = default_of(CommonSettings, "webhook_lease_s")
    poll_s: float = default_of(CommonSettings, "webhook_poll_s")

    @classmethod
    def of(cls, settings: CommonSettings) -> DeliveryPolicy:
        """From the ``LMDQ_WEBHOOK_*`` settings (every side's settings are :class:`CommonSettings`)."""
        return cls(allow=settings.webhook_allow, backoff_s=settings.webhook_backoff_s,
                   backoff_max_s=settings.webhook_backoff_max_s, max_tries=settings.webhook_max_tries,
                   timeout_s=settings.webhook_timeout_s, lease_s=settings.webhook_lease_s,
                   poll_s=settings.webhook_poll_s)

    def delay_s(self, tries: int) -> float:
        """The wait after the ``tries``-th failed try."""
        return float(min(self.backoff_max_s, self.backoff_s * 2 ** max(0, tries - 1)))


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


class Deliverer:
    """Claims, signs and sends due events; :meth:`start` runs it on a daemon thread until :meth:`stop`."""

    def __init__(self, store: WebhookStore, policy: DeliveryPolicy, *, name: str = "") -> None:
        self.store = store
        self.policy = policy
        self.allow = AllowList(policy.allow)
        self.name = name or f"deliverer-{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: events this deliverer finished delivering (for logs and tests)
        self.delivered = 0

    def run_once(self, n: int = 16) -> int:
        """One pass: claim up to ``n`` due events and try each. Returns how many were tried."""
        token = f"{self.name}:{uuid.uuid4().hex}"
        got = self.store.claim(n, lease_s=self.policy.lease_s, token=token)
        for ev in got:
            self._try(ev, token)
        return len(got)

    def _try(self, ev: Claimed, token: str) -> None:
        where = redact_url(ev.url.split("?", 1)[0])
        error = ""
        try:
            self.allow.check(ev.url)
            secret = self.store.secret(ev.tenant)
            if secret is None:
                raise WebhookRefused(f"tenant {ev.tenant!r} has no webhook secret")
            body = ev.body.encode()
            req = urllib.request.Request(ev.url, data=body, method="POST",
                                         headers={**headers(secret, ev.id, body), "user-agent": "lmdq-webhooks"})
            with _OPENER.open(req, timeout=self.policy.timeout_s) as resp:
                status = int(resp.status)
        except urllib.error.HTTPError as e:
            status, error = int(e.code), f"HTTP {e.code}"
        except WebhookRefused as e:
            status, error = 0, str(e)
        except (OSError, ValueError) as e:  # refused, reset, timeout, DNS, a bad URL
            status, error = 0, f"{type(e).__name__}: {getattr(e, 'reason', None) or e}"
        if 200 <= status < 300:
            if self.store.finish(ev.id, token=token, outcome="ok"):
                self.delivered += 1
                log.info("webhook delivered", event_id=ev.id, url=where, tries=ev.tries, status=status)
            return
        error = error or f"HTTP {status}"
        if ev.tries >= self.policy.max_tries:
            self.store.finish(ev.id, token=token, outcome="dead", error=error)
            log.error("webhook given up", event_id=ev.id, url=where, tries=ev.tries, error=error)
            return
        delay = self.policy.delay_s(ev.tries)
        self.store.finish(ev.id, token=token, outcome="retry", delay_s=delay, error=error)
        log.warning("webhook try failed", event_id=ev.id, url=where, tries=ev.tries, error=error, retry_in_s=delay)

    def run(self) -> None:
        """Deliver until :meth:`stop`; a Redis error is logged and the loop goes on (the events wait in Redis)."""
        while not self._stop.is_set():
            try:
                busy = self.run_once()
            except Exception as e:  # noqa: BLE001 - the thread must outlive a Redis hiccup; events stay in Redis
                log.warning("webhook delivery pass failed", error=f"{type(e).__name__}: {e}"[:300])
                busy = 0
            if not busy:
                self._stop.wait(self.policy.poll_s)

    def start(self) -> Deliverer:
        """Run on a daemon thread (never joins a job's work: a worker's jobs go on whatever receivers do)."""
        self._thread = threading.Thread(target=self.run, name="lmdq-webhooks", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
