"""The store of progressive staging's lease (issue 44): a submit that makes jobs visible before the
last one is staged holds a lease on the batch, and writes the batch's custom_ids before any job is visible.

Keys (:class:`lmdq.redis.keys.Keys`): ``staging_lease`` (the submit's token, with a TTL it renews),
``request_ids`` (the custom_ids, in chunks), ``staging`` (the set of batches being staged, which the
noticers scan). What they mean, and who ends or resumes a batch whose lease lapsed, is the ledger's
(:mod:`lmdq.submission.ledger`, docs/reliability.md "A submit that dies while staging"); the commands and
their Lua are here, in the batches' store (tests/test_redis_boundary.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import redis

from lmdq.contract import BatchStatus
from lmdq.redis.keys import BatchField, Keys
from lmdq.redis.replies import reply_text
from lmdq.redis.scripts import LuaScript

__all__ = ["IDS_CHUNK", "StagingLeases"]

F = BatchField

IDS_CHUNK = 1000
"""custom_ids per element of the ``request_ids`` list: request ``i``'s id is element ``i // IDS_CHUNK``'s
entry ``i % IDS_CHUNK``."""

IDS_PUSH = 100
"""Id chunks per write while :meth:`StagingLeases.begin` pushes them: ~0.1 MB of ids in the client's buffer."""


class StagingLeases:
    """Staging leases, request-id lists and the staging set of one key prefix (thread-safe)."""

    def __init__(self, client: redis.Redis, *, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._renew = STAGING_RENEW.bind(client)
        self._acquire = STAGING_ACQUIRE.bind(client)
        self._claim_end = STAGING_CLAIM_END.bind(client)

    def begin(self, batch_id: str, token: str, *, lease_s: float, id_chunks: Iterable[str | bytes],
              ttl_s: int) -> None:
        """Before any job of the batch is visible: its custom_ids, then its lease (``token``), its
        progressive record (no job visible yet) and its entry in the staging set in one MULTI/EXEC.

        The ids are streamed (issue 44: the submitter's memory flat in the rows): :data:`IDS_PUSH` chunks
        a write, each renewing the list's TTL, all before the MULTI/EXEC that lists the batch, so a noticer
        never finds it listed without its ids; a submit that dies while pushing leaves an unlisted list
        that expires with ``ttl_s`` (docs/reliability.md, "A submit that dies while staging")."""
        ids = self.keys.request_ids(batch_id)
        self.client.delete(ids)
        pending: list[str | bytes] = []

        def push() -> None:
            with self.client.pipeline(transaction=False) as p:
                p.rpush(ids, *pending)
                p.expire(ids, ttl_s)
                p.execute()
            pending.clear()

        for chunk in id_chunks:
            pending.append(chunk)
            if len(pending) == IDS_PUSH:
                push()
        if pending:
            push()
        with self.client.pipeline(transaction=True) as p:
            p.set(self.keys.staging_lease(batch_id), token, px=max(1, int(lease_s * 1000)))
            p.hset(self.keys.batch(batch_id), mapping={F.visible_jobs.value: 0, F.visible_requests.value: 0})
            p.expire(ids, ttl_s)
            p.sadd(self.keys.staging(), batch_id)
            p.execute()

    def renew(self, batch_id: str, token: str, *, lease_s: float) -> bool:
        """Extend the lease while it is ``token``'s; False when it is not (lapsed or taken over)."""
        return bool(self._renew(keys=[self.keys.staging_lease(batch_id)], args=[token, max(1, int(lease_s * 1000))]))

    def acquire(self, batch_id: str, token: str, *, lease_s: float) -> int:
        """Take a lapsed lease over (a re-run of the same submit): 1 taken, 0 live, -2 not resumable."""
        return int(self._acquire(keys=[self.keys.staging_lease(batch_id), self.keys.batch(batch_id)],
                                 args=[token, max(1, int(lease_s * 1000))]))

    def leased(self, batch_id: str) -> bool:
        """Whether the batch's lease is live."""
        return bool(self.client.exists(self.keys.staging_lease(batch_id)))

    def claim_end(self, batch_id: str, reason: str) -> int:
        """Claim the end of a batch whose lease lapsed (replies: :data:`STAGING_CLAIM_END`)."""
        return int(self._claim_end(keys=[self.keys.staging_lease(batch_id), self.keys.batch(batch_id),
                                         self.keys.staging()], args=[batch_id, reason]))

    def mark_failed(self, batch_id: str, reason: str) -> bool:
        """Record why the batch's staging ended (``staging_failed``), unless a reason is there already."""
        return bool(self.client.hsetnx(self.keys.batch(batch_id), F.staging_failed.value, reason))

    def mark_answered(self, batch_id: str, now: float) -> None:
        """Every request no visible job holds has its result (``unstaged_answered``)."""
        self.client.hset(self.keys.batch(batch_id), F.unstaged_answered.value, now)

    def release(self, batch_id: str, token: str | None = None) -> None:
        """The batch is staged or ended: its ids, its entry in the staging set and (``token``'s, or any with
        None) its lease go."""
        lease = self.keys.staging_lease(batch_id)
        if token is not None and self.client.get(lease) not in (token, token.encode()):
            lease = ""
        with self.client.pipeline(transaction=False) as p:
            if lease:
                p.delete(lease)
            p.delete(self.keys.request_ids(batch_id))
            p.srem(self.keys.staging(), batch_id)
            p.execute()

    def pending(self) -> list[str]:
        """Batch ids in the staging set (decoded with replacement: untrusted)."""
        return sorted(reply_text(b) for b in self.client.smembers(self.keys.staging()))

    def id_chunk_count(self, batch_id: str) -> int:
        return int(self.client.llen(self.keys.request_ids(batch_id)))

    def ids(self, batch_id: str, first_chunk: int, last_chunk: int) -> list[list[str]]:
        """The id chunks ``first_chunk``..``last_chunk`` (inclusive); a chunk that is not a JSON list of
        strings reads as empty (untrusted)."""
        out: list[list[str]] = []
        for raw in self.client.lrange(self.keys.request_ids(batch_id), first_chunk, last_chunk):
            try:
                got = json.loads(raw)
            except ValueError:
                got = []
            out.append([str(x) for x in got] if isinstance(got, list) else [])
        return out


# ==== Lua: progressive staging's lease (issue 44; composed and run by lmdq.redis.scripts.LuaScript) ====

# KEYS: staging lease. ARGV: token, lease ms. 1: renewed; 0: the lease is not the token's (lapsed, or taken).
STAGING_RENEW = LuaScript("staging_renew", """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
""")

# KEYS: lease, batch hash. ARGV: token, lease ms. A re-run of the same submit takes a lapsed lease over:
# 1 taken; 0 the lease is live (another submit stages it); -2 the batch cannot be resumed (staged, ended, its
# staging ended by a noticer, or no record).
STAGING_ACQUIRE = LuaScript("staging_acquire", f"""
local b = redis.call('HMGET', KEYS[2], '{F.status}', '{F.staged_at}', '{F.staging_failed}', '{F.visible_jobs}')
local live = b[1] == '{BatchStatus.validating.value}' or b[1] == '{BatchStatus.queued.value}'
  or b[1] == '{BatchStatus.in_progress.value}'
if not live or b[2] or b[3] or not b[4] then return -2 end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
""")

# KEYS: lease, batch hash, staging set. ARGV: batch id, reason. Whoever notices a lapsed lease claims the
# batch's end once: 1 claimed (staging_failed set: neither its submit nor a re-run may commit any more);
# 0 the lease is live; -1 its staging had ended already (claimed, or failed in its submit); -2 not part-staged
# (staged, or no progressive record: it leaves the staging set).
STAGING_CLAIM_END = LuaScript("staging_claim_end", f"""
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('HEXISTS', KEYS[2], '{F.staged_at}') == 1 or redis.call('HEXISTS', KEYS[2], '{F.visible_jobs}') == 0
then
  redis.call('SREM', KEYS[3], ARGV[1])
  return -2
end
if redis.call('HSETNX', KEYS[2], '{F.staging_failed}', ARGV[2]) == 0 then return -1 end
return 1
""")
