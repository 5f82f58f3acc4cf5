"""A TCP proxy on 127.0.0.1 that can be told to hang every connection: an S3 endpoint that stops
answering (issue 29) without touching the server behind it.

While hung, nothing is forwarded either way, on connections old or new (a client's keep-alive
connection stalls mid-request, as it does when a load balancer or the network goes quiet); the
first bytes held set :attr:`HangProxy.holding`, so a test waits for "a request is stuck now" on an
event instead of guessing with a sleep. :meth:`HangProxy.release` lets everything through again.
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType

__all__ = ["HangProxy"]


class HangProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._srv.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._flowing = threading.Event()
        self._flowing.set()
        #: set once bytes were held back during a hang (a request is stuck now)
        self.holding = threading.Event()
        self.held_chunks = 0
        self._lock = threading.Lock()
        self._closed = False
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, name="hangproxy-accept", daemon=True).start()

    def hang(self) -> None:
        self.holding.clear()
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._closed = True
        self._flowing.set()
        for s in [self._srv, *self._socks]:
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> HangProxy:
        return self

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                down, _ = self._srv.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.target, timeout=10)
            except OSError:
                down.close()
                continue
            up.settimeout(None)
            with self._lock:
                self._socks += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), name="hangproxy-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if not self._flowing.is_set():
                    with self._lock:
                        self.held_chunks += 1
                    self.holding.set()
                    self._flowing.wait()
                if self._closed:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
