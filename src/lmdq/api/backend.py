"""The one module that calls lmdq's producer code (submit, status, results, cancel).

The HTTP layer asks this adapter, never ``lmdq.producer`` or ``lmdq.results.store`` directly, so moving the
server onto the ``lmdq.Client`` Python API (issue #23) changes this file only. What it adds to those
calls is only what the CLI adds too: the settings they take (``lmdq-producer submit``'s flags come
from the same :class:`~lmdq.submission.settings.ProducerSettings`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from lmdq.api.settings import ApiSettings
from lmdq.contract import Batch
from lmdq.redis import server
from lmdq.redis.connection import connect
from lmdq.redis.keys import Keys
from lmdq.results.store import ResultStore

if TYPE_CHECKING:
    from lmdq.gates.config import GateConfig
    from lmdq.results.openai import BatchUsage
    from lmdq.submission.ledger import BatchLedger

__all__ = ["Backend"]


def _absolute(url: str | None) -> str | None:
    """A results folder made absolute, as ``lmdq-producer submit`` makes it: workers elsewhere share it
    by that path (``s3://`` and ``file://`` URLs are kept)."""
    if not url or "://" in url:
        return url
    return str(Path(url).expanduser().resolve())


class Backend:
    """lmdq's batches, as the API server sees them."""

    def __init__(self, settings: ApiSettings, client: redis.Redis | None = None) -> None:
        self.settings = settings
        # FastAPI runs sync handlers on a thread pool (40 threads): a blocking pool of that order makes
        # a burst of pollers wait for a connection instead of failing with "Too many connections".
        self.client = client if client is not None else connect(settings.redis_url, settings=settings,
                                                                max_connections=64)
        self.keys = Keys(settings.key_prefix)
        self.store = ResultStore(self.client, keys=self.keys, ttl_s=settings.result_ttl_s)

    def submit(self, path: Path, *, window_s: float | None, metadata: dict[str, str], idempotency_key: str,
               progress: Callable[[int], None] | None = None, deadline: float | None = None,
               gates: GateConfig | None = None, webhook: tuple[str, str, str] | None = None,
               reuse_ttl_s: int | None = None) -> Batch:
        """Validate the whole OpenAI Batch file and enqueue it (``lmdq-producer submit FILE``): all of it
        or, on :class:`~lmdq.errors.SubmitRejected` / :class:`~lmdq.errors.UnknownModel`, nothing.
        ``idempotency_key`` makes a re-run after a crash return the batch the first run made. ``webhook``: the
        API batch's (url, tenant, id), so a pause is told under the API's id (lmdq.webhooks)."""
        from lmdq.submission.formats import InputFormat, InputLimits
        from lmdq.submission.submit import SubmitOptions, submit_file

        s = self.settings
        opts = SubmitOptions(
            model=s.api_model,
            batch_size=s.batch_size,
            metadata=metadata,
            idempotency_key=idempotency_key,
            completion_window_s=window_s,
            known_models=s.known_models,
            limits=InputLimits.of(s),
            fmt=InputFormat.openai,
            results_url=_absolute(s.results_url),
            prefix_groups=s.prefix_groups,
            prefix_group_bytes=s.prefix_group_bytes,
            memory_fraction=s.memory_headroom_fraction,
            staging_lease_s=s.staging_lease_s,
            # an HTTP caller has no flag to pass: the model is LMDQ_API_MODEL or each line's body.model
            model_option="LMDQ_API_MODEL",
            allow_unknown_hint=None,
            # image_url parts (issue 48): local paths only inside LMDQ_API_IMAGE_ROOT, none without one
            image_root=str(s.api_image_root) if s.api_image_root is not None else None,
            allow_local_images=s.api_image_root is not None,
            max_image_bytes=s.max_image_bytes,
        )
        opts.deadline = deadline  # lmdq's extension field (issue 46)
        opts.gates = gates  # lmdq's extension field (issue 46): the canary spread over the whole file
        opts.reuse_ttl_s = reuse_ttl_s  # lmdq's extension fields (issue 47): reuse / reuse_ttl_s on create
        if webhook is not None:  # issue 48: (url, tenant, API batch id); lmdq's batch tells only of its pauses
            opts.webhook, opts.webhook_tenant, opts.webhook_as = webhook
        if gates is not None and gates.canary is not None:
            opts.first_jobs = None
        batch: Batch
        batch, _created = submit_file(path, opts, client=self.client, keys=self.keys, ttl_s=s.result_ttl_s,
                                      validate_progress=progress, enqueue_progress=progress,
                                      max_job_bytes=s.max_job_bytes)
        return batch

    def _ledger(self) -> BatchLedger:
        from lmdq.submission.ledger import BatchLedger

        s = self.settings
        return BatchLedger(self.client, keys=self.keys, ttl_s=s.result_ttl_s, max_job_bytes=s.max_job_bytes,
                           staging_lease_s=s.staging_lease_s)

    def notice_interrupted(self, batch_ids: Iterable[str] | None = None, *, keep_keys: Iterable[str] = ()) -> list[str]:
        """End the batches (``batch_ids``, or every one being staged) whose submit died while staging them and
        whose staging lease lapsed: their unstaged requests fail as ``submit_interrupted`` (issue 44). Those
        bound to ``keep_keys`` (idempotency keys a submission re-run is owed for) are left to that re-run."""
        ledger = self._ledger()
        keep = {b for b in (ledger.idempotency.bound(k) for k in keep_keys) if b}
        return ledger.notice_interrupted(batch_ids, keep=keep)

    def get(self, batch_id: str) -> Batch | None:
        """The batch (``lmdq-producer status``), or None once it is gone (purged, past its TTL)."""
        from lmdq.errors import BatchNotFound

        self.notice_interrupted([batch_id])
        try:
            return self.store.batches.get(batch_id)
        except BatchNotFound:
            return None

    def get_many(self, batch_ids: Iterable[str]) -> dict[str, Batch]:
        """Several batches in one round trip (a list page), by id; gone ones are left out."""
        return {b.id: b for b in self.store.batches.get_many(batch_ids)}

    def gates(self, batch_id: str) -> dict[str, Any] | None:
        """The batch's quality gates (``lmdq-producer status``' gates: verdict, report), None without."""
        st = self._ledger().gates.state(batch_id)
        return None if st is None else st.as_dict()

    def resume(self, batch_id: str) -> Batch:
        """``lmdq-producer resume``: a paused batch's held jobs run (SubmitRejected when not paused)."""
        return self._ledger().resume(batch_id)

    def cancel(self, batch_id: str) -> Batch:
        """``lmdq-producer cancel``: queued jobs off the queue, in-flight requests aborted."""
        from lmdq.submission.cancel import cancel_batch

        self.notice_interrupted([batch_id])
        batch: Batch = cancel_batch(self.client, self.keys, batch_id, ttl_s=self.settings.result_ttl_s)
        return batch

    def openai_lines(self, batch: Batch, usage: BatchUsage | None = None) -> Iterator[tuple[bool, bytes]]:
        """``lmdq-producer results --format openai``: one OpenAI Batch output line per request, in input
        order, as ``(is_error, line)`` (errors go to the error file); ``usage`` sums their tokens."""
        from lmdq.results.openai import iter_openai

        lines: Iterator[tuple[bool, bytes]] = iter_openai(self.store, batch, usage=usage)
        return lines

    def ping(self) -> bool:
        try:
            return server.ping(self.client)
        except redis.RedisError:
            return False
