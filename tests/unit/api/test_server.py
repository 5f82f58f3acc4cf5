"""lmdq.api.server.AcceptErrors: accept failures make one episode, ended by a quiet spell."""

from __future__ import annotations

import asyncio
import errno
from typing import Any

from lmdq.api import server
from lmdq.api.server import AcceptErrors, effective_max_connections


def test_accept_errors_are_one_episode_until_quiet(monkeypatch: Any) -> None:
    monkeypatch.setattr(server, "_EPISODE_QUIET_S", 0.05)
    other: list[dict[str, Any]] = []

    async def main() -> AcceptErrors:
        loop = asyncio.get_running_loop()
        loop.default_exception_handler = other.append  # type: ignore[method-assign]
        h = AcceptErrors()
        emfile = {"message": "socket.accept() out of system resource",
                  "exception": OSError(errno.EMFILE, "Too many open files")}
        for _ in range(1000):
            h(loop, emfile)
        assert h.episodes == 1 and h.failures == 1000
        await asyncio.sleep(0.2)
        assert h.failures == 0  # ended (accept_recovered logged with the count)
        h(loop, emfile)
        assert h.episodes == 2
        h(loop, {"message": "something else", "exception": ValueError("x")})
        return h

    h = asyncio.run(main())
    assert h.episodes == 2 and len(other) == 1


def test_connection_cap_fits_the_fd_limit() -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert effective_max_connections(10, 4) == 10 or soft < 100
    assert effective_max_connections(10**9, 4) <= max(1, soft - 64 - 4)
