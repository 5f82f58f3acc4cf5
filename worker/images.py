"""A job's image references become bytes here, just before its requests go to the engine.

Jobs carry references (a path, ``s3://``, ``http(s)://``, or an inline ``data:`` URL: lmdq.images.refs);
the worker reads each image (lmdq.images.fetch) and hands the engine every image part as a base64
``data:`` URL: the one form LMDeploy's VLM pipeline, the transformers engine and the engine process's
pipe all take as they are, with no file system or credentials of their own. A request whose image cannot
be read fails alone, with ``invalid_image`` naming the image; its job's other requests run.

Reads run on a small thread pool (``IMAGE_READERS``): a job of 32 requests over S3 or HTTP waits for
its slowest image, not the sum of them. The same reference twice in a job (several questions over one
image) is read once.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmdq.contract import Request
from lmdq.images.fetch import Image, ImageFetchError, read_image

__all__ = ["IMAGE_READERS", "has_images", "resolve_images"]

IMAGE_READERS = 8
"""Images one job reads at once."""


def has_images(req: Request) -> bool:
    """Whether ``req`` has an image part."""
    return req.messages is not None and any(m.image_urls() for m in req.messages)


def resolve_images(todo: Sequence[Request], *, max_bytes: int, timeout_s: float
                   ) -> tuple[dict[int, list[dict[str, Any]]], dict[int, str]]:
    """For each position in ``todo`` whose request has images: its messages with every image part as a
    ``data:`` URL (``{pos: messages}``), or why one image could not be read (``{pos: message}``)."""
    wanted = {pos: r for pos, r in enumerate(todo) if has_images(r)}
    if not wanted:
        return {}, {}
    urls = sorted({u for r in wanted.values() for m in r.messages or [] for u in m.image_urls()})
    got: dict[str, Image | ImageFetchError] = {}

    def one(url: str) -> tuple[str, Image | ImageFetchError]:
        try:
            return url, read_image(url, max_bytes=max_bytes, timeout_s=timeout_s)
        except ImageFetchError as e:
            return url, e

    if len(urls) == 1:
        got.update([one(urls[0])])
    else:
        with ThreadPoolExecutor(max_workers=min(IMAGE_READERS, len(urls)), thread_name_prefix="lmdq-image") as pool:
            got.update(pool.map(one, urls))
    resolved: dict[int, list[dict[str, Any]]] = {}
    failed: dict[int, str] = {}
    inline: dict[str, str] = {}
    for pos, r in wanted.items():
        msgs = [m.model_dump(exclude_none=True) for m in r.messages or []]
        bad = next((got[u] for m in r.messages or [] for u in m.image_urls() if isinstance(got[u], ImageFetchError)),
                   None)
        if bad is not None:
            failed[pos] = str(bad)
            continue
        for m in msgs:
            content = m.get("content")
            if not isinstance(content, list):
                continue
            for part in content:
                if part.get("type") == "image_url":
                    url = part["image_url"]["url"]
                    image = got[url]
                    assert isinstance(image, Image)
                    if url not in inline:
                        inline[url] = url if url[:5].lower() == "data:" else image.data_url()
                    part["image_url"] = {**part["image_url"], "url": inline[url]}
        resolved[pos] = msgs
    return resolved, failed
