"""``submit -``: prompts piped on stdin.

Submit reads its file twice (validate everything, then enqueue: nothing half-enqueued), and a pipe
can be read once, so stdin is first copied to a private temporary file, removed afterwards. The
format is decided from the content, as for a file without a ``.txt`` suffix, with one addition: a
first line that is not a JSON object makes it plain text, one prompt a line (``cat prompts.txt |
lmdq-producer submit -`` works as the file would). Errors name ``<stdin>``, not the temporary file.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from lmdq.errors import LmdqError, SubmitRejected

__all__ = ["STDIN_NAME", "is_stdin", "spooled_stdin"]

STDIN_NAME = "<stdin>"


def is_stdin(path: Path) -> bool:
    return str(path) == "-"


@contextmanager
def spooled_stdin(stream: BinaryIO | None = None, *, is_terminal: bool | None = None) -> Iterator[Path]:
    """A temporary copy of ``stream`` (stdin) for the duration of the block; lmdq errors raised in the
    block name ``<stdin>`` instead of the copy's path."""
    if is_terminal if is_terminal is not None else sys.stdin.isatty():
        raise SubmitRejected("-: stdin is a terminal; pipe prompts into it, e.g. "
                             "cat prompts.jsonl | lmdq-producer submit - --model NAME")
    src = stream if stream is not None else sys.stdin.buffer
    folder = Path(tempfile.mkdtemp(prefix="lmdq-stdin-"))
    try:
        raw = folder / "stdin"
        with open(raw, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        path = raw.rename(folder / ("stdin.jsonl" if _looks_like_json(raw) else "stdin.txt"))
        try:
            yield path
        except LmdqError as e:
            e.args = tuple(str(a).replace(str(path), STDIN_NAME) for a in e.args)
            raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _looks_like_json(path: Path) -> bool:
    """The first non-blank character is ``{`` (a BOM skipped): JSONL / OpenAI; else text. Empty is
    JSONL, whose reader then says the file has no requests."""
    with open(path, "rb") as f:
        head = f.read(1 << 16).lstrip(b"\xef\xbb\xbf").lstrip()
    return not head or head.startswith(b"{")
