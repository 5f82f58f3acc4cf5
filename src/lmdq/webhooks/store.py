"""The webhook outbox in Redis: its Lua and its commands (the store of :mod:`lmdq.webhooks`).

Why an outbox, written by Lua: an event must be neither lost nor created twice. The step that ends a batch
is one Lua script (``TRANSITION`` in :mod:`lmdq.batches.records`, ``WRITE_RESULTS`` in
:mod:`lmdq.results.store`); both run :data:`WEBHOOK_EVENT` right after ``lmdq_batch_ended``, so the status
move and the event are one atomic step: there is no moment where the batch has ended and no event exists
(a crash between "ended" and "send" cannot lose it), and the batch hash remembers the end it announced
(field ``webhook_ended``, HSETNX), so a second end of the same batch (a late result after a cancel, a
status moved again) cannot make a second event: one terminal event per batch, the first. The event's id
is its batch's id and kind (``evt_<batch>_<kind>``; a pause, which may happen again, adds its count), so
even a replay of the script produces the same id, and a receiver deduplicates on ``webhook-id``.

Delivery is leased (:data:`CLAIM`): a claim moves the event's due time one lease ahead and records a
token; the result of a try counts only with that token (:data:`FINISH`). A deliverer SIGKILLed mid-try
holds the event until its lease lapses, then any deliverer (a worker's delivery thread, the API's) takes
it again: at least once, never lost; a slow deliverer that lost its lease sends the same id again at
worst. Tries are counted at claim, so an event that kills its deliverer still runs out of tries.

Keys (:class:`~lmdq.redis.keys.Keys`): ``webhook_events`` (id -> JSON), ``webhook_due`` (id -> next try,
server ms), ``webhook_leases``, ``webhook_tries``, ``webhook_dead``, ``webhook_secrets``.

For canary's ``paused`` state (issue 48's brief): a script that pauses a batch adds :data:`WEBHOOK_EVENT`
to its ``uses=`` and calls ``lmdq_webhook_event(batch_key, 'paused')`` in the same script as the status
move (it returns the event id, or nil for a batch without a webhook); each call makes a new
``batch.paused`` event (``evt_<batch>_paused_<n>``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis

from lmdq.redis.keys import BatchField, Keys
from lmdq.redis.replies import reply_text
from lmdq.redis.scripts import Fragment, LuaScript

__all__ = ["ADD_EVENT", "CLAIM", "FINISH", "WEBHOOK_EVENT", "Claimed", "WebhookStore", "event_body", "queue_event"]

F = BatchField

# The event, built in Lua from the batch record: a batch whose meta JSON names a ``webhook`` (its URL) and
# ``webhook_tenant`` (whose secret signs it; absent: 'default'); ``webhook_as``: the HTTP API batch it runs.
# The body is fixed here, once (every retry sends the same bytes); the timestamp is the try's (Standard
# Webhooks signs id.timestamp.body).
WEBHOOK_EVENT = Fragment("webhook_event", f"""
local function lmdq_webhook_event(batch, kind)
  local meta = redis.call('HGET', batch, '{F.meta}')
  if not meta then return nil end
  local ok, m = pcall(cjson.decode, meta)
  if not ok or type(m) ~= 'table' or type(m['webhook']) ~= 'string' then return nil end
  local prefix, id = string.match(batch, '^(.*):batch:([^:]+)$')
  if not prefix then return nil end
  if type(m['webhook_as']) == 'string' then
    -- the HTTP API's batch: its events name the API's id, and its end is announced by the API once its
    -- output files exist (lmdq.api.batches); only a pause is told from here
    if kind ~= 'paused' then return nil end
    id = m['webhook_as']
  end
  local evt = 'evt_' .. id .. '_' .. kind
  if kind == 'paused' then
    evt = evt .. '_' .. redis.call('HINCRBY', batch, 'webhook_pauses', 1)
  elseif redis.call('HSETNX', batch, 'webhook_ended', evt) == 0 then
    return nil
  end
  local t = redis.call('TIME')
  local tenant = m['webhook_tenant']
  if type(tenant) ~= 'string' then tenant = 'default' end
  local body = cjson.encode({{id = evt, object = 'event', type = 'batch.' .. kind,
                              created_at = tonumber(t[1]), data = {{id = id}}}})
  local rec = cjson.encode({{url = m['webhook'], tenant = tenant, body = body}})
  if redis.call('HSETNX', prefix .. ':webhooks:events', evt, rec) == 1 then
    redis.call('ZADD', prefix .. ':webhooks:due', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), evt)
  end
  return evt
end
""")
"""Lua: ``lmdq_webhook_event(batch_key, kind)`` puts a ``batch.<kind>`` event for the batch into the outbox
(kind: completed, failed, cancelled, expired, paused); nil for a batch without a webhook, or one whose end
was announced already. Call it in the script that moves the status."""

# KEYS: events, due. ARGV: event id, url, tenant, body. An event made outside a batch's Lua (the HTTP API's
# batch.failed for a batch that never reached the queue). 1: added, 0: that id exists already.
ADD_EVENT = LuaScript("webhook_add_event", """
local rec = cjson.encode({url = ARGV[2], tenant = ARGV[3], body = ARGV[4]})
if redis.call('HSETNX', KEYS[1], ARGV[1], rec) == 0 then return 0 end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[2], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), ARGV[1])
return 1
""")

# KEYS: due, events, leases, tries. ARGV: max events, lease ms, token. Returns id, record, tries, ... for
# each event due now: each moved a lease ahead, its token recorded, its tries counted. An id whose record
# is gone (delivered meanwhile) leaves the schedule.
CLAIM = LuaScript("webhook_claim", """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for _, e in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))) do
  local rec = redis.call('HGET', KEYS[2], e)
  if rec then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), e)
    redis.call('HSET', KEYS[3], e, ARGV[3])
    out[#out + 1] = e
    out[#out + 1] = rec
    out[#out + 1] = redis.call('HINCRBY', KEYS[4], e, 1)
  else
    redis.call('ZREM', KEYS[1], e)
    redis.call('HDEL', KEYS[3], e)
    redis.call('HDEL', KEYS[4], e)
  end
end
return out
""")

# KEYS: due, events, leases, tries, dead. ARGV: id, token, outcome (ok | retry | dead), delay ms, error.
# 0: the token no longer holds the event (its lease lapsed and another deliverer took it): nothing changes.
FINISH = LuaScript("webhook_finish", """
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[3], ARGV[1])
if ARGV[3] == 'retry' then
  local t = redis.call('TIME')
  redis.call('ZADD', KEYS[1], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[4]), ARGV[1])
  return 1
end
if ARGV[3] == 'dead' then
  local rec = redis.call('HGET', KEYS[2], ARGV[1])
  if rec then
    redis.call('HSET', KEYS[5], ARGV[1], cjson.encode({event = rec, error = ARGV[5],
               tries = tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0')}))
  end
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
return 1
""")


def event_body(event_id: str, kind: str, batch_id: str, created_at: int) -> str:
    """An event's JSON, the shape :data:`WEBHOOK_EVENT` builds in Lua (OpenAI's webhook events)."""
    return json.dumps({"id": event_id, "object": "event", "type": f"batch.{kind}", "created_at": int(created_at),
                       "data": {"id": batch_id}}, separators=(",", ":"))


def queue_event(pipe: Any, keys: Keys, *, batch_id: str, kind: str, url: str, tenant: str, now: float) -> str:
    """Queue on ``pipe`` (a MULTI pipeline: the event lands with the state change it announces, or neither
    does) the ``batch.<kind>`` event of a batch whose state lives outside the batch record (the HTTP API's
    own batches). Its id is ``evt_<batch>_<kind>``: a second call makes nothing (HSETNX). Returns the id."""
    event_id = f"evt_{batch_id}_{kind}"
    ADD_EVENT(keys=[keys.webhook_events(), keys.webhook_due()],
              args=[event_id, url, tenant, event_body(event_id, kind, batch_id, int(now))], client=pipe)
    return event_id


@dataclass(frozen=True)
class Claimed:
    """One event a deliverer holds: its id, where it goes, whose secret signs it, its body, this try's number."""

    id: str
    url: str
    tenant: str
    body: str
    tries: int


class WebhookStore:
    """The outbox and the tenants' secrets of one key prefix (thread-safe: redis-py clients are)."""

    def __init__(self, client: redis.Redis, *, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    def _ks(self) -> list[str]:
        k = self.keys
        return [k.webhook_due(), k.webhook_events(), k.webhook_leases(), k.webhook_tries(), k.webhook_dead()]

    def add(self, event_id: str, *, url: str, tenant: str, body: str) -> bool:
        """Put an event made outside a batch script into the outbox; False: that id is there already."""
        got = ADD_EVENT(keys=[self.keys.webhook_events(), self.keys.webhook_due()],
                        args=[event_id, url, tenant, body], client=self.client)
        return bool(got == 1)

    def claim(self, n: int, *, lease_s: float, token: str) -> list[Claimed]:
        """Up to ``n`` events due now, each leased to ``token`` for ``lease_s``. Records that do not decode
        (untrusted: Redis is shared) are skipped; they stay until their tries run out."""
        reply = CLAIM(keys=self._ks()[:4], args=[n, int(lease_s * 1000), token], client=self.client)
        out: list[Claimed] = []
        if not isinstance(reply, list):
            return out
        for i in range(0, len(reply) - 2, 3):
            try:
                rec = json.loads(reply[i + 1])
                out.append(Claimed(id=reply_text(reply[i]), url=str(rec["url"]), tenant=str(rec["tenant"]),
                                   body=str(rec["body"]), tries=int(reply[i + 2])))
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def finish(self, event_id: str, *, token: str, outcome: str, delay_s: float = 0.0, error: str = "") -> bool:
        """The try's result: ``ok`` (delivered: gone), ``retry`` (due again in ``delay_s``), ``dead`` (tries
        ran out: kept in ``webhook_dead``). False: the lease was lost; another deliverer holds the event."""
        got = FINISH(keys=self._ks(), args=[event_id, token, outcome, int(delay_s * 1000), error[:500]],
                     client=self.client)
        return bool(got == 1)

    def pending(self) -> list[str]:
        """Ids of the events not yet delivered (nor given up on)."""
        return [reply_text(x) for x in self.client.zrange(self.keys.webhook_due(), 0, -1)]

    def dead(self) -> dict[str, Any]:
        """Events whose tries ran out: id -> {event, error, tries}."""
        out: dict[str, Any] = {}
        for k, v in dict(self.client.hgetall(self.keys.webhook_dead())).items():
            try:
                out[reply_text(k)] = json.loads(v)
            except ValueError:
                continue
        return out

    # ---- secrets -----------------------------------------------------------------------------
    def secret(self, tenant: str) -> str | None:
        """The tenant's signing secret, or None while it has none."""
        v = self.client.hget(self.keys.webhook_secrets(), tenant)
        return None if v is None else reply_text(v)

    def ensure_secret(self, tenant: str, fresh: str) -> str:
        """The tenant's secret; ``fresh`` becomes it when it has none (HSETNX: two first submits agree)."""
        self.client.hsetnx(self.keys.webhook_secrets(), tenant, fresh)
        got = self.secret(tenant)
        return fresh if got is None else got

    def set_secret(self, tenant: str, secret: str) -> None:
        """Replace the tenant's secret (rotation: events signed from now on use it)."""
        self.client.hset(self.keys.webhook_secrets(), tenant, secret)
