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

import glob
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from lmdq.contract import TensorRef

__all__ = ["BlobStore", "SinkAbandoned", "SinkTimeout", "SinkUnconfirmed", "TensorTooLarge", "bounded",
           "default_sink_timeout_s", "max_tensor_bytes", "read_uri", "read_tensor", "to_numpy"]

DEFAULT_MAX_TENSOR_BYTES = 1 << 30

T = TypeVar("T")


class SinkTimeout(TimeoutError):
    """A storage call did not finish within ``LMDQ_SINK_TIMEOUT_S``: its outcome is unknown, so nothing
    that depends on it (a seal) may go ahead."""


class SinkAbandoned(Exception):
    """The caller stopped waiting for a storage call (the worker is past its drain deadline)."""


class SinkUnconfirmed(OSError):
    """A write returned, but the object is not there (or not whole) when looked up: not durable.

    Why this exists: fsspec runs S3 calls as coroutines, and a coroutine CANCELLED at interpreter
    shutdown makes ``pipe_file`` return None, exactly as a successful PUT does (issue 29)."""


def default_sink_timeout_s() -> float:
    """``LMDQ_SINK_TIMEOUT_S`` as :class:`lmdq.settings.CommonSettings` declares it (callers without
    settings of their own: the producer's readers)."""
    from lmdq.settings import CommonSettings

    return float(CommonSettings().sink_timeout_s)


def bounded(fn: Callable[[], T], *, timeout_s: float, what: str, cancel: threading.Event | None = None) -> T:
    """``fn()`` in a helper thread, waited for at most ``timeout_s`` (and not at all once ``cancel`` is
    set): a hung storage endpoint can delay its caller by the timeout, never more.

    Why a thread and not the storage library's own timeouts: those bound one socket read, not a call
    (S3 retries, a stuck NFS write); the call's own thread is left to finish or fail on its own, and
    whatever it returns then is ignored (a seal waits for a confirmed result, never for a late one).
    """
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name=f"lmdq-sink-{what}", daemon=True).start()
    end = time.monotonic() + timeout_s
    while not done.is_set():
        if cancel is not None and cancel.is_set():
            raise SinkAbandoned(f"{what}: abandoned (the worker is past its drain deadline)")
        left = end - time.monotonic()
        if left <= 0:
            raise SinkTimeout(f"{what}: no answer within {timeout_s:g} s (LMDQ_SINK_TIMEOUT_S)")
        done.wait(min(left, 0.05) if cancel is not None else left)
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


class TensorTooLarge(ValueError):
    """One request's tensors exceed ``LMDQ_MAX_TENSOR_BYTES``."""


def max_tensor_bytes() -> int:
    """The per-request cap on tensor bytes (env ``LMDQ_MAX_TENSOR_BYTES``, default 1 GiB)."""
    raw = os.environ.get("LMDQ_MAX_TENSOR_BYTES")
    return int(raw) if raw else DEFAULT_MAX_TENSOR_BYTES


def _storage_options(protocol: str, timeout_s: float | None = None) -> dict[str, Any]:
    if protocol in ("s3", "s3a"):
        endpoint = os.environ.get("LMDQ_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
        opts: dict[str, Any] = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
        if timeout_s is not None:  # so a stuck connection is also dropped, not only waited out
            opts["config_kwargs"] = {"connect_timeout": timeout_s, "read_timeout": timeout_s}
        return opts
    if protocol in ("file", "local"):
        return {"auto_mkdir": True}
    return {}


def _fs_for(url: str, timeout_s: float | None = None) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) for ``url``."""
    import fsspec

    protocol = url.split("://", 1)[0] if "://" in url else "file"
    fs, path = fsspec.core.url_to_fs(url, **_storage_options(protocol, timeout_s))
    return fs, path


def read_uri(uri: str, *, timeout_s: float | None = None) -> bytes:
    """The bytes of one stored object (a shard or a safetensors file), given its full URI; a read
    that takes longer than ``timeout_s`` (default ``LMDQ_SINK_TIMEOUT_S``) raises :class:`SinkTimeout`."""
    t = default_sink_timeout_s() if timeout_s is None else timeout_s
    fs, path = _fs_for(uri, t)
    data: bytes = bounded(lambda: fs.cat_file(path), timeout_s=t, what="read")
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

    def __init__(self, url: str, *, timeout_s: float | None = None, cancel: threading.Event | None = None) -> None:
        self.url = url.rstrip("/")
        #: every call on the store is bounded by this (``LMDQ_SINK_TIMEOUT_S``), see :func:`bounded`
        self.timeout_s = default_sink_timeout_s() if timeout_s is None else timeout_s
        #: set: calls in progress stop being waited for, new ones are not started (drain deadline)
        self.cancel = cancel
        self.fs, self.root = _fs_for(self.url, self.timeout_s)
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float | None = None, cancel: threading.Event | None = None
                 ) -> BlobStore:
        if not url:
            raise ValueError("empty blob store URL")
        return cls(url, timeout_s=timeout_s, cancel=cancel)

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
        """Write ``data`` at ``key`` (replacing it whole), confirm it is durable, and return its URI.

        Returning means the object is there, whole: a folder write goes to a temporary name, is
        fsynced, renamed and its folder fsynced (a reader never sees half a file, a crash never keeps
        a renamed but unwritten one); an S3 PUT is followed by a HEAD whose size must match. Anything
        else raises: the write failed (the temporary file is removed), took longer than
        ``timeout_s`` (:class:`SinkTimeout`), or was not confirmed (:class:`SinkUnconfirmed`).
        """
        if self.cancel is not None and self.cancel.is_set():
            raise SinkAbandoned(f"write {key}: not started (the worker is past its drain deadline)")
        path = self._path(key)
        write = self._put_local if self.local else self._put_remote
        bounded(lambda: write(path, data), timeout_s=self.timeout_s, what="write", cancel=self.cancel)
        return self.uri(key)

    def _put_local(self, path: str, data: bytes) -> None:
        path = os.path.join(self._local_dir(path), os.path.basename(path))
        self._sweep_tmp(path)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass  # never created, or the folder itself is gone
            raise
        fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself durable
        finally:
            os.close(fd)
        if os.path.getsize(path) != len(data):
            raise SinkUnconfirmed(f"{path}: {os.path.getsize(path)} bytes on disk after writing {len(data)}")

    def _sweep_tmp(self, path: str) -> None:
        """Remove temporary files of ``path`` left by a writer that died mid-write (SIGKILL, power loss):
        only those older than two timeouts, so a concurrent writer's file is never taken from it."""
        limit = time.time() - 2 * self.timeout_s
        for old in glob.glob(glob.escape(path) + ".tmp-*"):
            try:
                if os.path.getmtime(old) < limit:
                    os.unlink(old)
            except OSError:
                pass

    def _put_remote(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)
        self.fs.invalidate_cache(path)
        info = self.fs.info(path)  # a HEAD: what a reader will find
        size = info.get("size") if isinstance(info, dict) else None
        if size != len(data):
            raise SinkUnconfirmed(f"{self.fs.unstrip_protocol(path)}: HEAD says size {size!r} after a PUT of "
                                  f"{len(data)} bytes")

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
