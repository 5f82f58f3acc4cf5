"""The served weights' fingerprint: a hash of the model folder's CONTENT, computed once.

File names, sizes and mtimes are not enough (a re-quantized checkpoint copied over the old one can keep
all three, and a sampled read misses a changed tensor in the middle), so every byte of every file in the
folder is hashed (blake2b, about 1 GB/s on one core). What makes that affordable is a cache: each
file's digest is kept in a JSON file keyed by ``(absolute path, size, mtime_ns)``, so a worker that
restarts on the same checkpoint hashes nothing; a file rewritten in place changes its mtime and is
hashed again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

__all__ = ["file_digest", "folder_digest"]

_CHUNK = 1 << 22


def _hash_file(path: Path) -> str:
    h = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _load(cache: Path | None) -> dict[str, str]:
    if cache is None:
        return {}
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def _save(cache: Path, entries: dict[str, str]) -> None:
    """Atomically (temp file + rename): two workers starting at once never leave half a cache."""
    with contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=".fingerprints-")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f)
        os.replace(tmp, cache)


def file_digest(path: Path, cache: dict[str, str]) -> str:
    """One file's content digest, from ``cache`` when its (path, size, mtime) is there."""
    st = path.stat()
    key = f"{path.resolve()}\x00{st.st_size}\x00{st.st_mtime_ns}"
    if key not in cache:
        cache[key] = _hash_file(path)
    return cache[key]


def folder_digest(folder: Path, cache_file: Path | None = None) -> str:
    """The digest of every file under ``folder`` (relative names and contents, in name order); a
    single file is hashed as itself. ``cache_file``: where per-file digests are kept between starts."""
    cache = _load(cache_file)
    before = dict(cache)
    h = hashlib.blake2b(digest_size=20)
    files = [folder] if folder.is_file() else sorted(p for p in folder.rglob("*") if p.is_file())
    for p in files:
        rel = p.name if folder.is_file() else p.relative_to(folder).as_posix()
        h.update(rel.encode() + b"\x00" + file_digest(p, cache).encode() + b"\x00")
    if cache_file is not None and cache != before:
        _save(cache_file, cache)
    return h.hexdigest()
