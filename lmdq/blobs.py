"""Blob storage for what must never go into Redis: tensors (logits, hidden states) and result shards.

A store is a URL handled by fsspec: a local folder (``/data/out`` or ``file:///data/out``) or an
S3-compatible bucket (``s3://bucket/prefix``; endpoint from ``LMDQ_S3_ENDPOINT_URL`` or
``AWS_ENDPOINT_URL``, credentials from the usual AWS environment variables). Needs the ``blobs``
extra (``pip install 'lmdq[blobs]'``); the base install (the producer) does not import this module
unless a batch uses a results URL.

Tensors of one request are ONE safetensors file ``<store>/<batch_id>/<index>.safetensors``, each
tensor a key in it, referenced from the result by :class:`~lmdq.contract.TensorRef`.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from lmdq.contract import TensorRef

__all__ = ["BlobStore", "TensorTooLarge", "max_tensor_bytes", "read_uri", "read_tensor", "to_numpy"]

DEFAULT_MAX_TENSOR_BYTES = 1 << 30


class TensorTooLarge(ValueError):
    """One request's tensors exceed ``LMDQ_MAX_TENSOR_BYTES``."""


def max_tensor_bytes() -> int:
    """The per-request cap on tensor bytes (env ``LMDQ_MAX_TENSOR_BYTES``, default 1 GiB)."""
    raw = os.environ.get("LMDQ_MAX_TENSOR_BYTES")
    return int(raw) if raw else DEFAULT_MAX_TENSOR_BYTES


def _storage_options(protocol: str) -> dict[str, Any]:
    if protocol in ("s3", "s3a"):
        endpoint = os.environ.get("LMDQ_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
        return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
    if protocol in ("file", "local"):
        return {"auto_mkdir": True}
    return {}


def _fs_for(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) for ``url``."""
    import fsspec

    protocol = url.split("://", 1)[0] if "://" in url else "file"
    fs, path = fsspec.core.url_to_fs(url, **_storage_options(protocol))
    return fs, path


def read_uri(uri: str) -> bytes:
    """The bytes of one stored object (a shard or a safetensors file), given its full URI."""
    fs, path = _fs_for(uri)
    data: bytes = fs.cat_file(path)
    return data


def to_numpy(value: Any) -> Any:
    """A C-contiguous numpy array from a numpy array, a torch tensor (bf16 becomes float32) or a list."""
    import numpy as np

    if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch.Tensor, without importing torch
        t = value.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":  # numpy has no bfloat16
            t = t.float()
        value = t.numpy()
    return np.ascontiguousarray(np.asarray(value))


def read_tensor(ref: TensorRef) -> Any:
    """Load the tensor ``ref`` points to, as a numpy array."""
    from safetensors.numpy import load

    return load(read_uri(ref.uri))[ref.key]


class BlobStore:
    """One store root; objects are addressed by a relative key under it."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = _fs_for(self.url)
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    @classmethod
    def from_url(cls, url: str) -> BlobStore:
        if not url:
            raise ValueError("empty blob store URL")
        return cls(url)

    def uri(self, key: str) -> str:
        """The full URI of ``key`` (what results carry)."""
        return f"{self.url}/{key.lstrip('/')}"

    def _path(self, key: str) -> str:
        """Where ``key`` lives. Keys are built from validated batch ids and integers; this refuses any
        key that could still leave the store (``..``, ``.``, empty segments, NUL), whatever built it."""
        segs = key.strip("/").split("/")
        if any(s in ("", ".", "..") or "\x00" in s for s in segs):
            raise ValueError(f"blob key {key[:200]!r} has an empty, '.' or '..' segment")
        return f"{self.root.rstrip('/')}/{'/'.join(segs)}"

    def _local_dir(self, path: str) -> str:
        """Create ``path``'s folder and check it resolves inside the store root: a symlink planted
        under the root cannot send a write elsewhere."""
        folder = os.path.dirname(path)
        root = os.path.realpath(self.root)
        real = os.path.realpath(folder)
        if real != root and not real.startswith(root.rstrip("/") + "/"):
            raise ValueError(f"blob folder {folder!r} resolves to {real!r}, outside the store {root!r}")
        os.makedirs(real, exist_ok=True)
        return real

    def put_bytes(self, key: str, data: bytes) -> str:
        """Write ``data`` at ``key`` (replacing it whole) and return its URI.

        Local writes go to a temporary name first and are renamed, so a reader never sees half a
        file; an S3 PUT is atomic by itself.
        """
        path = self._path(key)
        if self.local:
            path = os.path.join(self._local_dir(path), os.path.basename(path))
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, data)
        return self.uri(key)

    def put_tensors(self, key_prefix: str, tensors: dict[str, Any]) -> dict[str, TensorRef]:
        """Write one request's tensors as ONE safetensors file ``<key_prefix>.safetensors``.

        ``key_prefix`` is ``<batch_id>/<index>``. Raises :class:`TensorTooLarge` over the cap.
        """
        from safetensors.numpy import save

        arrays = {name: to_numpy(v) for name, v in tensors.items()}
        total = sum(int(a.nbytes) for a in arrays.values())
        cap = max_tensor_bytes()
        if total > cap:
            sizes = ", ".join(f"{k}={list(a.shape)} {a.dtype}" for k, a in arrays.items())
            raise TensorTooLarge(
                f"tensors of this request are {total:,} bytes ({sizes}), over LMDQ_MAX_TENSOR_BYTES={cap:,}; "
                "ask for output 'generation' instead of 'all', fewer tokens, or raise the cap"
            )
        key = f"{key_prefix.strip('/')}.safetensors"
        uri = self.put_bytes(key, save(arrays))
        return {
            name: TensorRef(
                uri=uri, key=name, dtype=str(a.dtype), shape=[int(x) for x in a.shape], nbytes=int(a.nbytes)
            )
            for name, a in arrays.items()
        }

    def read_tensor(self, ref: TensorRef) -> Any:
        return read_tensor(ref)
