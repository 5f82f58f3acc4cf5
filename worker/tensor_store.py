"""Tensor outputs (logits, hidden states) go to a blob store; results carry only references.

Redis must never hold tensor bytes, so a final event's tensors are written here first and the
result gets TensorRefs, or fails with a clear error when no store is set or a tensor is too large.
"""

from __future__ import annotations

from typing import Any

from lmdq.contract import ErrorCode, ErrorInfo, JobPayload, Request
from lmdq.worker.engines.base import EngineEvent

__all__ = ["TensorStore"]


class TensorStore:
    """Writes final events' tensors, opening each blob store once per worker (by URL)."""

    def __init__(self) -> None:
        self._blob_stores: dict[str, Any] = {}

    def _blob_store(self, url: str) -> Any:
        from lmdq.results.blobs import BlobStore

        if url not in self._blob_stores:
            self._blob_stores[url] = BlobStore.from_url(url)
        return self._blob_stores[url]

    def put(
        self, ev: EngineEvent, req: Request, payload: JobPayload, default_url: str | None
    ) -> tuple[dict[str, Any] | None, ErrorInfo | None]:
        """Write a final event's tensors to the blob store: (TensorRefs, None) or (None, why not).

        The batch's ``blob_url`` wins; ``default_url`` is the worker's own (``LMDQ_BLOB_URL``).
        """
        params = payload.params.merged(req.params)
        asked = bool(params.output_logits or params.output_last_hidden_state)
        if not (ev.tensors or asked):
            return None, None
        url = payload.blob_url or default_url
        if not url:
            return None, ErrorInfo(
                code=ErrorCode.no_blob_store,
                message="this request asked for tensors (output_logits / output_last_hidden_state) but no blob "
                "store is configured: submit with --blob-url, or set LMDQ_BLOB_URL on the worker",
            )
        if not ev.tensors:
            return None, None
        from lmdq.results.blobs import TensorTooLarge

        try:
            refs = self._blob_store(url).put_tensors(f"{payload.batch_id}/{req.index}", ev.tensors)
        except TensorTooLarge as e:
            return None, ErrorInfo(code=ErrorCode.tensor_too_large, message=str(e))
        return refs, None
