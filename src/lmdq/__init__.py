"""lmdq: offline batch LLM inference on your own GPUs, driven by a queue.

The Python API (:class:`Client`, :class:`Batch`) is loaded on first use, not by ``import lmdq``:
every lmdq module (the worker's too) imports this package, and none of them needs the client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmdq.client.client import Batch, BatchInfo, Client
    from lmdq.client.stream import StreamChunk
    from lmdq.contract import BatchStatus, Result, ResultStatus
    from lmdq.errors import (
        BatchNotFound,
        InvalidArgument,
        LmdqError,
        RedisRefused,
        RedisUnavailable,
        ResultsUnavailable,
        RetryRejected,
        SubmitRejected,
        UnknownModel,
        WaitTimeout,
    )

__all__ = [
    "Batch", "BatchInfo", "BatchNotFound", "BatchStatus", "Client", "InvalidArgument", "LmdqError", "RedisRefused",
    "RedisUnavailable", "Result", "ResultStatus", "ResultsUnavailable", "RetryRejected", "StreamChunk",
    "SubmitRejected", "UnknownModel", "WaitTimeout",
]

_HOMES = {
    "Batch": "lmdq.client.client", "BatchInfo": "lmdq.client.client", "Client": "lmdq.client.client",
    "BatchStatus": "lmdq.contract", "Result": "lmdq.contract", "ResultStatus": "lmdq.contract",
    "StreamChunk": "lmdq.client.stream",
}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'lmdq' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_HOMES.get(name, "lmdq.errors")), name)
    globals()[name] = value
    return value
