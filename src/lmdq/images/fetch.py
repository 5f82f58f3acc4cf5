"""A worker reads the bytes behind an image reference (the job carries the reference, never the pixels
unless they came as a ``data:`` URL).

Every read is capped at ``LMDQ_MAX_IMAGE_BYTES`` (never more is read) and bounded in time
(``LMDQ_SINK_TIMEOUT_S``, as the results sink's reads are); the bytes must be an image by their magic
bytes. A failure is an :class:`ImageFetchError` whose message names the reference (a data: URL by its
length only): the worker fails that one request with ``invalid_image``.

``http(s)``: fetched with the standard library, following redirects, no credentials sent. A worker
fetches what a batch names, so deployments that take batches from tenants they do not trust put
workers behind an egress policy (the HTTP API refuses local paths outside its image root; it cannot
know what a URL reaches from a worker).
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from lmdq.images.refs import (
    DEFAULT_MAX_IMAGE_BYTES,
    HEAD_BYTES,
    ImageRefError,
    data_url,
    decode_data_url,
    local_path,
    ref_kind,
    sniff,
)

__all__ = ["Image", "ImageFetchError", "describe", "read_image"]


class ImageFetchError(RuntimeError):
    """An image a worker could not read (gone, unreadable, too large, not an image)."""


@dataclass(frozen=True)
class Image:
    """An image's bytes and MIME type (sniffed)."""

    data: bytes
    mime: str

    def data_url(self) -> str:
        return data_url(self.data, self.mime)


def describe(url: str) -> str:
    """A reference as an error message names it: a data: URL by its size, anything else as written (cut)."""
    if url[:5].lower() == "data:":
        return f"data: URL ({len(url):,} characters)"
    return url if len(url) <= 300 else url[:300] + "..."


def read_image(url: str, *, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES, timeout_s: float = 60.0) -> Image:
    """The image ``url`` names (see the module's docstring); ImageFetchError when it cannot be had."""
    kind = ref_kind(url)
    try:
        if kind == "data":
            _mime, data = decode_data_url(url, max_bytes)
        elif kind in ("file", "path"):
            data = _read_local(local_path(url), max_bytes)
        elif kind == "s3":
            data = _read_s3(url, max_bytes, timeout_s)
        elif kind == "http":
            data = _read_http(url, max_bytes, timeout_s)
        else:
            raise ImageFetchError(f"unsupported image URL scheme in {describe(url)}")
    except ImageRefError as e:
        raise ImageFetchError(f"{describe(url)}: {e}") from None
    except ImageFetchError:
        raise
    except FileNotFoundError:
        raise ImageFetchError(f"no such image: {describe(url)}") from None
    except Exception as e:  # one line per failed image: OSError, HTTPError, a bucket's refusal, a timeout
        raise ImageFetchError(f"cannot read image {describe(url)}: {type(e).__name__}: {e}") from None
    mime = sniff(data[:HEAD_BYTES])
    if mime is None:
        raise ImageFetchError(f"{describe(url)} is not an image lmdq knows (PNG, JPEG, GIF, WebP, BMP, TIFF)")
    return Image(data=data, mime=mime)


def _too_large(url: str, max_bytes: int) -> ImageFetchError:
    return ImageFetchError(f"image {describe(url)} is over the limit of {max_bytes:,} bytes (LMDQ_MAX_IMAGE_BYTES)")


def _read_local(path: str, max_bytes: int) -> bytes:
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise _too_large(path, max_bytes)
    return data


def _read_s3(url: str, max_bytes: int, timeout_s: float) -> bytes:
    from lmdq.results.blobs import _fs_for, bounded

    fs, path = _fs_for(url, timeout_s)
    size = int(bounded(lambda: fs.info(path), timeout_s=timeout_s, what="image info").get("size") or 0)
    if size > max_bytes:
        raise _too_large(url, max_bytes)
    data: bytes = bounded(lambda: fs.cat_file(path), timeout_s=timeout_s, what="image read")
    if len(data) > max_bytes:
        raise _too_large(url, max_bytes)
    return data


def _read_http(url: str, max_bytes: int, timeout_s: float) -> bytes:
    req = urllib.request.Request(url, headers={"User-Agent": "lmdq-worker"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - the scheme is http(s): ref_kind
        data: bytes = resp.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise _too_large(url, max_bytes)
    return data
