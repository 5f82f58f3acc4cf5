"""Batches: OpenAI's batch object over an lmdq batch, with its own short life before and after it.

An API batch is a Redis hash (``<prefix>:api:batch:<id>``) owned by a tenant. It is created at once
(``validating``) and submitted in the background: the whole file is validated by lmdq's own submit
(:mod:`lmdq.api.backend`), then either an lmdq batch exists (its id is recorded) or the API batch
is ``failed`` with OpenAI's ``errors`` (line-numbered). A submission whose replica stopped is run
again by any replica once its lease lapses; the idempotency key (the API batch id) makes the re-run
return the batch the first run made, so nothing is enqueued twice.

When the lmdq batch ends, a replica writes its OpenAI-format output and error files (finalizing)
and records their ids; only then does the batch read ``completed`` / ``expired`` / ``cancelled``,
so a client that sees a terminal status can always download the files.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.typing import EncodableT

from lmdq.api.backend import Backend
from lmdq.api.batch_records import ApiBatchRecords
from lmdq.api.errors import bad_request, conflict, not_found
from lmdq.api.files import FileStore
from lmdq.api.paging import Page, page
from lmdq.contract import MAX_REUSE_TTL_S, Batch, BatchStatus, ErrorCode
from lmdq.errors import LmdqError, SubmitRejected, UnknownModel
from lmdq.gates.config import GateConfig, from_options
from lmdq.logs.config import get_logger
from lmdq.plan.deadlines import parse_deadline
from lmdq.redis.keys import Keys
from lmdq.results.openai import BatchUsage
from lmdq.webhooks.allow import AllowList, WebhookRefused
from lmdq.webhooks.signing import new_secret
from lmdq.webhooks.store import WebhookStore

__all__ = ["ENDPOINTS", "ApiBatches", "parse_window"]

log = get_logger("lmdq.api.batches")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/score", "/v1/reward", "/v1/embeddings")
_WINDOW = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_MAX_WINDOW_S = 365 * 86400
#: a submission that keeps failing for reasons not about its file (a bug) gives up after this many runs
MAX_SUBMIT_RUNS = 5
_FINALIZE_LEASE_S = 120
_MAX_ERRORS = 100


def parse_window(window: str) -> float:
    """``24h`` (OpenAI's only value), or any ``<n>s|m|h|d``: requests not started by then expire."""
    m = _WINDOW.match(window) if isinstance(window, str) and len(window) <= 32 else None
    seconds = float(m.group(1)) * _UNITS[m.group(2)] if m else 0.0
    if not m or not 0 < seconds <= _MAX_WINDOW_S:  # inf (a 400-digit number) included
        shown = window if not isinstance(window, str) or len(window) <= 32 else window[:32] + "..."
        raise bad_request(f"completion_window: expected a duration such as '24h' (or 90m, 7d; at most 365d), "
                          f"got {shown!r}", param="completion_window")
    return seconds


def _tenant_webhooks(spec: str) -> dict[str, str]:
    """LMDQ_API_WEBHOOKS (``tenant=URL,...``) as a dict; an entry without ``=`` is skipped."""
    out: dict[str, str] = {}
    for entry in spec.split(","):
        tenant, eq, url = entry.partition("=")
        if eq and tenant.strip() and url.strip():
            out[tenant.strip()] = url.strip()
    return out


def check_metadata(metadata: Any) -> dict[str, str]:
    """OpenAI's metadata rules (at most 16 pairs, keys <= 64 and values <= 512 characters), lmdq's too."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise bad_request("metadata: expected an object of string values", param="metadata")
    if len(metadata) > 16:
        raise bad_request(f"metadata: expected at most 16 keys, got {len(metadata)}", param="metadata")
    for k, v in metadata.items():
        if len(k) > 64 or len(v) > 512:
            raise bad_request(f"metadata: key {k[:64]!r}: keys are at most 64 and values at most 512 characters",
                              param="metadata")
    return dict(metadata)


#: how much of an input file :func:`first_model` reads to find its first line (a line is rarely larger)
_FIRST_LINE_BYTES = 1 << 20


def first_model(path: Path) -> str | None:
    """The ``body.model`` of the file's first line: the batch's ``model`` from its creation, as OpenAI
    shows it (lmdq's batch takes its model from the same line: the first model a file names). None when
    that line does not parse or names none; validation then says what is wrong with it."""
    try:
        with open(path, "rb") as f:
            head = f.readline(_FIRST_LINE_BYTES)
        body = json.loads(head).get("body")
        model = body.get("model") if isinstance(body, dict) else None
    except (OSError, ValueError, AttributeError):
        return None
    return model if isinstance(model, str) and model else None


def _idempotency_key(api_batch_id: str) -> str:
    """The idempotency key an API batch's submissions use: a re-run (another replica, a restart) finds the
    lmdq batch the first made, and resumes it if that one died while staging it."""
    return f"api-{api_batch_id}"


@dataclass
class Record:
    """The API batch hash, decoded (untrusted: a field that does not parse reads as missing)."""

    id: str
    tenant: str
    input_file_id: str
    endpoint: str
    completion_window: str
    window_s: float
    metadata: dict[str, str]
    created_at: int
    state: str  # validating | failed | submitted
    lmdq_id: str | None
    errors: list[dict[str, Any]] | None
    failed_at: int | None
    cancel_requested_at: int | None
    output_file_id: str | None
    error_file_id: str | None
    final_status: str | None
    finalized_at: int | None
    runs: int
    output_ttl_s: int | None
    model: str | None = None
    usage: dict[str, Any] | None = None
    #: lmdq's extension (issue 46): Unix time the batch should be done by
    deadline: float | None = None
    #: lmdq's extension (issue 46): the batch's quality gates (GateConfig JSON), as created
    gates: str | None = None
    #: lmdq's extension (issue 48): the URL told of the batch's end (its own, or its tenant's default)
    webhook: str | None = None
    #: lmdq's extension (issue 47): the batch's --reuse TTL in seconds (None: it does not reuse)
    reuse_ttl_s: int | None = None

    @classmethod
    def decode(cls, batch_id: str, raw: dict[Any, Any]) -> Record | None:
        try:
            d = {k.decode(): v.decode() for k, v in raw.items()}

            def opt_int(name: str) -> int | None:
                return int(float(d[name])) if d.get(name) else None

            return cls(id=batch_id, tenant=d["tenant"], input_file_id=d["input_file_id"], endpoint=d["endpoint"],
                       completion_window=d["completion_window"], window_s=float(d["window_s"]),
                       metadata=json.loads(d.get("metadata") or "{}"), created_at=int(d["created_at"]),
                       state=d["state"], lmdq_id=d.get("lmdq_id") or None,
                       errors=json.loads(d["errors"]) if d.get("errors") else None, failed_at=opt_int("failed_at"),
                       cancel_requested_at=opt_int("cancel_requested_at"),
                       output_file_id=d.get("output_file_id") or None, error_file_id=d.get("error_file_id") or None,
                       final_status=d.get("final_status") or None, finalized_at=opt_int("finalized_at"),
                       runs=int(d.get("runs") or 0), output_ttl_s=int(d.get("output_ttl_s") or 0) or None,
                       model=d.get("model") or None, usage=json.loads(d["usage"]) if d.get("usage") else None,
                       deadline=float(d["deadline"]) if d.get("deadline") else None,
                       gates=d.get("gates") or None, webhook=d.get("webhook") or None,
                       reuse_ttl_s=opt_int("reuse_ttl_s"))
        except (KeyError, ValueError, UnicodeDecodeError):
            return None


def _gates(gates: dict[str, Any] | None) -> str:
    """The ``gates`` extension field's GateConfig JSON ('' for none); one 400 line naming what is wrong."""
    if gates is None:
        return ""
    if not isinstance(gates, dict) or set(gates) - {"canary", "gate", "gate_window"}:
        raise bad_request("gates: expected an object with canary, gate (a list of KEY=VALUE), gate_window",
                          param="gates")
    canary, specs, window = gates.get("canary"), gates.get("gate"), gates.get("gate_window")
    if (canary is not None and not isinstance(canary, (str, int, float))) or isinstance(canary, bool) \
            or (specs is not None and not (isinstance(specs, list) and all(isinstance(x, str) for x in specs))) \
            or (window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1)):
        raise bad_request("gates: canary is '2%' or a count, gate a list of KEY=VALUE strings, gate_window a "
                          "count >= 1", param="gates")
    try:
        config = from_options(canary, specs, window)
    except ValueError as e:
        raise bad_request(f"gates: {str(e).replace('--gate-window', 'gate_window').replace('--', '')}",
                          param="gates") from None
    return config.model_dump_json(exclude_none=True) if config is not None else ""


def _text(v: object) -> str | None:
    return v.decode() if isinstance(v, bytes) else None if v is None else str(v)


def _int(t: float | None) -> int | None:
    return int(t) if t is not None else None


#: lmdq's input errors are ``<path>:<line>: field '<f>': <message>`` (lmdq.submission.formats.InputError)
_ERROR_LINE = re.compile(r"^(?P<path>.*?):(?P<line>\d+): (?P<rest>.*)$")
_FIELD = re.compile(r"^field '(?P<field>[^']*)': ")


def _error_code(field: str | None, message: str) -> ErrorCode:
    """OpenAI's batch error codes where one fits, else ``invalid_request``."""
    if field == "custom_id" and "missing" in message:  # not a duplicate: OpenAI's code for an absent field
        return ErrorCode.missing_required_parameter
    if field == "custom_id" and "unique" in message:
        return ErrorCode.duplicate_custom_id
    if field == "url":
        return ErrorCode.invalid_url
    if field in ("model", "body.model"):
        return ErrorCode.mismatched_model
    if field is not None and field.endswith(".image_url.url"):
        return ErrorCode.invalid_image
    if "JSON" in message:
        return ErrorCode.invalid_json_line
    return ErrorCode.invalid_request


def errors_from(exc: LmdqError, path: Path, shown_as: str) -> list[dict[str, Any]]:
    """OpenAI ``BatchError`` objects from an lmdq refusal: one per ``file:line`` error, the server's
    path replaced by the uploaded file's name (no server paths in answers)."""
    out: list[dict[str, Any]] = []
    for raw in str(exc).splitlines():
        text = raw.replace(str(path), shown_as)
        m = _ERROR_LINE.match(raw)
        line: int | None = None
        rest = text
        if m and m.group("path") == str(path):
            line = int(m.group("line")) or None
            rest = m.group("rest").replace(str(path), shown_as)
        elif raw.startswith(f"{path}: "):
            rest = raw[len(str(path)) + 2:].replace(str(path), shown_as)
        f = _FIELD.match(rest)
        field = f.group("field") if f else None
        code = ErrorCode.model_not_found if isinstance(exc, UnknownModel) else _error_code(field, rest)
        out.append({"code": code, "message": rest, "param": field, "line": line})
        if len(out) >= _MAX_ERRORS:
            break
    return out


def _endpoint_errors(path: Path, endpoint: str, shown_as: str) -> list[dict[str, Any]]:
    """Lines whose ``url`` is another endpoint than the batch's (OpenAI: every line must use it).
    Lines lmdq cannot parse are left to lmdq's validation, which names what is wrong with them."""
    out: list[dict[str, Any]] = []
    # only a line naming another endpoint (plain or with JSON's escaped slashes) is parsed: the rest
    # cannot have it as their url, and most files have none, so this pass costs a substring search
    others = [u for u in ENDPOINTS if u != endpoint]
    needles = [n for u in others for n in (u.encode(), u.replace("/", "\\/").encode())]
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not any(x in raw for x in needles):
                continue
            try:
                url = json.loads(raw).get("url")
            except (ValueError, AttributeError):
                continue
            if url in others:
                out.append({"code": ErrorCode.invalid_url, "param": "url", "line": n,
                            "message": f"field 'url': expected {endpoint!r} (the batch's endpoint), got {url!r}"})
                if len(out) >= _MAX_ERRORS:
                    break
    return out


class ApiBatches:
    def __init__(self, backend: Backend, files: FileStore, *, prefix: str, ttl_s: int,
                 schedule: Callable[[Callable[[], None], str], None]) -> None:
        self.backend = backend
        self.client: redis.Redis = backend.client
        self.files = files
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.schedule = schedule
        self.records = ApiBatchRecords(self.client, Keys(prefix))
        #: LMDQ_API_SUBMIT_LEASE_S: how long a replica's hold on a submission lasts unrenewed
        self._submit_lease_s = int(backend.settings.api_submit_lease_s)

    # ---- records ------------------------------------------------------------------------------
    def _load(self, batch_id: str) -> Record | None:
        raw = self.records.read(batch_id)
        return Record.decode(batch_id, raw) if raw else None

    def get_record(self, tenant: str, batch_id: str) -> Record:
        rec = self._load(batch_id) if batch_id.startswith("batch_") and len(batch_id) < 64 else None
        if rec is None or rec.tenant != tenant:
            raise not_found("batch", batch_id)
        return rec

    # ---- API operations -------------------------------------------------------------------------
    def create(self, tenant: str, *, input_file_id: str, endpoint: str, completion_window: str,
               metadata: Any, output_ttl_s: int | None = None, deadline: str | float | None = None,
               gates: dict[str, Any] | None = None, webhook: str | None = None, reuse: bool | None = None,
               reuse_ttl_s: int | None = None) -> dict[str, Any]:
        if endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint: expected one of {', '.join(ENDPOINTS)}, got {endpoint!r}", param="endpoint")
        window_s = parse_window(completion_window)
        try:
            deadline_at = parse_deadline(deadline)
        except ValueError as e:
            raise bad_request(f"deadline: {e}", param="deadline") from None
        meta = check_metadata(metadata)
        gate_json = _gates(gates)
        reuse_ttl = self._reuse_ttl(reuse, reuse_ttl_s)
        hook = self._webhook(tenant, webhook)
        f = self.files.get(tenant, input_file_id)
        if f.purpose != "batch":
            raise bad_request(f"input_file_id: file {input_file_id!r} has purpose {f.purpose!r}, expected 'batch'",
                              param="input_file_id")
        batch_id = "batch_" + secrets.token_hex(12)
        now = int(time.time())
        # LMDQ_API_MODEL wins over body.model, as lmdq's submit has it
        model = self.backend.settings.api_model or first_model(self.files.path(input_file_id))
        self.records.create(batch_id, tenant, {
            "input_file_id": input_file_id, "endpoint": endpoint, "model": model or "",
            "completion_window": completion_window, "window_s": window_s, "metadata": json.dumps(meta),
            "created_at": now, "state": "validating", "runs": 0, "output_ttl_s": output_ttl_s or 0,
            "deadline": deadline_at or "", "gates": gate_json, "webhook": hook or "",
            "reuse_ttl_s": reuse_ttl or ""},
            ttl_s=self.ttl_s, created=time.time())  # sub-second: a list keeps creation order
        log.info("batch created", batch=batch_id, tenant=tenant, input_file=input_file_id, endpoint=endpoint)
        self.schedule(functools.partial(self.submit, batch_id), f"submit:{batch_id}")
        return self.view(self.get_record(tenant, batch_id))

    def _reuse_ttl(self, reuse: bool | None, ttl_s: int | None) -> int | None:
        """The ``reuse`` / ``reuse_ttl_s`` extension fields (issue 47) as submit's ``reuse_ttl_s``: None when the
        batch does not reuse (``reuse`` false, or omitted and LMDQ_REUSE off); a 400 line for a TTL out of range."""
        s = self.backend.settings
        if ttl_s is not None and (isinstance(ttl_s, bool) or not 60 <= ttl_s <= MAX_REUSE_TTL_S):
            raise bad_request(f"reuse_ttl_s: expected 60 to {MAX_REUSE_TTL_S} seconds, got {ttl_s!r}",
                              param="reuse_ttl_s")
        if not (s.reuse if reuse is None else reuse):
            if ttl_s is not None and reuse is False:
                raise bad_request("reuse_ttl_s: given with reuse false", param="reuse_ttl_s")
            return None
        return ttl_s if ttl_s is not None else s.reuse_ttl_s

    def _webhook(self, tenant: str, given: str | None) -> str | None:
        """The batch's webhook: its own, else its tenant's default (LMDQ_API_WEBHOOKS); a 400 unless
        LMDQ_WEBHOOK_ALLOW admits it. The tenant's signing secret is made here if it has none."""
        s = self.backend.settings
        url = given or _tenant_webhooks(s.api_webhooks).get(tenant)
        if not url:
            return None
        try:
            url = AllowList(s.webhook_allow).check(url)
        except WebhookRefused as e:
            raise bad_request(f"webhook: {e}", param="webhook") from None
        WebhookStore(self.client, keys=Keys(self.prefix)).ensure_secret(tenant, new_secret())
        return url

    def _end_event(self, rec: Record, kind: str) -> tuple[str, str, str, float] | None:
        """What :meth:`ApiBatchRecords.finish` needs to announce ``rec``'s end (None: it has no webhook)."""
        return (kind, rec.webhook, rec.tenant, time.time()) if rec.webhook else None

    def retrieve(self, tenant: str, batch_id: str) -> dict[str, Any]:
        return self.view(self.get_record(tenant, batch_id))

    def list_page(self, tenant: str, *, after: str | None, limit: int) -> Page[dict[str, Any]]:
        def load(ids: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
            raws = self.records.read_many(ids)
            recs = [Record.decode(i, raw) if raw else None for i, raw in zip(ids, raws)]
            gone = [i for i, r in zip(ids, recs) if r is None or r.tenant != tenant]
            mine = [r for r in recs if r is not None and r.tenant == tenant]
            lmdq = self.backend.get_many(r.lmdq_id for r in mine if r.lmdq_id)
            return [self.view(r, lmdq.get(r.lmdq_id) if r.lmdq_id else None, fetch=False) for r in mine], gone

        return page(self.client, self.records.index(tenant), after=after, limit=limit, newest_first=True, load=load,
                    what="batch")

    def resume(self, tenant: str, batch_id: str) -> dict[str, Any]:
        """lmdq's extension (issue 46): the rest of a batch a quality gate paused runs (409 otherwise)."""
        rec = self.get_record(tenant, batch_id)
        shown = self.view(rec)
        if shown.get("lmdq_status") != "paused" or not rec.lmdq_id:
            raise conflict(f"Cannot resume a batch with status {shown['status']!r}: only a paused one "
                           "(lmdq_status 'paused').")
        try:
            self.backend.resume(rec.lmdq_id)
        except SubmitRejected as e:  # resumed or ended meanwhile
            raise conflict(str(e)) from None
        log.info("batch resumed", batch=batch_id, tenant=tenant)
        return self.view(self.get_record(tenant, batch_id))

    def cancel(self, tenant: str, batch_id: str) -> dict[str, Any]:
        rec = self.get_record(tenant, batch_id)
        shown = self.view(rec)
        if shown["status"] in ("cancelling", "cancelled"):
            return shown
        if shown["status"] in ("completed", "failed", "expired", "finalizing"):
            raise conflict(f"Cannot cancel a batch with status {shown['status']!r}.")
        self.records.set_once(batch_id, "cancel_requested_at", int(time.time()))
        rec = self.get_record(tenant, batch_id)  # the submission may have landed meanwhile
        if rec.lmdq_id:
            self.backend.cancel(rec.lmdq_id)
        log.info("batch cancel requested", batch=batch_id, tenant=tenant)
        return self.view(rec)

    # ---- the OpenAI view ---------------------------------------------------------------------------
    def view(self, rec: Record, b: Batch | None = None, *, fetch: bool = True) -> dict[str, Any]:
        """OpenAI's ``batch`` object (``openai.types.Batch``)."""
        if b is None and fetch and rec.lmdq_id:
            b = self.backend.get(rec.lmdq_id)
        counts = {"total": 0, "completed": 0, "failed": 0}
        out: dict[str, Any] = {
            "id": rec.id, "object": "batch", "endpoint": rec.endpoint, "errors": None,
            "input_file_id": rec.input_file_id, "completion_window": rec.completion_window,
            "status": "validating", "output_file_id": rec.output_file_id, "error_file_id": rec.error_file_id,
            "created_at": rec.created_at, "in_progress_at": None,
            "expires_at": rec.created_at + int(rec.window_s), "finalizing_at": None, "completed_at": None,
            "failed_at": rec.failed_at, "expired_at": None, "cancelling_at": rec.cancel_requested_at,
            "cancelled_at": None, "request_counts": counts, "metadata": rec.metadata or None,
            "model": rec.model, "usage": rec.usage,
        }
        if rec.deadline is not None:  # lmdq's extension field (issue 46), only when the batch has one
            out["deadline"] = rec.deadline
        if rec.reuse_ttl_s is not None:  # lmdq's extension field (issue 47), only when the batch reuses
            out["reuse_ttl_s"] = rec.reuse_ttl_s
        if rec.gates is not None:  # lmdq's extension fields (issue 46), only when the batch has gates
            out["lmdq_gates"] = self.backend.gates(rec.lmdq_id) if rec.lmdq_id else None
        if rec.state == "failed":
            out["status"] = "failed"
            out["errors"] = {"object": "list", "data": rec.errors or []}
            return out
        if rec.state == "validating":
            out["status"] = "cancelling" if rec.cancel_requested_at else "validating"
            return out
        if b is None:  # submitted, but the lmdq batch is gone (purged, or past its TTL)
            if rec.final_status:
                out["status"] = rec.final_status
                self._final_stamps(out, rec)
                return out
            out["status"] = "failed"
            out["errors"] = {"object": "list", "data": [{"code": ErrorCode.batch_gone, "line": None, "param": None,
                                                         "message": "the lmdq batch behind this batch was deleted"}]}
            return out
        c = b.request_counts
        counts.update(total=c.total, completed=c.completed, failed=c.failed + c.cancelled + c.expired)
        out["model"] = b.model or rec.model
        if b.model_counts:  # lines naming several models: the batch's counts per model, as request_counts
            out["request_counts_by_model"] = {
                m: {"total": mc.total, "completed": mc.completed, "failed": mc.failed + mc.cancelled + mc.expired}
                for m, mc in b.model_counts.items()}
        out["in_progress_at"] = _int(b.in_progress_at or b.queued_at)
        out["expires_at"] = _int(b.expires_at) or out["expires_at"]
        out["cancelling_at"] = _int(b.cancelling_at) or rec.cancel_requested_at
        ended_at = _int(b.completed_at or b.expired_at or b.cancelled_at)
        if rec.final_status:
            out["status"] = rec.final_status
            self._final_stamps(out, rec, ended_at)
        elif b.status.terminal:  # ended; its output files are being written
            out["status"] = "cancelling" if b.status is BatchStatus.cancelled else "finalizing"
            if b.status is not BatchStatus.cancelled:
                out["finalizing_at"] = ended_at
        elif b.status is BatchStatus.cancelling or rec.cancel_requested_at:
            out["status"] = "cancelling"
        else:
            out["status"] = "in_progress"
            if b.status is BatchStatus.paused:  # OpenAI has no such status: in_progress, and lmdq's own word
                out["lmdq_status"] = "paused"
        return out

    @staticmethod
    def _final_stamps(out: dict[str, Any], rec: Record, ended_at: int | None = None) -> None:
        st = rec.final_status
        if st == "completed":
            out["finalizing_at"] = ended_at or rec.finalized_at
            out["completed_at"] = rec.finalized_at
        elif st == "expired":
            out["finalizing_at"] = ended_at or rec.finalized_at
            out["expired_at"] = rec.finalized_at
        elif st == "cancelled":
            out["cancelled_at"] = rec.finalized_at
        elif st == "failed":
            out["failed_at"] = rec.finalized_at

    # ---- background work: submit, finalize ------------------------------------------------------------
    def _take_lease(self, batch_id: str, ttl_s: int) -> str | None:
        token = secrets.token_hex(8)
        return token if self.records.take_lease(batch_id, token, ttl_s) else None

    def _renew(self, batch_id: str, token: str, ttl_s: int) -> None:
        self.records.renew_lease(batch_id, token, ttl_s)

    def _drop_lease(self, batch_id: str, token: str, *, hold_s: int = 0) -> None:
        """Release the lease, or with ``hold_s`` keep it that long: the back-off before a re-run of
        work that raised (so a lasting fault is retried every so often, not in a tight loop)."""
        with contextlib.suppress(redis.RedisError):  # Redis away: the lease lapses by itself
            self.records.drop_lease(batch_id, token, hold_s=hold_s)

    def _fail(self, rec: Record, errors: list[dict[str, Any]]) -> None:
        now = int(time.time())
        self.records.finish(rec.id, {"state": "failed", "errors": json.dumps(errors), "failed_at": now},
                            event=self._end_event(rec, "failed"))
        log.info("batch failed validation", batch=rec.id, tenant=rec.tenant, errors=len(errors))

    def submit(self, batch_id: str) -> None:
        """Validate and enqueue a ``validating`` batch (a background thread). Only one replica at a time
        (a lease); a fault (Redis away, the process stopping) leaves it ``validating`` for a re-run."""
        token = self._take_lease(batch_id, self._submit_lease_s)
        if token is None:
            return
        hold_s = 0
        try:
            rec = self._load(batch_id)
            if rec is None or rec.state != "validating":
                return
            runs = self.records.count_run(batch_id)
            if runs > MAX_SUBMIT_RUNS:
                last = self.records.field(batch_id, "last_error")
                self._fail(rec, [{"code": ErrorCode.internal_error, "line": None, "param": None,
                                  "message": f"the server could not submit this batch in {MAX_SUBMIT_RUNS} tries "
                                             f"(last: {_text(last) or 'unknown'}); see lmdq-api's log"}])
                return
            try:
                self._submit(rec, token)
            except Exception as e:  # a fault, not about the file: re-run after a back-off
                hold_s = min(300, 5 * 2 ** runs)
                with contextlib.suppress(redis.RedisError):
                    self.records.update(batch_id, {"last_error": type(e).__name__})  # no text: may hold hosts
                raise
        finally:
            self._drop_lease(batch_id, token, hold_s=hold_s)

    def _submit(self, rec: Record, token: str) -> None:
        try:
            frec = self.files.get(rec.tenant, rec.input_file_id)
            path = self.files.path(rec.input_file_id)
        except Exception:
            self._fail(rec, [{"code": ErrorCode.invalid_file, "line": None, "param": "input_file_id",
                              "message": f"input file {rec.input_file_id!r} no longer exists"}])
            return
        shown = frec.filename
        try:
            errors = _endpoint_errors(path, rec.endpoint, shown)
        except OSError:
            errors = [{"code": ErrorCode.invalid_file, "line": None, "param": "input_file_id",
                       "message": f"input file {rec.input_file_id!r} can no longer be read"}]
        if errors:
            self._fail(rec, errors)
            return
        last = [time.monotonic()]

        def progress(_n: int) -> None:  # a long validation keeps its lease
            if time.monotonic() - last[0] > self._submit_lease_s / 4:
                last[0] = time.monotonic()
                self._renew(rec.id, token, self._submit_lease_s)

        meta = dict(rec.metadata)
        try:
            batch = self.backend.submit(path, window_s=rec.window_s, metadata=meta, deadline=rec.deadline,
                                        gates=GateConfig.model_validate_json(rec.gates) if rec.gates else None,
                                        idempotency_key=_idempotency_key(rec.id), progress=progress,
                                        reuse_ttl_s=rec.reuse_ttl_s,
                                        webhook=(rec.webhook, rec.tenant, rec.id) if rec.webhook else None)
        except (SubmitRejected, UnknownModel) as e:  # about the file: the batch fails, with its lines
            self._fail(rec, errors_from(e, path, shown))
            return
        self.records.update(rec.id, {"state": "submitted", "lmdq_id": batch.id})
        log.info("batch submitted", batch=rec.id, tenant=rec.tenant, lmdq_batch=batch.id,
                 requests=batch.request_counts.total)
        if self.records.has_field(rec.id, "cancel_requested_at"):
            self.backend.cancel(batch.id)

    def finalize(self, batch_id: str) -> None:
        """Write an ended batch's output and error files, then show it ended (a background thread)."""
        token = self._take_lease(batch_id, _FINALIZE_LEASE_S)
        if token is None:
            return
        hold_s = 30  # unless it ends well: a write that raised (disk full, Redis away) waits this long
        try:
            rec = self._load(batch_id)
            if rec is None or rec.state != "submitted" or rec.final_status or not rec.lmdq_id:
                hold_s = 0
                return
            b = self.backend.get(rec.lmdq_id)
            if b is None or not b.status.terminal:
                hold_s = 0
                return
            usage = BatchUsage()
            out_id, err_id = self._write_outputs(rec, b, token, usage)
            now = int(time.time())
            fields: dict[str, EncodableT] = {"final_status": b.status.value, "finalized_at": now,
                                             "usage": json.dumps(usage.to_openai())}
            if out_id:
                fields["output_file_id"] = out_id
            if err_id:
                fields["error_file_id"] = err_id
            # the API's batch ends here, once its files exist: its webhook tells of it now (not at lmdq's end)
            self.records.finish(batch_id, fields, event=self._end_event(rec, b.status.value))
            c = b.request_counts
            log.info("batch finalized", batch=batch_id, tenant=rec.tenant, status=b.status.value, total=c.total,
                     completed=c.completed, output_file=out_id, error_file=err_id)
            hold_s = 0
        finally:
            self._drop_lease(batch_id, token, hold_s=hold_s)

    def _write_outputs(self, rec: Record, b: Batch, token: str, usage: BatchUsage) -> tuple[str | None, str | None]:
        """Both files in one pass over the results, in input order, summing ``usage`` as they go; an empty
        one is not kept (its id stays null, as OpenAI's does)."""
        fs = self.files
        out_id, out, out_tmp = fs.open_new()
        err_id, err, err_tmp = fs.open_new()
        counts = [0, 0]
        try:
            for n, (is_error, line) in enumerate(self.backend.openai_lines(b, usage), start=1):
                (err if is_error else out).write(line)
                counts[is_error] += 1
                if n % 10_000 == 0:
                    self._renew(rec.id, token, _FINALIZE_LEASE_S)
            kept: list[str | None] = []
            for fid, f, tmp, name, n in ((out_id, out, out_tmp, "output", counts[0]),
                                         (err_id, err, err_tmp, "errors", counts[1])):
                if n:
                    fs.commit(fid, f, tmp, tenant=rec.tenant, filename=f"{rec.id}_{name}.jsonl",
                              purpose="batch_output", ttl_s=rec.output_ttl_s)
                    kept.append(fid)
                else:
                    fs.discard(f, tmp)
                    kept.append(None)
            return kept[0], kept[1]
        except BaseException:
            fs.discard(out, out_tmp)
            fs.discard(err, err_tmp)
            raise

    def sweep_open(self) -> Iterator[tuple[str, Callable[[], None]]]:
        """The background work open batches need now, as (key, work): a submission no replica holds
        (its replica stopped) and ended batches whose files are not written yet. Batches whose submit died
        while staging them (any replica's, the CLI's too) are ended first once their staging lease lapsed."""
        ids = self.records.open_ids()
        recs = {i: (Record.decode(i, raw) if raw else None, leased)
                for i, (raw, leased) in zip(ids, self.records.open_records(ids))} if ids else {}
        # ... except those a submission of ours still owes a re-run: that re-run resumes them (same key, same file)
        self.backend.notice_interrupted(keep_keys=[_idempotency_key(i) for i, (r, _) in recs.items()
                                                   if r is not None and r.state == "validating"])
        if not ids:
            return
        gone = [i for i, (r, _) in recs.items() if r is None or r.state == "failed" or r.final_status]
        self.records.drop_open(gone)
        submitted = {i: r for i, (r, _) in recs.items() if r is not None and r.state == "submitted" and r.lmdq_id}
        lmdq = self.backend.get_many(r.lmdq_id for r in submitted.values() if r.lmdq_id)
        for i, (r, leased) in recs.items():
            if r is None or leased:
                continue
            if r.state == "validating":
                yield f"submit:{i}", functools.partial(self.submit, i)
            elif i in submitted:
                b = lmdq.get(r.lmdq_id or "")
                if b is not None and b.status.terminal:
                    yield f"finalize:{i}", functools.partial(self.finalize, i)
