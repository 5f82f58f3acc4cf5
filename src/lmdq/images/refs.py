"""What an image reference may be, and how submit checks one without reading its pixels into Redis.

A reference is the ``url`` of an ``image_url`` part:

* ``data:image/<type>;base64,<payload>``: kept inline in the job (it IS the image), checked whole:
  valid base64, an image by its magic bytes, at most ``LMDQ_MAX_IMAGE_BYTES`` decoded.
* a path: ``file:///abs/cat.png``, ``/abs/cat.png``, or ``cat.png`` relative to the folder the batch
  names (``--image-dir`` / ``image_dir=``). Checked: exists, a regular file, readable, at most the
  limit, an image by its first bytes (only those are read). The job carries the ABSOLUTE path
  (``file://`` URL): workers must see the same mount.
* ``s3://bucket/key``: checked like a path through fsspec/s3fs (``info`` for the size, the first
  bytes for the format), with ``LMDQ_S3_ENDPOINT_URL`` as the results sink uses it.
* ``http(s)://``: the syntax only. The producer may not reach what workers reach (and the HTTP API
  must not fetch a tenant's URL from inside the cluster's network on submit); the worker fetches it,
  and a failure there fails that request with ``invalid_image``.

A root (``root=``, the HTTP API's ``LMDQ_API_IMAGE_ROOT``) confines local paths: a path (relative
ones resolve against it) must lie inside the root once symlinks are resolved, so a tenant cannot name
``/etc/passwd`` or ``../../secrets``. Without a root, the API refuses local paths outright.

Format check by magic bytes (PNG, JPEG, GIF, WebP, BMP, TIFF): the producer has no Pillow, and the
first 16 bytes are what Pillow's own ``open`` looks at first too.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from lmdq.settings import DEFAULT_MAX_IMAGE_BYTES

__all__ = [
    "DEFAULT_MAX_IMAGE_BYTES",
    "ImageChecker",
    "ImageRefError",
    "data_url",
    "decode_data_url",
    "local_path",
    "ref_kind",
    "sniff",
]


HEAD_BYTES = 16
"""Bytes read from a referenced image at submit: enough for every format :func:`sniff` knows."""

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


class ImageRefError(ValueError):
    """An image reference submit refuses; the message says what was expected (the caller adds row and field)."""


def sniff(head: bytes) -> str | None:
    """The image MIME type ``head`` (a file's first bytes) starts with, or None when it is no image lmdq knows."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    if head.startswith(b"BM"):
        return "image/bmp"
    if head.startswith((b"II*\x00", b"MM\x00*")):
        return "image/tiff"
    return None


def ref_kind(url: str) -> str:
    """``data`` | ``file`` | ``s3`` | ``http`` | ``path`` (no scheme: a local path) | ``unknown``."""
    low = url[:8].lower()
    if low.startswith("data:"):
        return "data"
    if low.startswith("file://"):
        return "file"
    if low.startswith(("s3://", "s3a://")):
        return "s3"
    if low.startswith(("http://", "https://")):
        return "http"
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", url):
        return "unknown"
    return "path"


def decode_data_url(url: str, max_bytes: int) -> tuple[str | None, bytes]:
    """(the declared MIME type, the decoded bytes) of a base64 ``data:`` URL; ImageRefError if it is not
    one or decodes to more than ``max_bytes`` (checked on the text's length first: nothing huge is decoded)."""
    m = _DATA_URL.match(url)
    if m is None or not m.group("b64"):
        raise ImageRefError("expected a base64 data: URL (data:image/png;base64,...)")
    payload = url[m.end():]
    if len(payload) // 4 * 3 > max_bytes + 3:
        raise ImageRefError(f"image is about {len(payload) // 4 * 3:,} bytes, over the limit of {max_bytes:,} "
                            "(LMDQ_MAX_IMAGE_BYTES)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefError("the data: URL's payload is not valid base64") from None
    if len(data) > max_bytes:
        raise ImageRefError(f"image is {len(data):,} bytes, over the limit of {max_bytes:,} (LMDQ_MAX_IMAGE_BYTES)")
    mime = m.group("mime")
    return (mime.lower() if mime else None), data


def data_url(data: bytes, mime: str | None = None) -> str:
    """``data`` as a base64 ``data:`` URL (its MIME type sniffed when not given)."""
    kind = mime or sniff(data[:HEAD_BYTES]) or "application/octet-stream"
    return f"data:{kind};base64,{base64.b64encode(data).decode('ascii')}"


def local_path(url: str) -> str:
    """The filesystem path of a ``file://`` URL or a bare path (percent-escapes of a file URL decoded)."""
    if url[:7].lower() == "file://":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ImageRefError(f"expected a local file URL (file:///path), got host {parts.netloc!r}")
        return unquote(parts.path)
    return url


@dataclass(frozen=True)
class ImageChecker:
    """Checks references at submit and says what the job carries instead (see the module's docstring).

    ``image_dir``: the folder relative paths resolve against (none: a relative path is refused).
    ``root``: local paths must lie inside it (the HTTP API); ``allow_local=False`` refuses them all."""

    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    image_dir: str | None = None
    root: str | None = None
    allow_local: bool = True
    #: check s3:// objects at submit (exists, size, format); off: the syntax only, the worker reads it
    check_remote: bool = True

    def check(self, url: str) -> str:
        """The reference as the job carries it (a relative path made an absolute ``file://`` URL; anything
        else unchanged), or ImageRefError saying what is wrong."""
        kind = ref_kind(url)
        if kind == "data":
            mime, data = decode_data_url(url, self.max_bytes)
            found = sniff(data[:HEAD_BYTES])
            if found is None:
                raise ImageRefError(f"the data: URL does not hold an image lmdq knows (PNG, JPEG, GIF, WebP, BMP, "
                                    f"TIFF){_declared(mime)}")
            return url
        if kind in ("file", "path"):
            return self._check_local(url)
        if kind == "s3":
            if self.check_remote:
                self._check_s3(url)
            return url
        if kind == "http":
            parts = urlsplit(url)
            if not parts.hostname:
                raise ImageRefError("expected an http(s) URL with a host")
            return url
        raise ImageRefError(f"unsupported URL scheme {url.split('://', 1)[0]!r}; expected a data: URL, a path "
                            "(file://), s3:// or http(s)://")

    def normalize(self, url: str) -> str:
        """What the job carries for an ALREADY CHECKED reference, without touching the file again: a local
        path as an absolute ``file://`` URL (submit's second pass), anything else unchanged."""
        if ref_kind(url) not in ("file", "path"):
            return url
        return self._resolve(local_path(url)).as_uri()

    def _resolve(self, raw: str) -> Path:
        """A local path made absolute (against ``root`` or ``image_dir``) and, under a root, confined to it."""
        if not raw:
            raise ImageRefError("expected a path, got an empty one")
        if "\x00" in raw:
            raise ImageRefError("expected a path, got one with a NUL byte")
        path = Path(raw).expanduser() if self.root is None else Path(raw)
        if not path.is_absolute():
            base = self.root if self.root is not None else self.image_dir
            if base is None:
                raise ImageRefError(f"relative image path {raw!r}: name the folder it is relative to "
                                    "(--image-dir / image_dir=), or give an absolute path")
            path = Path(base).expanduser() / path
        if self.root is not None:
            real = Path(os.path.realpath(path))
            root = Path(os.path.realpath(self.root))
            if real != root and root not in real.parents:
                raise ImageRefError(f"image path {raw!r} is outside the server's image root")
            return real
        return Path(os.path.abspath(path))

    def _check_local(self, url: str) -> str:
        if not self.allow_local:
            raise ImageRefError("local image paths are not allowed here (the server names no image root: "
                                "LMDQ_API_IMAGE_ROOT); use a data: URL, s3:// or http(s)://")
        raw = local_path(url)
        path = self._resolve(raw)
        # under a root (the HTTP API) errors name the path as the tenant wrote it, never the server's own
        shown = raw if self.root is not None else str(path)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise ImageRefError(f"no such image file: {shown}") from None
        except OSError as e:
            raise ImageRefError(f"cannot read image file {shown}: {e.strerror or e}") from None
        if not path.is_file():
            raise ImageRefError(f"not a regular file: {shown}")
        if st.st_size > self.max_bytes:
            raise ImageRefError(f"image {shown} is {st.st_size:,} bytes, over the limit of {self.max_bytes:,} "
                                "(LMDQ_MAX_IMAGE_BYTES)")
        try:
            with open(path, "rb") as f:
                head = f.read(HEAD_BYTES)
        except OSError as e:
            raise ImageRefError(f"cannot read image file {shown}: {e.strerror or e}") from None
        if sniff(head) is None:
            raise ImageRefError(f"{shown} is not an image lmdq knows (PNG, JPEG, GIF, WebP, BMP, TIFF: checked by "
                                "its first bytes)")
        return path.as_uri()

    def _check_s3(self, url: str) -> None:
        from lmdq.results.blobs import _fs_for, bounded, default_sink_timeout_s

        timeout = default_sink_timeout_s()
        try:
            fs, path = _fs_for(url, timeout)
            info: dict[str, Any] = bounded(lambda: fs.info(path), timeout_s=timeout, what="image info")
            size = int(info.get("size") or 0)
            if info.get("type") == "directory":
                raise ImageRefError(f"{url} is a folder, not an image")
            if size > self.max_bytes:
                raise ImageRefError(f"image {url} is {size:,} bytes, over the limit of {self.max_bytes:,} "
                                    "(LMDQ_MAX_IMAGE_BYTES)")
            head: bytes = bounded(lambda: fs.cat_file(path, start=0, end=HEAD_BYTES), timeout_s=timeout,
                                  what="image head")
        except ImageRefError:
            raise
        except FileNotFoundError:
            raise ImageRefError(f"no such image object: {url}") from None
        except ImportError as e:
            raise ImageRefError(f"s3:// images need `pip install 'lmdq[blobs]'` ({e})") from None
        except Exception as e:  # a denied bucket, a network error: one line, the producer's view of it
            raise ImageRefError(f"cannot read image object {url}: {type(e).__name__}: {e}") from None
        if sniff(head) is None:
            raise ImageRefError(f"{url} is not an image lmdq knows (PNG, JPEG, GIF, WebP, BMP, TIFF: checked by its "
                                "first bytes)")


def _declared(mime: str | None) -> str:
    return f"; it says {mime}" if mime else ""
