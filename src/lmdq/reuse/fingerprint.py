"""The served weights' fingerprint: a hash of the model folder's CONTENT, computed once.

File names, sizes and mtimes are not enough (a re-quantized checkpoint copied over the old one can keep
all three, and a sampled read misses a changed tensor in the middle), so every byte of every file in the
folder is hashed (blake2b, about 1 GB/s on one core). Two things make that affordable:

* files are hashed in pieces of 64 MiB on several threads (hashlib releases the GIL while it hashes), a
  file's digest being the hash of its pieces' digests: a fresh pod's first start on a 16 GB checkpoint
  took 30 s on one core on an H100 host (session 22), which the worker's start then waited for;
* each file's digest is kept in a JSON file keyed by ``(absolute path, size, mtime_ns)``, so a worker
  that restarts on the same checkpoint hashes nothing; a file rewritten in place changes its mtime and
  is hashed again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["folder_digest"]

_CHUNK = 1 << 22
#: a file is hashed as pieces of this size (the unit of parallel work), then the pieces' digests in order;
#: the cache's keys carry it, so digests of another piece size are never mixed into a folder's digest
PIECE = 64 << 20


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _hash_piece(path: Path, offset: int, length: int) -> bytes:
    h = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left > 0 and (chunk := f.read(min(_CHUNK, left))):
            h.update(chunk)
            left -= len(chunk)
    return h.digest()


def _hash_files(files: list[tuple[Path, int]], threads: int | None = None) -> list[str]:
    """The digests of ``(path, size)`` files: every piece of every file on one thread pool, so a
    folder of one big file is as parallel as a folder of many."""
    pieces = [(i, p, off, min(PIECE, size - off)) for i, (p, size) in enumerate(files)
              for off in range(0, max(size, 1), PIECE)]
    with ThreadPoolExecutor(threads or _threads(), thread_name_prefix="lmdq-fingerprint") as pool:
        digests = list(pool.map(lambda a: _hash_piece(a[1], a[2], a[3]), pieces))
    out = [hashlib.blake2b(digest_size=20) for _ in files]
    for (i, _p, _off, _n), d in zip(pieces, digests, strict=True):
        out[i].update(d)
    return [h.hexdigest() for h in out]


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


def _key(path: Path, st: os.stat_result) -> str:
    return f"pieces{PIECE}\x00{path.resolve()}\x00{st.st_size}\x00{st.st_mtime_ns}"


def folder_digest(folder: Path, cache_file: Path | None = None, threads: int | None = None) -> str:
    """The digest of every file under ``folder`` (relative names and contents, in name order); a
    single file is hashed as itself. ``cache_file``: where per-file digests are kept between starts;
    ``threads``: hashing threads (default: the CPUs, at most 8)."""
    cache = _load(cache_file)
    before = dict(cache)
    h = hashlib.blake2b(digest_size=20)
    files = [folder] if folder.is_file() else sorted(p for p in folder.rglob("*") if p.is_file())
    stats = [(p, p.stat()) for p in files]
    keys = [_key(p, st) for p, st in stats]
    todo = [(k, p, st.st_size) for k, (p, st) in zip(keys, stats, strict=True) if k not in cache]
    for (k, _p, _size), d in zip(todo, _hash_files([(p, size) for _k, p, size in todo], threads), strict=True):
        cache[k] = d
    for k, p in zip(keys, files, strict=True):
        rel = p.name if folder.is_file() else p.relative_to(folder).as_posix()
        h.update(rel.encode() + b"\x00" + cache[k].encode() + b"\x00")
    if cache_file is not None and cache != before:
        _save(cache_file, cache)
    return h.hexdigest()
