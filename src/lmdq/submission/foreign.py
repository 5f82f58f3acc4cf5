"""Files that are not prompt files, named by what they are instead of failing line by line.

A Parquet or CSV file handed to the JSONL reader gave "invalid JSON at column 1" on every line: true,
and no help. The first bytes (Parquet, Arrow, gzip, zip) or the suffix (.csv, .tsv) say what the file
is, so the submit is refused once, naming the format and how to get a prompt file from it.

A ``.parquet`` or ``.csv`` file never gets here: lmdq.client.sources reads it as a table first. What
does is a Parquet/CSV file under another name (``--format parquet`` reads it) or a format lmdq does not
read (TSV, Arrow IPC, Excel, compressed files).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["foreign_format", "foreign_format_message"]

_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"PAR1", "Parquet"),
    (b"ARROW1", "Arrow IPC"),
    (b"\x1f\x8b", "gzip-compressed"),
    (b"PK\x03\x04", "a zip archive (or .xlsx)"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed"),
)
_SUFFIXES = {".csv": "CSV", ".tsv": "TSV", ".parquet": "Parquet", ".pq": "Parquet", ".arrow": "Arrow IPC",
             ".feather": "Arrow IPC", ".xlsx": "Excel", ".gz": "gzip-compressed", ".zst": "zstd-compressed"}


def foreign_format(path: Path) -> str | None:
    """What ``path`` looks like when it is not text/JSONL (None: it may be a prompt file).

    ``OSError`` from reading propagates (the caller reports an unreadable file its own way)."""
    with open(path, "rb") as f:
        head = f.read(8)
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    return _SUFFIXES.get(path.suffix.lower())


def foreign_format_message(path: Path, what: str) -> str:
    """The one-line refusal for a file that looks like ``what``."""
    if what in ("gzip-compressed", "zstd-compressed"):
        cat = "zcat" if what.startswith("gzip") else "zstdcat"
        how = f"decompress it first (e.g. {cat} FILE | lmdq-producer submit -)"
    elif what in ("Parquet", "CSV"):  # under another name: lmdq reads it as a table when told so
        how = (f"name it .{what.lower()} or pass --format {what.lower()}, with --prompt-column C (or "
               "--messages-column C, --template 'Q: {col}')")
    else:
        how = ("convert it to Parquet or JSONL, e.g. with pandas: df.to_parquet('prompts.parquet') (then "
               "--prompt-column C) or df.to_json('prompts.jsonl', orient='records', lines=True)")
    return (f"{path}: looks like {what}; expected a .txt file (one prompt a line), lmdq JSONL, OpenAI Batch "
            f"JSONL, .parquet or .csv: {how}")
