"""Which port the worker's health endpoint takes, and a taken one as one line instead of a traceback.

"One worker per GPU" means several workers on one host, and each needs its own health port: the
default 8000 suits one worker in a container, not the second one on a bare host. A taken port is a
setting to change, so it ends the worker at start-up (before the model loads) with one line naming
``--health-port`` and exit 2; ``--health-port auto`` takes the first free port from
:data:`AUTO_FIRST` instead, and the worker logs which (``health endpoint`` ``port=``).
"""

from __future__ import annotations

import errno
from typing import Literal, Protocol

from lmdq.errors import BadSetting

__all__ = ["AUTO", "AUTO_FIRST", "AUTO_PORTS", "HealthPort", "serve_health"]

AUTO = "auto"
AUTO_FIRST = 8000
"""``auto`` tries this port first, then the next ones."""
AUTO_PORTS = 100
"""How many ports ``auto`` tries (8000-8099)."""

HealthPort = int | Literal["auto"]
"""The setting's type: a port, 0 for no endpoint, or ``auto``."""

_TAKEN = (errno.EADDRINUSE, errno.EACCES)


class _Serves(Protocol):
    def serve(self, host: str = ..., port: int = ...) -> int: ...


def serve_health(health: _Serves, host: str, port: HealthPort) -> int:
    """Start ``health``'s HTTP server on ``port`` (or, for ``auto``, the first free one from 8000);
    returns the bound port. A port that cannot be taken raises :class:`BadSetting` (one line, exit 2)."""
    if port == AUTO:
        for p in range(AUTO_FIRST, AUTO_FIRST + AUTO_PORTS):
            try:
                return health.serve(host, p)
            except OSError as e:
                if e.errno not in _TAKEN:
                    raise
        last = AUTO_FIRST + AUTO_PORTS - 1
        raise BadSetting(f"--health-port auto (LMDQ_HEALTH_PORT): every port {AUTO_FIRST}-{last} is taken on "
                         f"{host}; pass a free port, or 0 for no health endpoint")
    try:
        return health.serve(host, int(port))
    except OSError as e:
        if e.errno not in (*_TAKEN, errno.EADDRNOTAVAIL):
            raise
        raise BadSetting(
            f"--health-port {port} (LMDQ_HEALTH_PORT): cannot listen on {host}:{port}: {e.strerror} (another "
            "lmdq-worker on this host? each needs its own port); pass --health-port auto (the first free port "
            f"from {AUTO_FIRST}), another port, or 0 for no health endpoint") from None
