"""Which parts of a chat message are images, and what a part must look like.

An OpenAI content part ``{"type": "image_url", "image_url": {"url": "...", "detail": "auto"}}`` (the
shape OpenAI's and LMDeploy's chat APIs take). lmdq keeps the part as written on the wire; only the
``url`` is checked (submit) and read (worker). ``detail`` is accepted and passed on (engines that do
not use it ignore it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["IMAGE_PART", "TEXT_PART", "image_urls", "part_problem", "placeholder_text"]

IMAGE_PART = "image_url"
TEXT_PART = "text"


def part_problem(part: Any) -> tuple[str, str] | None:
    """What is wrong with one content part, as (sub-field, message), or None when it is a well-formed
    text or image part. The sub-field is relative to the part (``.type``, ``.image_url.url``)."""
    if not isinstance(part, dict):
        return "", "expected a content part object {'type': 'text' | 'image_url', ...}"
    kind = part.get("type")
    if kind == TEXT_PART:
        if not isinstance(part.get("text"), str):
            return ".text", "expected a string"
        return None
    if kind == IMAGE_PART:
        img = part.get("image_url")
        if isinstance(img, str):  # some clients write the url directly; OpenAI wants the object
            return ".image_url", "expected an object {'url': '...'}, got a string"
        if not isinstance(img, dict):
            return ".image_url", "expected an object {'url': '...'}"
        url = img.get("url")
        if not isinstance(url, str) or not url:
            return ".image_url.url", "expected a non-empty string (a data: URL, a path, s3:// or http(s)://)"
        return None
    return ".type", "expected 'text' or 'image_url'"


def image_urls(messages: Iterable[Any]) -> Iterator[tuple[int, int, str]]:
    """``(message index, part index, url)`` of every image part in ``messages`` (dicts or ChatMessage
    models), in order. Parts that are not well-formed image parts are skipped: validation names them."""
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == IMAGE_PART:
                img = part.get("image_url")
                if isinstance(img, dict) and isinstance(img.get("url"), str):
                    yield i, j, img["url"]


def placeholder_text(content: Any, marker: str = "<image>") -> str:
    """A content value as text, each image part as ``marker`` (the sim engine and logs: never the bytes)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == IMAGE_PART:
            out.append(marker)
        elif isinstance(part, dict):
            out.append(str(part.get("text", "")))
    return "".join(out)
