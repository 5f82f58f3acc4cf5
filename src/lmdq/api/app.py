"""The FastAPI application: routes, auth, OpenAI-shaped errors, health and metrics.

Handlers are thin: files go to :class:`~lmdq.api.files.FileStore`, batches to
:class:`~lmdq.api.batches.ApiBatches`. Sync handlers run on Starlette's thread pool (Redis calls
block); the upload is async so its body can be parsed as it streams in.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

import redis
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from lmdq.api.auth import KeyRing
from lmdq.api.backend import Backend
from lmdq.api.batches import ApiBatches
from lmdq.api.errors import ApiError, error_body, unauthorized
from lmdq.api.files import FileStore, check_purpose, expires_after
from lmdq.api.settings import ApiSettings
from lmdq.api.uploads import FormStream, boundary_of
from lmdq.contract import ErrorCode
from lmdq.logs.config import get_logger
from lmdq.redis.keys import Keys
from lmdq.webhooks.delivery import Deliverer, DeliveryPolicy
from lmdq.webhooks.store import WebhookStore

__all__ = ["create_app"]

log = get_logger("lmdq.api")


class CreateBatch(BaseModel):
    """``POST /v1/batches``' body (OpenAI's ``BatchCreateParams``); unknown fields are a 400."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, Any] | None = None
    output_expires_after: dict[str, Any] | None = None
    #: lmdq's extension (issue 46): when the batch should be done, ISO 8601 with its zone or Unix time
    deadline: str | float | None = None
    #: lmdq's extension (issue 46): quality gates, as submit's options: {"canary": "2%" or 50, "gate":
    #: ["json=0", ...], "gate_window": 200}; a failing gate pauses the batch (``lmdq_status: "paused"``)
    gates: dict[str, Any] | None = None
    #: lmdq's extension (issue 48, docs/webhooks.md): the URL sent a signed event when the batch ends or
    #: pauses (default: the tenant's, LMDQ_API_WEBHOOKS); must be in LMDQ_WEBHOOK_ALLOW
    webhook: str | None = None
    #: lmdq's extension (issue 47, submit --reuse): answer deterministic requests from an identical earlier
    #: request's stored result and keep this batch's answers for later ones (default: the server's LMDQ_REUSE)
    reuse: bool | None = None
    #: lmdq's extension (issue 47, --reuse-ttl): seconds this batch's answers stay reusable (LMDQ_REUSE_TTL_S)
    reuse_ttl_s: int | None = None


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("lmdq_api_requests", "HTTP requests answered", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("lmdq_api_request_seconds", "time to answer a request", ["route"],
                                 registry=self.registry)
        self.upload_bytes = Counter("lmdq_api_upload_bytes", "bytes of uploaded files", registry=self.registry)
        self.batches = Counter("lmdq_api_batches_created", "batches created", registry=self.registry)
        self.background_errors = Counter("lmdq_api_background_errors", "submit/finalize runs that raised "
                                         "(re-run later)", registry=self.registry)


class _Worker:
    """Background work (submissions, output files) on a small pool, and the loop that finds it."""

    def __init__(self, batches: ApiBatches, files: FileStore, interval_s: float, metrics: _Metrics) -> None:
        self.batches = batches
        self.files = files
        self.interval_s = interval_s
        self.metrics = metrics
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lmdq-api-bg")
        self.stop = threading.Event()
        self.kick = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="lmdq-api-poller", daemon=True)
        self._pending: set[str] = set()
        self._lock = threading.Lock()

    def schedule(self, fn: Callable[[], None], key: str | None = None) -> None:
        """Run ``fn`` on the pool; with ``key``, not again while an earlier one of that key waits or runs
        (the loop finds the same open batch every poll; a busy pool must not pile up copies)."""
        if key is not None:
            with self._lock:
                if key in self._pending:
                    return
                self._pending.add(key)
        self.pool.submit(self._guarded, fn, key)

    def _guarded(self, fn: Callable[[], None], key: str | None) -> None:
        try:
            fn()
        except Exception as e:  # a fault: the batch stays open and the loop runs it again
            self.metrics.background_errors.inc()
            log.warning("background work failed; will retry", error_type=type(e).__name__, error=str(e)[:300])
        finally:
            if key is not None:
                with self._lock:
                    self._pending.discard(key)

    def _loop(self) -> None:
        last_sweep = 0.0
        while not self.stop.is_set():
            try:
                for key, job in self.batches.sweep_open():
                    self.schedule(job, key)
                if time.monotonic() - last_sweep > 600:
                    last_sweep = time.monotonic()
                    self.files.sweep()
            except redis.RedisError as e:
                log.warning("redis unavailable in the background loop", error_type=type(e).__name__)
            except Exception as e:
                log.error("background loop error", error_type=type(e).__name__, error=str(e)[:300])
            self.kick.wait(self.interval_s)
            self.kick.clear()

    def start(self) -> None:
        self.thread.start()

    def shutdown(self) -> None:
        self.stop.set()
        self.kick.set()
        self.thread.join(5)
        # an unfinished submission keeps its lease until it lapses; another replica (or this one,
        # restarted) runs it again, the idempotency key making the re-run a no-op if it had landed
        self.pool.shutdown(wait=False, cancel_futures=True)


def _tenant(request: Request) -> str:
    """The tenant of the request's bearer key, or 401. The key is never echoed or logged."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if not header:
        raise unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
    if scheme.lower() != "bearer" or not key.strip():
        raise unauthorized("Expected an 'Authorization: Bearer <key>' header.")
    keyring: KeyRing = request.app.state.keyring
    t = keyring.tenant_of(key.strip())
    if t is None:
        raise unauthorized("Incorrect API key provided.")
    request.scope["lmdq_tenant"] = t
    return t


Tenant = Annotated[str, Depends(_tenant)]


def _route_of(request: Request) -> str:
    r = request.scope.get("route")
    return getattr(r, "path", "unmatched")


def create_app(settings: ApiSettings, keyring: KeyRing, backend: Backend | None = None) -> FastAPI:
    be = backend or Backend(settings)
    files = FileStore(be.client, prefix=settings.key_prefix, folder=settings.api_files_dir,
                      ttl_s=settings.api_file_ttl_s)
    files.ensure_folder()
    metrics = _Metrics()
    worker: _Worker | None = None
    uploads_now = 0  # uploads in progress (one event loop: no lock needed)

    def schedule(fn: Callable[[], None], key: str) -> None:
        assert worker is not None
        worker.schedule(fn, key)

    batches = ApiBatches(be, files, prefix=settings.key_prefix, ttl_s=settings.result_ttl_s, schedule=schedule)
    worker = _Worker(batches, files, settings.api_poll_interval_s, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        assert worker is not None
        # accept failures (EMFILE) as one line per episode, not a traceback per connection (lmdq.api.server;
        # imported here: it imports uvicorn, which imports click, and the app itself runs without a CLI library)
        from lmdq.api.server import AcceptErrors

        asyncio.get_running_loop().set_exception_handler(AcceptErrors())
        worker.start()
        # webhook events (any batch's: lmdq.webhooks) are sent from a thread of their own, as workers do
        hooks = Deliverer(WebhookStore(be.client, keys=Keys(settings.key_prefix)), DeliveryPolicy.of(settings),
                          name="lmdq-api").start()
        log.info("lmdq-api ready", tenants=len(keyring.tenants), files_dir=str(settings.api_files_dir))
        yield
        hooks.stop()
        worker.shutdown()

    app = FastAPI(title="lmdq-api", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.keyring = keyring

    # ---- errors in OpenAI's shape ---------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(_r: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_r: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x not in ("body", "query", "path")]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        if first.get("type") == "extra_forbidden":
            msg = f"Unrecognized request argument supplied: {param}"
        elif first.get("type") == "missing":
            msg = f"Missing required parameter: {param!r}."
        else:
            msg = f"{param}: {msg}" if param else msg
        return JSONResponse(error_body(msg, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_r: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = "Not found" if e.status_code == 404 else str(e.detail)
        return JSONResponse(error_body(msg), status_code=e.status_code)

    @app.exception_handler(ClientDisconnect)
    async def _gone(r: Request, _e: ClientDisconnect) -> Response:
        # the client went away mid-request (or was closed for stalling): not a server error, no traceback
        log.info("client_disconnected", route=_route_of(r), tenant=r.scope.get("lmdq_tenant"),
                 closed_by=r.scope.get("lmdq.closed_by", "client"))
        return Response(status_code=499)  # nobody reads it; nginx's code, for the access log and metrics

    @app.exception_handler(redis.RedisError)
    async def _redis(_r: Request, e: redis.RedisError) -> JSONResponse:
        log.warning("redis error answering a request", error_type=type(e).__name__)
        return JSONResponse(error_body("the queue's Redis is unavailable; retry shortly", type_="server_error",
                                       code=ErrorCode.service_unavailable), status_code=503)

    @app.exception_handler(Exception)
    async def _internal(_r: Request, e: Exception) -> JSONResponse:
        log.error("internal error", error_type=type(e).__name__, error=str(e)[:300])
        return JSONResponse(error_body("internal server error", type_="server_error"), status_code=500)

    # ---- access log and metrics (never the Authorization header) ----------------------------------
    @app.middleware("http")
    async def _observe(request: Request, call_next: Callable[[Request], Any]) -> Response:
        t0 = time.perf_counter()
        status = 500
        try:
            resp: Response = await call_next(request)
            status = resp.status_code
            return resp
        finally:
            route = _route_of(request)
            dt = time.perf_counter() - t0
            metrics.requests.labels(request.method, route, str(status)).inc()
            metrics.latency.labels(route).observe(dt)
            if route not in ("/healthz", "/readyz", "/metrics"):
                log.info("request", method=request.method, route=route, status=status,
                         tenant=request.scope.get("lmdq_tenant"), ms=round(dt * 1000, 1))

    # ---- health -----------------------------------------------------------------------------
    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", include_in_schema=False)
    def readyz() -> JSONResponse:
        checks = {"redis": be.ping(), "files_dir": os.access(settings.api_files_dir, os.W_OK)}
        ok = all(checks.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", "checks": checks},
                            status_code=200 if ok else 503)

    @app.get("/metrics", include_in_schema=False)
    def metrics_() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- files ----------------------------------------------------------------------------
    @app.post("/v1/files")
    async def create_file(request: Request, t: Tenant) -> Any:
        nonlocal uploads_now
        boundary = boundary_of(request.headers.get("content-type"))
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > settings.api_max_upload_bytes + (1 << 20):  # + the form's own
            raise ApiError(413, f"file: larger than this server's limit of {settings.api_max_upload_bytes:,} bytes "
                                "(LMDQ_API_MAX_UPLOAD_BYTES)", param="file")
        if uploads_now >= settings.api_max_uploads:
            raise ApiError(503, f"this server is taking {settings.api_max_uploads} uploads at once "
                           "(LMDQ_API_MAX_UPLOADS); retry shortly", type_="server_error",
                           code=ErrorCode.service_unavailable, headers={"Retry-After": "2"})
        uploads_now += 1
        try:
            return await _upload(request, t, boundary)
        finally:
            uploads_now -= 1

    async def _upload(request: Request, t: Tenant, boundary: bytes) -> Any:
        file_id, f, tmp = await run_in_threadpool(files.open_new)
        form = FormStream(boundary, f, max_bytes=settings.api_max_upload_bytes)
        try:
            buf = bytearray()
            async for chunk in request.stream():
                buf += chunk
                if len(buf) >= 1 << 20:  # parse and write off the event loop, a MiB at a time
                    await run_in_threadpool(form.write, bytes(buf))
                    buf.clear()
            if buf:
                await run_in_threadpool(form.write, bytes(buf))
            form.finish()
            if form.filename is None:
                raise ApiError(400, "Missing required parameter: 'file'.", param="file")
            purpose = check_purpose(form.fields.get("purpose"))
            ttl = expires_after(form.fields.get("expires_after[anchor]"), form.fields.get("expires_after[seconds]"),
                                "expires_after")
            rec = await run_in_threadpool(lambda: files.commit(file_id, f, tmp, tenant=t,
                                                               filename=form.filename or "upload.jsonl",
                                                               purpose=purpose, ttl_s=ttl))
        except ClientDisconnect:
            # the client went away (or was closed for stalling: LMDQ_API_BODY_TIMEOUT_S): not a server error
            files.discard(f, tmp)
            log.info("client_disconnected", route="/v1/files", tenant=t, received=form.file_bytes,
                     closed_by=request.scope.get("lmdq.closed_by", "client"))
            return Response(status_code=499)  # nobody reads it; nginx's code for the access log
        except BaseException:
            files.discard(f, tmp)
            raise
        metrics.upload_bytes.inc(rec.bytes)
        log.info("file uploaded", file=rec.id, tenant=t, bytes=rec.bytes)
        return rec.to_openai()

    @app.get("/v1/files")
    def list_files(t: Tenant, after: str | None = None, limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
                   order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
                   purpose: str | None = None) -> dict[str, Any]:
        pg = files.list_page(t, after=after, limit=limit, order=order, purpose=purpose)
        data = [r.to_openai() for r in pg.items]
        return _list(data, pg.has_more)

    @app.get("/v1/files/{file_id}")
    def get_file(file_id: str, t: Tenant) -> dict[str, Any]:
        return files.get(t, file_id).to_openai()

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str, t: Tenant) -> FileResponse:
        rec = files.get(t, file_id)
        return FileResponse(files.path(rec.id), media_type="application/jsonl", filename=rec.filename)

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str, t: Tenant) -> dict[str, Any]:
        files.delete(t, file_id)
        log.info("file deleted", file=file_id, tenant=t)
        return {"id": file_id, "object": "file", "deleted": True}

    # ---- batches ----------------------------------------------------------------------------
    @app.post("/v1/batches")
    def create_batch(body: CreateBatch, t: Tenant) -> dict[str, Any]:
        exp = body.output_expires_after or {}
        ttl = expires_after(exp.get("anchor"), exp.get("seconds"), "output_expires_after") if exp else None
        out = batches.create(t, input_file_id=body.input_file_id, endpoint=body.endpoint,
                             completion_window=body.completion_window, metadata=body.metadata, output_ttl_s=ttl,
                             deadline=body.deadline, gates=body.gates, webhook=body.webhook,
                             reuse=body.reuse, reuse_ttl_s=body.reuse_ttl_s)
        metrics.batches.inc()
        return out

    @app.get("/v1/batches")
    def list_batches(t: Tenant, after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict[str, Any]:
        pg = batches.list_page(t, after=after, limit=limit)
        return _list(pg.items, pg.has_more)

    @app.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str, t: Tenant) -> dict[str, Any]:
        out = batches.retrieve(t, batch_id)
        if out["status"] in ("finalizing", "cancelling") and worker is not None:
            worker.kick.set()  # its files are due: do not wait for the next poll
        return out

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str, t: Tenant) -> dict[str, Any]:
        return batches.cancel(t, batch_id)

    @app.post("/v1/batches/{batch_id}/resume")
    def resume_batch(batch_id: str, t: Tenant) -> dict[str, Any]:
        """lmdq's extension (issue 46): run the rest of a batch a quality gate paused."""
        return batches.resume(t, batch_id)

    return app


def _list(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page: ``first_id``/``last_id`` are what ``after`` takes."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
