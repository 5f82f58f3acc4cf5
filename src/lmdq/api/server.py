"""uvicorn for lmdq-api, hardened: header, body and idle timeouts, a connection cap, and accept errors
(``EMFILE``) logged once per episode.

uvicorn closes an idle kept-alive connection (``timeout_keep_alive``) but has no header or body read
timeout: a client that connects and sends nothing, trickles its headers, or stalls mid-upload holds a
socket (and an upload's ``.part`` file) forever. :func:`guarded_protocol` is uvicorn's h11 protocol
with one timer per connection:

* header phase (no request in progress): the whole request head must arrive within
  ``header_timeout_s`` of the connection (or of the request's first byte after a keep-alive);
* body phase (a request body still arriving): at most ``body_timeout_s`` between two received
  pieces; a pause the server caused (reading paused while the app catches up, or a 100-continue not
  yet sent) does not count;
* otherwise (the app is working, or the response is being sent): no timer.

A timed-out connection is closed; the app sees ``http.disconnect`` (an upload logs
``client_disconnected`` and removes its ``.part`` file). Over ``max_connections``, the oldest
connection with no request in progress is closed, else the new one, so idle sockets cannot use up
the process's file descriptors. When accepting fails anyway (``EMFILE``), asyncio retries each second;
:class:`AcceptErrors` logs the first failure and, once accepts succeed again, one line with the count.
"""

from __future__ import annotations

import asyncio
import errno
import resource
import socket
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from lmdq.api.settings import ApiSettings
from lmdq.logs.config import get_logger

__all__ = ["AcceptErrors", "effective_max_connections", "guarded_protocol", "serve"]

log = get_logger("lmdq.api.server")

#: file descriptors kept back from the connection cap: Redis, the files being written, logs, the loop
_FD_RESERVE = 64
#: no accept error for this long ends an episode (asyncio retries a failed accept every second)
_EPISODE_QUIET_S = 3.0


class AcceptErrors:
    """The loop's exception handler: accept failures (out of fds, memory) as one line when they start
    and one with their count when they end; every other context goes to the default handler."""

    def __init__(self) -> None:
        self.failures = 0
        self.episodes = 0
        self._started = 0.0
        self._last = 0.0
        self._check: asyncio.TimerHandle | None = None

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if not (isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
                and "accept" in str(context.get("message", ""))):
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if self.failures == 0:
            self._started = now
            self.episodes += 1
            log.warning("accept_failing", error=exc.strerror, errno=errno.errorcode.get(exc.errno or 0, "?"),
                        note="connections wait in the listen backlog; retried each second")
        self.failures += 1
        self._last = now
        if self._check is None:
            self._check = loop.call_later(_EPISODE_QUIET_S, self._maybe_end, loop)

    def _maybe_end(self, loop: asyncio.AbstractEventLoop) -> None:
        self._check = None
        quiet = time.monotonic() - self._last
        if quiet < _EPISODE_QUIET_S:
            self._check = loop.call_later(_EPISODE_QUIET_S - quiet, self._maybe_end, loop)
            return
        log.warning("accept_recovered", failures=self.failures, seconds=round(self._last - self._started, 1))
        self.failures = 0


def effective_max_connections(wanted: int, max_uploads: int) -> int:
    """``wanted``, lowered to fit the process's open-file limit (less a reserve for everything else)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, int(soft) - _FD_RESERVE - max_uploads))


def guarded_protocol(*, header_timeout_s: float, body_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the header/body timeouts and the connection cap (module docstring)."""

    class GuardedH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _phase: str | None = None
        _born: float = 0.0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._born = time.monotonic()
            self._arm("header", header_timeout_s)
            if len(self.connections) > max_connections:
                victim: GuardedH11Protocol = self
                for c in self.connections:
                    if isinstance(c, GuardedH11Protocol) and c is not self and c._waiting() and c._born < victim._born:
                        victim = c
                victim._close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing():
                self._disarm()
            elif self._waiting():
                if self._phase != "header":  # a new request's first bytes: its head is due in full
                    self._arm("header", header_timeout_s)
            elif self.conn.their_state is h11.SEND_BODY:
                self._arm("body", body_timeout_s)  # each piece restarts the gap
            else:
                self._disarm()

        def on_response_complete(self) -> None:
            self._disarm()  # uvicorn's keep-alive timer takes over
            super().on_response_complete()

        def _waiting(self) -> bool:
            """No request in progress: waiting for (the rest of) a request's head."""
            return self.cycle is None or self.cycle.response_complete

        def _arm(self, phase: str, delay: float) -> None:
            self._disarm()
            self._phase = phase
            self._timer = self.loop.call_later(delay, self._expired)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = None
            self._phase = None

        def _expired(self) -> None:
            phase, self._timer, self._phase = self._phase, None, None
            if self.transport is None or self.transport.is_closing():
                return
            if phase == "header" and self._waiting():
                if self.timeout_keep_alive_task is None:  # else uvicorn's keep-alive timer owns this idle time
                    self._close()
                return
            c = self.cycle
            if phase == "body" and c is not None and not c.response_complete and self.conn.their_state is h11.SEND_BODY:
                if self.flow.read_paused or c.waiting_for_100_continue:  # the server's pause, not the client's
                    self._arm("body", body_timeout_s)
                    return
                c.scope["lmdq.closed_by"] = "body_timeout"  # type: ignore[typeddict-unknown-key]
                self._close()

        def _close(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


def serve(app: Any, s: ApiSettings) -> None:
    """Run ``app`` under uvicorn with ``s``' limits until SIGTERM/SIGINT."""
    max_conns = effective_max_connections(s.api_max_connections, s.api_max_uploads)
    protocol = guarded_protocol(header_timeout_s=s.api_header_timeout_s, body_timeout_s=s.api_body_timeout_s,
                                max_connections=max_conns)
    # loop="asyncio": its accept retries once a second on EMFILE (logged by AcceptErrors, installed at startup)
    # log_config=None: uvicorn's loggers propagate to lmdq's one JSON handler; its access log is off
    # (lmdq-api logs each request itself, with the tenant and never the key)
    config = uvicorn.Config(app, host=s.api_host, port=s.api_port, loop="asyncio", http=protocol,
                            log_config=None, access_log=False, timeout_graceful_shutdown=10,
                            timeout_keep_alive=s.api_idle_timeout_s, backlog=s.api_backlog)
    log.info("lmdq-api limits", max_connections=max_conns, max_uploads=s.api_max_uploads,
             header_timeout_s=s.api_header_timeout_s, body_timeout_s=s.api_body_timeout_s,
             idle_timeout_s=s.api_idle_timeout_s, backlog=s.api_backlog)
    uvicorn.Server(config).run(sockets=[listening_socket(s.api_host, s.api_port, s.api_backlog)])


def listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    """The API's socket, bound here rather than inside uvicorn so a port in use is one line and exit 2
    naming the port and the flag to change it (issue 45: lmdq-api logged "ready", then uvicorn's
    ``[Errno 98]``, exit 3, the code the README keeps for Redis)."""
    from lmdq.errors import BadSetting

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise BadSetting(f"--port / LMDQ_API_PORT: {host}:{port} is already in use (a worker's health port, "
                             "the exporter or another lmdq-api?); pass --port N") from None
        raise BadSetting(f"--host / --port: cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock
