"""Per-request state of a submit kept on disk, so its memory is flat in the rows (issue 44).

Why: a submit keeps a few bytes for every request between its passes (the custom_id's hash for the
duplicate check, the request's own hash that pass 2 compares, its file offset and line number for prefix
grouping, its model's number in a batch over several, the custom_ids the staging lease writes to Redis).
In arrays that was ~40 bytes a request: 2,000,000 rows peaked 48 MiB above 200,000. Here each is an
append-only file of fixed-size integers (or of JSON lines) with a bounded buffer in memory; reads go
through a small window read with ``pread`` (not ``mmap``: mapped pages would count in the process' RSS
as they are touched, which is the very thing kept flat).

Files are anonymous temporary files (``tempfile.TemporaryFile``: unlinked at once, so even a killed
process leaves nothing behind), in ``directory`` (the client's spool directory, or ``TMPDIR``), and closed
by :meth:`close` / the ``with`` block. Disk: the bytes the arrays used to take in memory.
"""

from __future__ import annotations

import heapq
import json
import mmap
import os
import tempfile
from array import array
from collections.abc import Iterator
from typing import Any, BinaryIO

__all__ = ["IdChunks", "IdHashes", "RequestSpill", "SpillArray"]


def _temp(prefix: str, directory: str | None) -> BinaryIO:
    return tempfile.TemporaryFile(prefix=prefix, dir=directory)  # noqa: SIM115 - the owner's close() closes it


class SpillArray:
    """An append-only ``array(typecode)`` on disk: :attr:`BUF` items in memory, the rest in a temporary
    file; readable by index (:meth:`__getitem__`: sequential reads cost one ``pread`` per :attr:`WINDOW`
    items, a jump one of :attr:`JUMP` items) and in order (:meth:`__iter__`). For reads in an order that
    jumps all the time (a prefix plan's), :meth:`map` maps the file instead: an index is then a memoryview's,
    and every :attr:`DROP` reads the mapping's pages are dropped from the process (``MADV_DONTNEED``: they
    stay in the page cache), so its RSS stays bounded all the same."""

    BUF = 1 << 14
    WINDOW = 1 << 12
    JUMP = 1 << 6
    DROP = 1 << 16

    def __init__(self, typecode: str, directory: str | None = None) -> None:
        self.typecode = typecode
        self._size = array(typecode).itemsize
        self._directory = directory
        self._file: BinaryIO | None = None  # created at the first spill: a small array never touches disk
        self._buf = array(typecode)
        self._written = 0  # items in the file
        self._win = array(typecode)
        self._win_at = 0
        self._mm: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._reads = 0

    def __enter__(self) -> SpillArray:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def map(self) -> None:
        """Read by index through a read-only mapping of the file from now on (no more appends)."""
        if self._buf:
            self._spill()
        if self._file is not None and self._mm is None:
            self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            self._view = memoryview(self._mm).cast(self.typecode)  # type: ignore[call-overload]

    def __len__(self) -> int:
        return self._written + len(self._buf)

    def append(self, value: int) -> None:
        self._buf.append(value)
        if len(self._buf) >= self.BUF:
            self._spill()

    def extend(self, values: array[int]) -> None:
        """Append every item of ``values`` (an array of this typecode) at once."""
        self._buf.extend(values)
        if len(self._buf) >= self.BUF:
            self._spill()

    def _spill(self) -> None:
        if self._file is None:
            self._file = _temp(f"lmdq-{self.typecode}-", self._directory)
        os.pwrite(self._file.fileno(), self._buf.tobytes(), self._written * self._size)
        self._written += len(self._buf)
        self._buf = array(self.typecode)

    def _read(self, start: int, count: int) -> array[int]:
        out = array(self.typecode)
        assert self._file is not None
        out.frombytes(os.pread(self._file.fileno(), count * self._size, start * self._size))
        if len(out) != count:
            raise OSError(f"a spill file ended early at item {start + len(out)}")
        return out

    def __getitem__(self, index: int) -> int:
        if self._view is not None:
            self._reads += 1
            if self._reads >= self.DROP:
                self._reads = 0
                assert self._mm is not None
                self._mm.madvise(mmap.MADV_DONTNEED)
            return int(self._view[index])
        if index < 0:
            index += len(self)
        if index >= self._written:
            return self._buf[index - self._written]
        rel = index - self._win_at
        if 0 <= rel < len(self._win):
            return self._win[rel]
        if index < 0:
            raise IndexError(index)
        # the next item after the window: a sequential read, a whole window at a time; anywhere else (a prefix
        # plan's order jumps between groups): a few items, so a jump costs a small pread, not WINDOW items
        size = self.WINDOW if rel == len(self._win) else self.JUMP
        self._win_at = index
        self._win = self._read(index, min(size, self._written - index))
        return self._win[0]

    def __iter__(self) -> Iterator[int]:
        written = self._written
        for start in range(0, written, self.WINDOW):
            yield from self._read(start, min(self.WINDOW, written - start))
        yield from self._buf[: len(self) - written]


def id_hash(custom_id: str) -> int:
    """A custom_id's 64-bit hash, as :class:`IdHashes` holds them: Python's own string hash (C speed, cached;
    stable within the process, which is all the duplicate check needs: the pass that collects the hashes and
    the re-scan naming the duplicate lines run in it; a collision only costs that re-scan). A blake2b digest
    per id was ~4 % of a submit's CPU (issue 49)."""
    return hash(custom_id) & 0xFFFF_FFFF_FFFF_FFFF


class IdHashes:
    """The 8-byte hashes of custom_ids, for the duplicate check, kept on disk: sorted runs of :attr:`RUN`
    hashes appended to a temporary file (256 KiB, and ~1.3 MiB while a run is sorted), then merged from the
    file :attr:`READ` hashes per run at a time (2 KiB a run: 0.6 MiB for 10 M rows). Memory stays flat in
    the rows; disk is 8 bytes a row, deleted on :meth:`close`. Used by the client's spooling
    (:mod:`lmdq.client.sources`) and by submit's pass 1 (:mod:`lmdq.submission.submit`)."""

    RUN = 1 << 15
    READ = 256

    def __init__(self, directory: str | None = None) -> None:
        self._file = _temp("lmdq-ids-", directory)
        self._buf = array("Q")
        self._runs: list[tuple[int, int]] = []  # (first hash's index in the file, hashes) per run
        self._written = 0

    def __enter__(self) -> IdHashes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def __len__(self) -> int:
        return self._written + len(self._buf)

    def add(self, h: int) -> None:
        self._buf.append(h)
        if len(self._buf) >= self.RUN:
            self._flush()

    def extend(self, hashes: array[int]) -> None:
        """:meth:`add` of each of ``hashes`` (an ``array("Q")``)."""
        self._buf.extend(hashes)
        if len(self._buf) >= self.RUN:
            self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        run = array("Q", sorted(self._buf))
        os.pwrite(self._file.fileno(), run.tobytes(), self._written * run.itemsize)
        self._runs.append((self._written, len(run)))
        self._written += len(run)
        self._buf = array("Q")

    def _read(self, start: int, count: int) -> Iterator[int]:
        fd = self._file.fileno()
        end = start + count
        while start < end:
            chunk = array("Q")
            chunk.frombytes(os.pread(fd, min(self.READ, end - start) * chunk.itemsize, start * chunk.itemsize))
            if not chunk:
                raise OSError(f"the id hashes' file ended early at hash {start}")
            start += len(chunk)
            yield from chunk

    def duplicates(self) -> set[int]:
        """The hashes seen more than once (each a duplicate id, or a 64-bit collision the re-read rules out)."""
        if not self._runs:  # one run at most: sorted in memory, no file read back
            run = sorted(self._buf)
            return {h for a, h in zip(run, run[1:]) if a == h}
        self._flush()
        dup: set[int] = set()
        prev: int | None = None
        for h in heapq.merge(*(self._read(start, count) for start, count in self._runs)):
            if h == prev:
                dup.add(h)
            prev = h
        return dup


_IDS_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


class IdChunks:
    """Custom_ids in input order as JSON arrays of ``per_chunk`` (the staging lease's ``request_ids`` list,
    :mod:`lmdq.batches.staging`), one a line of a temporary file; :meth:`chunks` reads them back in order,
    a line at a time, for the ledger to push to Redis in bounded batches."""

    def __init__(self, per_chunk: int, directory: str | None = None) -> None:
        self.per_chunk = per_chunk
        self._directory = directory
        self._file: Any = None
        self._ids: list[str] = []
        self._count = 0  # chunks written

    def __enter__(self) -> IdChunks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def add(self, custom_id: str) -> None:
        self._ids.append(custom_id)
        if len(self._ids) == self.per_chunk:
            self._write()

    def extend(self, custom_ids: list[str]) -> None:
        """:meth:`add` of each of ``custom_ids``, in order (whole chunks written at once)."""
        at = 0
        while at < len(custom_ids):
            take = self.per_chunk - len(self._ids)
            self._ids.extend(custom_ids[at : at + take])
            at += take
            if len(self._ids) == self.per_chunk:
                self._write()

    def _write(self) -> None:
        if self._file is None:
            self._file = _temp("lmdq-cids-", self._directory)
        self._file.write(_IDS_JSON.encode(self._ids).encode("utf-8", "surrogatepass") + b"\n")
        self._count += 1
        self._ids = []

    def __len__(self) -> int:
        """Chunks, the last partial one included."""
        return self._count + (1 if self._ids else 0)

    def chunks(self) -> Iterator[bytes]:
        """Every chunk in order, each a JSON array's UTF-8 bytes."""
        if self._file is not None:
            self._file.flush()
            with open(self._file.fileno(), "rb", closefd=False) as f:
                f.seek(0)
                for line in f:
                    yield line[:-1]
        if self._ids:
            yield _IDS_JSON.encode(self._ids).encode("utf-8", "surrogatepass")


class RequestSpill:
    """The requests pass 1 validated, each as the JSON its job will hold, in input order in a temporary file,
    with their offsets (:class:`SpillArray`): what submit's pass 2 stages, read back by index or in order,
    never parsed from the input file again (issue 49: the second parse and its per-request hash were ~40 %
    of a submit's CPU)."""

    def __init__(self, directory: str | None = None) -> None:
        self._file = _temp("lmdq-reqs-", directory)
        self._ends = SpillArray("Q", directory)  # end offset of each request
        self._at = 0
        self._fd = self._file.fileno()

    def __enter__(self) -> RequestSpill:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._ends.close()
        self._file.close()

    def __len__(self) -> int:
        return len(self._ends)

    def add(self, data: bytes) -> None:
        self._file.write(data)
        self._at += len(data)
        self._ends.append(self._at)

    def add_many(self, data: bytes | memoryview, ends: array[int]) -> None:
        """:meth:`add` of consecutive requests at once: ``data`` their bytes end to end, ``ends`` where each
        ends in ``data`` (the builder's column of request JSON: lmdq.client.sources)."""
        self._file.write(data)
        at = self._at
        self._ends.extend(array("Q", [at + e for e in ends]))
        self._at += len(data)

    def map(self) -> None:
        """Reads by index jump about from now on (a prefix plan's order): see :meth:`SpillArray.map`."""
        self._file.flush()
        self._ends.map()

    def __getitem__(self, index: int) -> bytes:
        self._file.flush()
        start = self._ends[index - 1] if index > 0 else 0
        end = self._ends[index]
        data = os.pread(self._fd, end - start, start)
        if len(data) != end - start:
            raise OSError(f"the requests' spill file ended early at request {index}")
        return data

    def __iter__(self) -> Iterator[bytes]:
        """Every request in order, read :attr:`READ` bytes at a time (``pread``: the file's offset is left
        alone)."""
        self._file.flush()
        buf = b""
        buf_at = 0  # file offset of buf[0]
        prev = 0
        for end in self._ends:
            if end - buf_at > len(buf):
                # The unread tail is read again from the file (the page cache has it) rather than joined to
                # the next read, and the old buffer is let go first: one READ in memory at a time, whether
                # the requests fill one read or a thousand (a join held three).
                buf = b""
                buf = os.pread(self._fd, max(self.READ, end - prev), prev)
                buf_at = prev
                if end - buf_at > len(buf):
                    raise OSError("the requests' spill file ended early")
            yield buf[prev - buf_at : end - buf_at]
            prev = end

    READ = 1 << 20
