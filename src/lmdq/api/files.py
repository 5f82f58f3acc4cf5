"""Files: uploads and batch outputs on disk, their records (owner, name, size) in Redis.

Content lives in ``LMDQ_API_FILES_DIR`` as ``<id>.jsonl``, written under a temporary name and
renamed once complete, so a reader never sees half a file and a crash leaves only a ``.part`` file
(swept later). The record is a Redis hash with the tenant that owns it; every lookup is by
(tenant, id), and another tenant's id reads as missing. Records expire (``LMDQ_API_FILE_TTL_S``,
OpenAI's ``expires_at``); :meth:`FileStore.sweep` removes content whose record is gone.

The file records' store is here too (:class:`ApiFileRecords`, tests/test_redis_boundary.py): one hash per
file, one list of ids per tenant. Records come back raw (``{field: value}`` bytes): a record is untrusted
input, and :class:`FileStore` decodes it and checks its ``tenant`` field against the caller's (another
tenant's file reads as missing). The owner is written into the record and its tenant's list in one
transaction, so the two cannot disagree about whose file it is.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import redis
from redis.typing import EncodableT, FieldT

from lmdq.api.errors import bad_request, not_found
from lmdq.api.paging import Page, page
from lmdq.redis.keys import Keys

__all__ = ["ApiFileRecords", "FileRecord", "FileStore", "RawRecord", "new_file_id"]

RawRecord = dict[bytes, bytes]
"""A record's hash as Redis holds it (empty: no record); decoded, and trusted or not, by the caller."""

#: what a file id looks like (OpenAI's ``file-`` + random); checked before it is used in a path
_ID_CHARS = set("0123456789abcdef")


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def _valid_id(file_id: str) -> bool:
    return file_id.startswith("file-") and len(file_id) == 29 and set(file_id[5:]) <= _ID_CHARS


@dataclass(frozen=True)
class FileRecord:
    id: str
    tenant: str
    filename: str
    bytes: int
    created_at: int
    purpose: str
    expires_at: int | None

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``file`` object (``openai.types.FileObject``)."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "status_details": None, "expires_at": self.expires_at}


class FileStore:
    def __init__(self, client: redis.Redis, *, prefix: str, folder: Path, ttl_s: int) -> None:
        self.client = client
        self.prefix = prefix
        self.folder = folder
        self.ttl_s = ttl_s
        self.records = ApiFileRecords(client, Keys(prefix))

    def path(self, file_id: str) -> Path:
        if not _valid_id(file_id):  # never a path built from an arbitrary string
            raise ValueError(f"not a file id: {file_id!r}")
        return self.folder / f"{file_id}.jsonl"

    # ---- writing ------------------------------------------------------------------------------
    def ensure_folder(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)

    def open_new(self) -> tuple[str, IO[bytes], Path]:
        """A new id and a ``.part`` file to stream its content into; :meth:`commit` or :meth:`discard`."""
        self.ensure_folder()
        file_id = new_file_id()
        tmp = self.folder / f".{file_id}.part"
        return file_id, open(tmp, "xb"), tmp  # noqa: SIM115 - the caller closes it (commit/discard)

    def commit(self, file_id: str, f: IO[bytes], tmp: Path, *, tenant: str, filename: str, purpose: str,
               ttl_s: int | None = None) -> FileRecord:
        """Make the streamed content durable and visible: fsync, rename, then the record, which expires
        after ``ttl_s`` (OpenAI's ``expires_after``; default LMDQ_API_FILE_TTL_S)."""
        ttl_s = ttl_s or self.ttl_s
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
        f.close()
        os.replace(tmp, self.path(file_id))
        now = int(time.time())
        expires = now + ttl_s
        rec = FileRecord(id=file_id, tenant=tenant, filename=filename[:255] or "file.jsonl", bytes=size,
                         created_at=now, purpose=purpose, expires_at=expires)
        self.records.create(file_id, tenant, {"filename": rec.filename, "bytes": size, "created_at": now,
                                              "purpose": purpose, "expires_at": expires},
                            ttl_s=ttl_s, index_ttl_s=max(ttl_s, self.ttl_s),
                            created=time.time())  # sub-second: a list keeps creation order
        return rec

    @staticmethod
    def discard(f: IO[bytes], tmp: Path) -> None:
        with contextlib.suppress(OSError):
            f.close()
        with contextlib.suppress(OSError):
            tmp.unlink()

    def write_lines(self, lines: Iterable[bytes], *, tenant: str, filename: str, purpose: str) -> FileRecord:
        """A file from an iterator of lines (a batch's output), streamed to disk."""
        file_id, f, tmp = self.open_new()
        try:
            for line in lines:
                f.write(line)
            return self.commit(file_id, f, tmp, tenant=tenant, filename=filename, purpose=purpose)
        except BaseException:
            self.discard(f, tmp)
            raise

    # ---- reading ------------------------------------------------------------------------------
    def get(self, tenant: str, file_id: str) -> FileRecord:
        """The tenant's file, or 404 (missing, expired, or another tenant's: the same answer)."""
        raw = self.records.read(file_id) if _valid_id(file_id) else {}
        rec = _decode(file_id, raw) if raw else None
        if rec is None or rec.tenant != tenant:
            raise not_found("File object", file_id)
        return rec

    def list_page(self, tenant: str, *, after: str | None, limit: int, order: str,
                  purpose: str | None) -> Page[FileRecord]:
        def load(ids: list[str]) -> tuple[list[FileRecord], list[str]]:
            raws = self.records.read_many(ids)
            shown: list[FileRecord] = []
            gone: list[str] = []
            for i, raw in zip(ids, raws):
                rec = _decode(i, raw) if raw else None
                if rec is None or rec.tenant != tenant:
                    gone.append(i)
                elif purpose is None or rec.purpose == purpose:
                    shown.append(rec)
            return shown, gone

        return page(self.client, self.records.index(tenant), after=after, limit=limit, newest_first=order != "asc",
                    load=load, what="file")

    def delete(self, tenant: str, file_id: str) -> None:
        self.get(tenant, file_id)  # 404 unless the tenant's own
        self.records.remove(tenant, file_id)
        with contextlib.suppress(FileNotFoundError):
            self.path(file_id).unlink()

    def sweep(self, *, min_age_s: float = 3600) -> int:
        """Delete content whose record expired, and ``.part`` leftovers of crashed uploads; returns
        how many files went. Only files older than ``min_age_s`` (an upload in progress is not one)."""
        if not self.folder.is_dir():
            return 0
        gone = 0
        cutoff = time.time() - min_age_s
        for entry in os.scandir(self.folder):
            try:
                if entry.stat().st_mtime > cutoff:
                    continue
                if entry.name.endswith(".part"):
                    os.unlink(entry.path)
                    gone += 1
                elif entry.name.endswith(".jsonl") and _valid_id(entry.name[:-6]):
                    if not self.records.has_record(entry.name[:-6]):
                        os.unlink(entry.path)
                        gone += 1
            except FileNotFoundError:
                continue
        return gone


def _decode(file_id: str, raw: dict[Any, Any]) -> FileRecord | None:
    try:
        d = {k.decode(): v.decode() for k, v in raw.items()}
        exp = d.get("expires_at")
        return FileRecord(id=file_id, tenant=d["tenant"], filename=d["filename"], bytes=int(d["bytes"]),
                          created_at=int(d["created_at"]), purpose=d["purpose"],
                          expires_at=int(exp) if exp else None)
    except (KeyError, ValueError, UnicodeDecodeError):
        return None  # not a record this server wrote: untrusted, treated as missing


def expires_after(anchor: str | None, seconds: str | int | None, param: str) -> int | None:
    """OpenAI's ``expires_after`` (``anchor: created_at``, ``seconds``: 1 hour to 30 days)."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise bad_request(f"{param}.anchor: expected 'created_at', got {anchor!r}", param=f"{param}.anchor")
    try:
        n = int(seconds)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):  # OverflowError: a JSON Infinity
        n = 0
    if not 3600 <= n <= 30 * 86400:
        raise bad_request(f"{param}.seconds: expected 3600 to 2592000 seconds, got {seconds!r}",
                          param=f"{param}.seconds")
    return n


def check_purpose(purpose: str | None) -> str:
    if purpose != "batch":
        raise bad_request(f"purpose: expected 'batch' (the only purpose lmdq serves), got {purpose!r}",
                          param="purpose")
    return purpose


# ==== The store: file records in Redis ====================================================================


class ApiFileRecords:
    """The file records of one key prefix (thread-safe: redis-py clients are)."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    def index(self, tenant: str) -> str:
        """The key of the tenant's file list (paged by :func:`lmdq.api.paging.page`)."""
        return self.keys.api_files(tenant)

    def create(self, file_id: str, tenant: str, fields: Mapping[str, EncodableT], *, ttl_s: int,
               index_ttl_s: int, created: float) -> None:
        """Write the record (``tenant`` plus ``fields``), expiring after ``ttl_s``, and list it for its
        tenant at score ``created`` (sub-second, so the list keeps creation order), in one transaction.
        The list's TTL is pushed to ``index_ttl_s``: it outlives the longest-lived record it names."""
        key, index = self.keys.api_file(file_id), self.keys.api_files(tenant)
        record: dict[FieldT, EncodableT] = {"tenant": tenant}
        record.update(fields)
        with self.client.pipeline(transaction=True) as p:
            p.hset(key, mapping=record)
            p.expire(key, ttl_s)
            p.zadd(index, {file_id: created})
            p.expire(index, index_ttl_s)
            p.execute()

    def read(self, file_id: str) -> RawRecord:
        """The record's hash (empty when there is none: missing or expired)."""
        return dict(self.client.hgetall(self.keys.api_file(file_id)))  # type: ignore[arg-type]

    def read_many(self, file_ids: list[str]) -> list[RawRecord]:
        """Each id's record, in order, in one round trip (a page of a list)."""
        with self.client.pipeline(transaction=False) as p:
            for i in file_ids:
                p.hgetall(self.keys.api_file(i))
            return [dict(raw) for raw in p.execute()]

    def remove(self, tenant: str, file_id: str) -> None:
        """Remove the record and its entry in the tenant's list, in one transaction (the caller has
        checked that the tenant owns it)."""
        with self.client.pipeline(transaction=True) as p:
            p.delete(self.keys.api_file(file_id))
            p.zrem(self.keys.api_files(tenant), file_id)
            p.execute()

    def has_record(self, file_id: str) -> bool:
        """Whether the record is still there (the sweep keeps content only while it is)."""
        return bool(self.client.exists(self.keys.api_file(file_id)))
