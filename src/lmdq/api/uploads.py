"""A multipart/form-data body parsed as it arrives, its file part written straight to disk.

Starlette's ``request.form()`` spools a file part to a temporary file and hands it over at the end,
a second full copy of a multi-GB upload; this parser (python-multipart's streaming
``MultipartParser``, the one Starlette uses underneath) writes each chunk of the ``file`` part to
its destination as it is parsed, so memory stays one network chunk whatever the file's size. Plain
fields (``purpose``) are small and kept in memory, capped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, cast

from python_multipart.multipart import MultipartParser, parse_options_header

from lmdq.api.errors import ApiError, bad_request

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

__all__ = ["FormStream", "boundary_of"]

_MAX_FIELD_BYTES = 64 * 1024


def boundary_of(content_type: str | None) -> bytes:
    """The multipart boundary, or a 400 naming what was expected."""
    ctype, params = parse_options_header(content_type or "")
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise bad_request("expected a multipart/form-data body with fields 'file' and 'purpose'")
    boundary = params[b"boundary"]
    return boundary if isinstance(boundary, bytes) else bytes(boundary)


@dataclass
class _Part:
    headers: dict[bytes, bytes] = field(default_factory=dict)
    name: str = ""
    filename: str | None = None
    value: bytearray = field(default_factory=bytearray)


class FormStream:
    """Feed it the body's chunks (:meth:`write`); the ``file`` part goes to ``sink``."""

    def __init__(self, boundary: bytes, sink: IO[bytes], *, max_bytes: int) -> None:
        self.sink = sink
        self.max_bytes = max_bytes
        self.file_bytes = 0
        self.filename: str | None = None
        self.fields: dict[str, str] = {}
        self.files_seen = 0
        self._part = _Part()
        self._hname = bytearray()
        self._hvalue = bytearray()
        self._ended = False
        callbacks: dict[str, Any] = {
            "on_part_begin": self._on_part_begin,
            "on_part_data": self._on_part_data,
            "on_part_end": self._on_part_end,
            "on_header_field": lambda d, s, e: self._hname.extend(d[s:e]),
            "on_header_value": lambda d, s, e: self._hvalue.extend(d[s:e]),
            "on_header_end": self._on_header_end,
            "on_headers_finished": self._on_headers_finished,
            "on_end": self._on_end,
        }
        self._parser = MultipartParser(boundary, cast("MultipartCallbacks", callbacks))

    def write(self, chunk: bytes) -> None:
        try:
            self._parser.write(chunk)
        except ApiError:
            raise
        except Exception as e:  # python-multipart's MultipartParseError and friends: the body is malformed
            raise bad_request(f"malformed multipart body: {e}") from None

    def finish(self) -> None:
        try:
            self._parser.finalize()
        except Exception as e:
            raise bad_request(f"malformed multipart body: {e}") from None
        if not self._ended:
            raise bad_request("malformed multipart body: it ended before its closing boundary")

    # ---- parser callbacks -----------------------------------------------------------------
    def _on_part_begin(self) -> None:
        self._part = _Part()

    def _on_header_end(self) -> None:
        self._part.headers[bytes(self._hname).lower()] = bytes(self._hvalue)
        self._hname.clear()
        self._hvalue.clear()

    def _on_headers_finished(self) -> None:
        _disp, opts = parse_options_header(self._part.headers.get(b"content-disposition", b""))
        name = opts.get(b"name", b"")
        self._part.name = name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
        fname = opts.get(b"filename")
        if fname is not None:
            self._part.filename = fname.decode("utf-8", "replace") if isinstance(fname, bytes) else str(fname)
        if self._part.name == "file":
            self.files_seen += 1
            if self.files_seen > 1:
                raise bad_request("expected one 'file' field, got several", param="file")
            self.filename = self._part.filename or "upload.jsonl"

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._part.name == "file":
            n = end - start
            self.file_bytes += n
            if self.file_bytes > self.max_bytes:
                raise ApiError(413, f"file: larger than this server's limit of {self.max_bytes:,} bytes "
                                    "(LMDQ_API_MAX_UPLOAD_BYTES)", param="file")
            self.sink.write(data[start:end])
            return
        self._part.value.extend(data[start:end])
        if len(self._part.value) > _MAX_FIELD_BYTES:
            raise bad_request(f"field {self._part.name!r}: longer than {_MAX_FIELD_BYTES} bytes",
                              param=self._part.name)

    def _on_part_end(self) -> None:
        if self._part.name and self._part.name != "file":
            self.fields[self._part.name] = self._part.value.decode("utf-8", "replace")

    def _on_end(self) -> None:
        self._ended = True
