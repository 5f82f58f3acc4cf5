"""What :meth:`lmdq.Client.submit` accepts as a source, and how each kind is read.

* A path (``str`` or ``os.PathLike``): ``.txt`` / ``.jsonl`` (lmdq or OpenAI Batch lines, told apart by
  the first line) go to the file pipeline as they always did; ``.parquet`` and ``.csv`` are read by
  pyarrow, a record batch / row group at a time, only the mapped columns. ``format=`` overrides the
  suffix: ``text``, ``jsonl``, ``openai``, ``parquet``, ``csv``.
* Anything that speaks Arrow: an object with ``__arrow_c_stream__`` (pyarrow Table and
  RecordBatchReader, pandas >= 2.2 and polars DataFrames, DuckDB relations ...), a pyarrow
  RecordBatch, a Hugging Face ``datasets.Dataset`` (read through its Arrow table, batch by batch).
* Any other iterable of ``str`` (one prompt each) or ``dict`` (one row each), consumed once, in chunks.

Rows of the last two kinds, and tabular files, are validated one by one as they stream
(:mod:`lmdq.submission.formats.tabular`) into a *spool*: an lmdq JSONL file on local disk (``TMPDIR``)
holding the validated requests, which the file pipeline then submits with its rules (whole-batch
validation, duplicate ids, prefix groups, Redis headroom, all or nothing). Memory stays flat in the
number of rows, whatever the source: what the spooling keeps per row (its custom_id's hash, for the
duplicate check) goes to disk beside the spool in sorted runs (:class:`IdHashes`), merged from there; the
spool is deleted when the submit returns.
"""

from __future__ import annotations

import json
import os
import re
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from zlib import crc32

import orjson

from lmdq.errors import InputProblem, InvalidArgument, SubmitRejected
from lmdq.images.refs import ImageChecker
from lmdq.submission.formats import InputFormat, InputLimits
from lmdq.submission.formats.records import ParsedLine, Sampling
from lmdq.submission.formats.tabular import ColumnMap, RowCount, RowError, RowMapper, chunked
from lmdq.submission.formats.validation import _MAX_CUSTOM_ID
from lmdq.submission.spill import IdHashes, id_hash

if TYPE_CHECKING:
    from lmdq.submission.submit import Prevalidated

__all__ = ["FileSource", "IdHashes", "RowSource", "classify", "spool"]

FILE_FORMATS = {"text": InputFormat.text, "jsonl": InputFormat.jsonl, "openai": InputFormat.openai}
TABULAR_FORMATS = ("parquet", "csv")
FILE_ROWS = RowCount(base=1)
"""A Parquet or CSV file's rows are counted from 1 in errors, as a viewer or a spreadsheet numbers them."""
ARROW_BATCH_ROWS = 4096
"""Rows per record batch read from Parquet/CSV: the reader decodes this many rows of the mapped columns
at a time, on this thread (``use_threads=False``: decoding is not the bottleneck, the per-row checks are,
and a thread pool's buffers would only raise the peak)."""


@dataclass(frozen=True)
class FileSource:
    """A prompt file for the file pipeline (txt / JSONL / OpenAI Batch JSONL)."""

    path: Path
    fmt: InputFormat | None


@dataclass(frozen=True)
class RowSource:
    """Rows to validate and spool: ``name`` is what errors call the source; a chunk is a list of rows or
    a pyarrow RecordBatch; ``count`` how its user counts its rows (errors name a row that way)."""

    name: str
    chunks: Iterable[Any]
    count: RowCount = RowCount()

    def reword(self, text: str, spool: str) -> str:
        """Text the file pipeline wrote about the spool (``/tmp/.../rows.jsonl:5: field ...``, ``3 lines set
        ... (first: line 1)``), as this source's user counts: its name, its rows (spool line n is the row
        at position n-1, named by :attr:`count`); no temporary path is left in it (issue 45)."""
        text = re.sub(re.escape(spool) + r":(\d+)\b", lambda m: f"{self.name}: {self.count.where(int(m[1]) - 1)}", text)
        text = text.replace(spool, self.name)
        text = re.sub(r"\bline (\d+)\b", lambda m: self.count.where(int(m[1]) - 1), text)
        return re.sub(r"\b(\d[\d,]*) line(s?)\b", r"\1 row\2", text)

    def relocate(self, p: InputProblem, spool: str) -> InputProblem:
        """A problem the file pipeline found in the spool, located in this source: its row's position and
        (a DataFrame's) index label instead of the spool's line; other problems unchanged."""
        if p.source != spool:
            return p
        message = self.reword(p.message, spool)
        if p.line:
            row = p.line - 1
            return InputProblem(message=message, source=self.name, row=row, index=self.count.label(row),
                                field=p.field, value=p.value)
        return InputProblem(message=message, source=self.name, field=p.field, value=p.value)


def _need_pyarrow(what: str) -> Any:
    try:
        import pyarrow

        return pyarrow
    except ImportError:
        raise SubmitRejected(f"{what} needs pyarrow: pip install 'lmdq[data]'") from None


def _python_name(name: str) -> str:
    return name


def _opt(spell: Callable[[str], str], name: str) -> str:
    """An option as the caller's surface writes it: ``prompt_column=`` (Python), ``--prompt-column`` (CLI)."""
    s = spell(name)
    return s if s.startswith("-") else f"{s}="


def _check_params(cmap: ColumnMap, spell: Callable[[str], str]) -> None:
    """A params column must name a generation parameter: refused once, before any row is read (issue 45:
    ``--params-column mnt`` repeated a 286-column error once per row)."""
    from lmdq.contract import GenerationParams
    from lmdq.submission.formats.jsonl import PARAM_ALIASES

    known = set(GenerationParams.model_fields) | set(PARAM_ALIASES)
    for column, param in cmap.params.items():
        if param not in known:
            raise InvalidArgument(f"{_opt(spell, 'params_columns')}: {param!r} is not a generation parameter "
                                  "(max_new_tokens, temperature, top_p, seed, stop, ...: docs/outputs.md)",
                                  field="params_columns", value=column)


def _columns_for(names: Sequence[str], cmap: ColumnMap, name: str,
                 spell: Callable[[str], str] = _python_name) -> list[str]:
    """The source's columns a request is made of; a mapped column the source lacks is refused now."""
    missing = [c for c in cmap.columns() if c not in names]
    if missing:
        shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
        raise SubmitRejected(f"{name}: column {missing[0]!r} not found; the source has: {shown or '(no columns)'}")
    wanted = set(cmap.columns())
    if not (cmap.prompt_column or cmap.messages_column or cmap.template):
        defaults = [c for c in ("prompt", "messages") if c in names]
        if not defaults and not cmap.image_column:  # an image column alone is a request: the image, no text
            raise SubmitRejected(f"{name}: no 'prompt' or 'messages' column; pass {_opt(spell, 'prompt_column')}, "
                                 f"{_opt(spell, 'messages_column')} or {_opt(spell, 'template')} (the source has: "
                                 f"{', '.join(names[:20])})")
        wanted |= {c for c in ("prompt", "messages", "params", "endpoint") if c in names}
    if not cmap.id_column and "custom_id" in names:
        wanted.add("custom_id")
    if "continuations" in names:  # endpoint score's texts (read only for score rows)
        wanted.add("continuations")
    return [c for c in names if c in wanted]


def _reader_chunks(reader: Any, cmap: ColumnMap, name: str,
                   spell: Callable[[str], str] = _python_name) -> Iterator[Any]:
    """The reader's record batches, only the columns a request is made of."""
    cols = _columns_for(list(reader.schema.names), cmap, name, spell)
    for batch in reader:
        if batch.num_rows:
            yield batch.select(cols)


def _arrow_reader(source: Any) -> Any | None:
    """A pyarrow RecordBatchReader over ``source`` if it speaks Arrow, else None."""
    mod = type(source).__module__.split(".")[0]
    if mod == "datasets" and hasattr(source, "with_format"):  # a Hugging Face Dataset: its Arrow table
        pa = _need_pyarrow("a Hugging Face dataset")
        arrow = source.with_format("arrow")

        def hf_batches() -> Iterator[Any]:
            for table in arrow.iter(batch_size=ARROW_BATCH_ROWS):
                yield from table.to_batches()

        return pa.RecordBatchReader.from_batches(arrow[:0].schema, hf_batches())
    if _is_pandas(source):
        return _pandas_reader(source)
    if hasattr(source, "__arrow_c_stream__"):
        pa = _need_pyarrow(type(source).__name__)
        return pa.RecordBatchReader.from_stream(source)
    if hasattr(source, "__arrow_c_array__"):  # a RecordBatch
        pa = _need_pyarrow(type(source).__name__)
        return pa.table(source).to_reader()
    return None


def _is_pandas(source: Any) -> bool:
    """A pandas DataFrame (read through :func:`_pandas_reader`; its rows named by index label)."""
    return type(source).__module__.split(".")[0] == "pandas" and hasattr(source, "to_dict")


def _pandas_reader(df: Any) -> Any:
    """A DataFrame as Arrow. A column Arrow cannot type (an object column mixing str and int) is an lmdq
    error naming the first row whose value's type differs from the column's first value (by its index
    label; ``row`` its ``df.iloc`` position), not a raw ``ArrowTypeError`` (issue 45)."""
    pa = _need_pyarrow("a pandas DataFrame")
    try:
        return pa.Table.from_pandas(df, preserve_index=False).to_reader()
    except (pa.ArrowTypeError, pa.ArrowInvalid) as e:
        for col in df.columns:
            try:
                pa.array(df[col], from_pandas=True)
            except (pa.ArrowTypeError, pa.ArrowInvalid):
                values = df[col]
                first = next((v for v in values if v is not None and v == v), None)
                count = RowCount(labels=df.index)
                for pos, v in enumerate(values):
                    if v is not None and v == v and type(v) is not type(first):
                        raise SubmitRejected(
                            f"DataFrame: {count.where(pos)}: column {col!r}: expected a {type(first).__name__} "
                            f"like the column's first value, got {v!r} ({type(v).__name__})",
                            problems=[InputProblem(message=f"expected a {type(first).__name__} like the column's "
                                                           f"first value, got {v!r} ({type(v).__name__})",
                                                   source="DataFrame", row=pos, index=count.label(pos),
                                                   column=str(col), value=v)]) from None
                raise SubmitRejected(f"DataFrame: column {col!r}: {e}") from None
        raise SubmitRejected(f"DataFrame: {e}") from None


def _tabular_file(path: Path, fmt: str, cmap: ColumnMap, spell: Callable[[str], str] = _python_name) -> RowSource:
    name = str(path)
    if not path.is_file():
        raise SubmitRejected(f"{path}: no such file")
    pa = _need_pyarrow(f"a {fmt} file")
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(path)
            cols = _columns_for(list(pf.schema_arrow.names), cmap, name, spell)

            def parquet_chunks() -> Iterator[Any]:
                yield from pf.iter_batches(batch_size=ARROW_BATCH_ROWS, columns=cols, use_threads=False)

            return RowSource(name, parquet_chunks(), FILE_ROWS)
        import pyarrow.csv as pcsv

        # the columns a prompt, an id or a model come from are text as written, even where they look like
        # numbers ("001", "42": issue 45 refused a numeric-looking prompt column)
        text = {c: pa.string() for c in (cmap.prompt_column or "prompt", cmap.messages_column or "messages",
                                         cmap.id_column or "custom_id", cmap.model_column, cmap.image_column) if c}
        reader = pcsv.open_csv(path, read_options=pcsv.ReadOptions(block_size=4 << 20, use_threads=False),
                               convert_options=pcsv.ConvertOptions(column_types=text))
        return RowSource(name, _reader_chunks(reader, cmap, name, spell), FILE_ROWS)
    except (OSError, pa.ArrowException) as e:
        raise SubmitRejected(f"{path}: cannot read the {fmt} file: {e}") from e


def classify(source: Any, *, fmt: str | None, cmap: ColumnMap,
             spell: Callable[[str], str] = _python_name) -> FileSource | RowSource:
    """Tell what ``source`` is (see the module's docstring); ``spell`` names options as the caller's surface
    does (Python keywords, CLI flags)."""
    _check_params(cmap, spell)
    if fmt is not None and fmt not in (*FILE_FORMATS, *TABULAR_FORMATS):
        raise SubmitRejected(f"format: expected one of {', '.join((*FILE_FORMATS, *TABULAR_FORMATS))}, got {fmt!r}")
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        kind = fmt or {".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}.get(path.suffix.lower())
        if kind in TABULAR_FORMATS:
            return _tabular_file(path, kind, cmap, spell)
        if cmap != ColumnMap(endpoint=cmap.endpoint):  # endpoint= applies to files too (every line's)
            raise SubmitRejected(f"{path}: column options ({_opt(spell, 'prompt_column')}, {_opt(spell, 'id_column')}, "
                                 f"{_opt(spell, 'template')} ...) apply to Parquet, CSV, Arrow and Python rows, not to "
                                 "a prompt file")
        return FileSource(path, FILE_FORMATS[kind] if kind else None)
    if isinstance(source, (bytes, dict)):
        raise SubmitRejected(f"source: expected a path, an iterable of rows or an Arrow-speaking object, got "
                             f"{type(source).__name__}")
    reader = _arrow_reader(source)
    if reader is not None:
        name = type(source).__name__
        count = RowCount(labels=source.index) if _is_pandas(source) else RowCount()
        return RowSource(name, _reader_chunks(reader, cmap, name, spell), count)
    if isinstance(source, Iterable):
        return RowSource("rows", chunked(source))
    raise SubmitRejected(f"source: expected a path, an iterable of rows or an Arrow-speaking object, got "
                         f"{type(source).__name__}")


_ENCODE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), check_circular=False).encode


def _line(obj: dict[str, Any]) -> bytes:
    """One spool line: the row's lmdq JSONL object, which parses back to exactly the request validated."""
    return _ENCODE(obj).encode("utf-8", "surrogatepass") + b"\n"


class _FastPath:
    """Record batches of the common shape (a string prompt column, a string or integer id column,
    numeric parameter columns) checked column-wise: each parameter value is validated once per distinct
    value (by the row parser itself), each prompt and id by a few C-level checks, and the row's JSONL
    object is built without the per-row parser. Any doubt (a value the checks do not pass) sends the
    whole record batch to the row parser, which names the row and column exactly as it always does."""

    _NUMERIC = frozenset({"max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
                          "repetition_penalty", "random_seed", "logprobs"})

    def __init__(self, cmap: ColumnMap, mapper: RowMapper, schema: Any) -> None:
        import pyarrow.types as t

        from lmdq.submission.formats.jsonl import PARAM_ALIASES

        self.mapper = mapper
        self.prompt = cmap.prompt_column
        self.id = cmap.id_column
        self.endpoint = cmap.endpoint.value if cmap.endpoint is not None else None
        self.params = cmap.params
        self.seen: dict[str, set[Any]] = {c: set() for c in self.params}
        names = {PARAM_ALIASES.get(p, p) for p in self.params.values()}
        self.ok = (
            cmap.model_column is None  # the fast line has no model: each row's model goes through the row parser
            and cmap.image_column is None  # nor images: each row's image is checked by the row parser
            # score rows carry continuations: the row parser
            and self.endpoint in (None, "chat", "completion", "embedding")
            and self.prompt is not None and self.prompt in schema.names
            and (t.is_string(schema.field(self.prompt).type) or t.is_large_string(schema.field(self.prompt).type))
            and (self.id is None or (self.id in schema.names and (
                t.is_string(schema.field(self.id).type) or t.is_large_string(schema.field(self.id).type)
                or t.is_integer(schema.field(self.id).type))))
            and names <= self._NUMERIC and len(names) == len(self.params)
            and not {"min_new_tokens", "max_new_tokens"} <= names
            and all(c in schema.names and (t.is_integer(schema.field(c).type) or t.is_floating(schema.field(c).type))
                    for c in self.params)
        )

    def lines(self, batch: Any, row0: int) -> list[tuple[str, bytes]] | None:
        """(custom_id, spool line) per row of ``batch``, or None when some row needs the row parser."""
        prompts = batch.column(self.prompt).to_pylist()
        ids = batch.column(self.id).to_pylist() if self.id is not None else range(row0, row0 + len(prompts))
        pcols = [(p, c, batch.column(c).to_pylist()) for c, p in self.params.items()]
        probe: dict[str, Any] = {c: "x" for c in (self.prompt, self.id) if c is not None}
        for _, c, values in pcols:
            fresh = set(values) - self.seen[c]
            fresh.discard(None)
            for v in fresh:  # the row parser decides each distinct value once
                if isinstance(self.mapper({**probe, c: v}, 0), RowError):
                    return None
            if len(self.seen[c]) < 10_000:  # a column of (nearly) unique values is checked per batch instead
                self.seen[c] |= fresh
        out: list[tuple[str, bytes]] = []
        ep = self.endpoint
        for k, prompt in enumerate(prompts):
            cid = ids[k]
            if type(cid) is int:
                cid = str(cid)
            elif type(cid) is not str or not cid or len(cid) > _MAX_CUSTOM_ID:
                return None
            if type(prompt) is not str or not prompt or prompt.isspace():
                return None
            obj: dict[str, Any] = {"custom_id": cid, "prompt": prompt}
            params = {p: values[k] for p, _, values in pcols if values[k] is not None}
            if params:
                obj["params"] = params
            if ep is not None:
                obj["endpoint"] = ep
            out.append((cid, _line(obj)))
        return out


class _Columns:
    """The column path (issue 49): a record batch of :class:`_FastPath`'s shape, validated with Arrow
    compute functions a column at a time, written to the spool AND into pass 1's state for submit
    (:class:`lmdq.submission.submit.Prevalidated`), each request's JSON built column-wise in C, so the
    file pipeline never parses the spool again. Exact, or nothing: a value these checks cannot prove valid
    (a null, an empty or whitespace-only prompt, an id over the limit, invalid UTF-8, a parameter the row
    parser refuses) makes :meth:`take` answer False, and the batch goes through the row parser as before,
    which names the row and column (and submit then parses the spool as any file). Each distinct
    combination of parameter values is validated once by the row parser itself, and its request holds what
    that gave (``params`` as the contract dumps it), exactly as a JSONL line's would."""

    def __init__(self, fast: _FastPath, mapper: RowMapper, schema: Any, staged: Prevalidated,
                 max_line_bytes: int) -> None:
        import pyarrow.types as t

        self.mapper = mapper
        self.staged = staged
        self.max_line_bytes = max_line_bytes
        self.prompt = fast.prompt
        self.id_col = mapper.id_col if mapper.id_col in schema.names else None
        self.params = list(fast.params.items())  # (column, parameter)
        self.spool_ep = b',"endpoint":' + orjson.dumps(fast.endpoint) if fast.endpoint else b""
        #: parameter values (a tuple, one per params column) -> (the spool's params part, the job's, the
        #: sampling the row parser implied from them: submit warns, once per kind, naming the first row)
        self.frags: dict[Any, tuple[bytes, bytes, Sampling | None]] = {}
        self.job_ep: bytes | None = None  # the requests' endpoint as the job holds it (from the row parser)
        self.sampled: list[tuple[Sampling, int]] = []  # this batch's rows whose sampling was implied
        self.at = 0  # bytes of the spool written
        id_type = schema.field(self.id_col).type if self.id_col is not None else None
        self.int_ids = id_type is not None and t.is_integer(id_type)
        self.ok = fast.ok and staged.ok and (id_type is None or self.int_ids or t.is_string(id_type)
                                             or t.is_large_string(id_type))

    def _probe(self, values: tuple[Any, ...]) -> tuple[bytes, bytes, Sampling | None] | None:
        """The params parts of a row with these parameter values, validated by the row parser (and the sampling
        it implied); None if it refuses them."""
        row: dict[str, Any] = {self.prompt or "prompt": "x"}
        if self.id_col is not None:
            row[self.id_col] = "x"
        given = {}
        for (column, param), v in zip(self.params, values):
            if v is not None:
                row[column] = v
                given[param] = v
        got = self.mapper(row, 0)
        if isinstance(got, RowError):
            return None
        item = got[0]
        if item.prompt != "x" or item.messages is not None or item.model is not None or item.continuations is not None:
            return None
        from lmdq.submission.submit import _params_dump

        ep = orjson.dumps(item.endpoint.value)
        if self.job_ep is None:
            self.job_ep = ep
        elif ep != self.job_ep:
            return None
        dump = _params_dump(item.params) if item.params is not None else {}
        return (b',"params":' + orjson.dumps(given) if given else b"",
                b',"params":' + orjson.dumps(dump) if dump else b"", item.sampling)

    def _params(self, batch: Any, row0: int, n: int) -> tuple[list[bytes], list[bytes]] | None:
        if not self.params:
            got = self.frags.get(()) or self._probe(())
            if got is None or got[2] is not None:
                return None
            self.frags[()] = got
            return [got[0]] * n, [got[1]] * n
        columns = [batch.column(c).to_pylist() for c, _ in self.params]
        keys: Iterable[Any] = zip(*columns)
        frags = self.frags
        spool_parts: list[bytes] = []
        job_parts: list[bytes] = []
        sampled: list[tuple[Sampling, int]] = []
        for k, key in enumerate(keys):
            got = frags.get(key)
            if got is None:
                if len(frags) >= 10_000:  # (nearly) unique values: the row path checks them
                    return None
                got = self._probe(key)
                if got is None:
                    return None
                frags[key] = got
            spool_parts.append(got[0])
            job_parts.append(got[1])
            if got[2] is not None:
                sampled.append((got[2], row0 + k + 1))
        self.sampled = sampled
        return spool_parts, job_parts

    def _quoted(self, col: Any) -> Any:
        """A string column as JSON strings (binary): quotes around it, or orjson's escapes where needed."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if pc.any(pc.match_substring_regex(col, r'["\\\x00-\x1f]')).as_py():
            return _binary([orjson.dumps(v) for v in col.to_pylist()])
        return pc.binary_join_element_wise(_const(b'"'), col.cast(pa.binary()), _const(b'"'), _const(b""))

    def take(self, batch: Any, row0: int, out: IO[bytes], hashes: IdHashes) -> bool:
        """Validate ``batch`` (rows ``row0``...) column-wise and write it to the spool and to pass 1's state;
        False, having written nothing, when some row needs the row parser."""
        import pyarrow as pa
        import pyarrow.compute as pc

        n = batch.num_rows
        try:
            prompts = batch.column(self.prompt)
            if prompts.null_count:
                return False
            prompts.validate(full=True)  # valid UTF-8
            if pa.types.is_large_string(prompts.type):
                prompts = prompts.cast(pa.string())
            # not empty, not only whitespace: a printable ASCII character settles it, the rest as Python says
            shown = pc.match_substring_regex(prompts, "[!-~]")
            if not pc.all(shown).as_py():
                for p in pc.filter(prompts, pc.invert(shown)).to_pylist():
                    if not p or p.isspace():
                        return False
            if self.id_col is None:
                ids = _positions(row0, n)
            else:
                ids = batch.column(self.id_col)
                if ids.null_count:
                    return False
                if self.int_ids:
                    ids = pc.cast(ids, pa.string())
                else:
                    ids.validate(full=True)
                    if pa.types.is_large_string(ids.type):
                        ids = ids.cast(pa.string())
                    lengths = pc.min_max(pc.utf8_length(ids)).as_py()
                    if lengths["min"] < 1 or lengths["max"] > _MAX_CUSTOM_ID:
                        return False
            self.sampled = []
            parts = self._params(batch, row0, n)
            if parts is None or self.job_ep is None:
                return False
            qids, qprompts = self._quoted(ids), self._quoted(prompts)
            spool_params, job_params = _binary(parts[0]), _binary(parts[1])
            lines = pc.binary_join_element_wise(_const(b'{"custom_id":'), qids, _const(b',"prompt":'), qprompts,
                                                spool_params, _const(self.spool_ep + b"}\n"), _const(b""))
            index = _positions(row0, n).cast(pa.binary())
            jobs = pc.binary_join_element_wise(_const(b'{"index":'), index, _const(b',"custom_id":'), qids,
                                               _const(b',"endpoint":' + self.job_ep + b',"prompt":'), qprompts,
                                               job_params, _const(b"}"), _const(b""))
            if pc.max(pc.binary_length(lines)).as_py() - 1 > self.max_line_bytes:
                return False
        except (pa.ArrowException, UnicodeDecodeError, TypeError, ValueError):
            return False
        id_list: list[str] = ids.to_pylist()
        data, ends = _contiguous(lines)
        out.write(data)
        starts = [0, *ends[:-1]]
        staged = self.staged
        staged.line_crcs.extend(array("I", [crc32(data[s : e - 1]) for s, e in zip(starts, ends)]))
        job_data, job_ends = _contiguous(jobs)
        staged.spilled.add_many(job_data, array("Q", job_ends))
        staged.id_chunks.extend(id_list)
        hashes.extend(array("Q", map(id_hash, id_list)))
        if staged.prefixes is not None:
            at = self.at
            offsets = array("Q", [at + s for s in starts])
            line_nos = array("I", range(row0 + 1, row0 + n + 1))
            if staged.prefixes.unkeyed(pc.max(pc.utf8_length(prompts)).as_py() + 7):
                staged.prefixes.add_unkeyed(offsets, line_nos)
            else:
                from lmdq.contract import Endpoint

                endpoint = Endpoint(orjson.loads(self.job_ep))
                for off, line_no, cid, prompt in zip(offsets, line_nos, id_list, prompts.to_pylist()):
                    staged.prefixes.add(off, ParsedLine(line_no, cid, prompt, None, endpoint, None, None))
        for sampling, line_no in self.sampled:
            staged.sampling.note(sampling, line_no)
        self.at += len(data)
        staged.requests += n
        return True


def _binary(parts: list[bytes]) -> Any:
    """``parts`` as an Arrow binary array, built from its buffers: ``pa.array`` of a Python list imports pandas
    to ask whether the list is one of its objects (~0.5 s of a submit's CPU where pandas is installed)."""
    import pyarrow as pa

    offsets = array("i", accumulate(map(len, parts), initial=0))
    return pa.Array.from_buffers(pa.binary(), len(parts), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(parts))])


_CONSTS: dict[bytes, Any] = {}


def _const(value: bytes) -> Any:
    """``value`` as an Arrow binary scalar, taken from a one-item array: ``pa.scalar`` (and a compute function
    given a Python value) imports pandas (see :func:`_binary`)."""
    got = _CONSTS.get(value)
    if got is None:
        got = _CONSTS[value] = _binary([value])[0]
    return got


def _positions(start: int, n: int) -> Any:
    """``start`` .. ``start + n - 1`` as an Arrow string array (built from a buffer: see :func:`_binary`)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    ints = pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(array("q", range(start, start + n)))])
    return pc.cast(ints, pa.string())


def _contiguous(arr: Any) -> tuple[memoryview, list[int]]:
    """A binary array's values end to end (one memoryview of its data buffer) and where each ends in it."""
    bufs = arr.buffers()
    raw = array("i")  # a binary array's offsets are int32, one more than its values
    raw.frombytes(memoryview(bufs[1])[arr.offset * 4 : (arr.offset + len(arr) + 1) * 4])
    offsets = raw.tolist()
    first = offsets[0]
    data = memoryview(bufs[2])[first : offsets[-1]]
    return data, [o - first for o in offsets[1:]]


def _row_problem(err: RowError, row: Any, count: RowCount) -> InputProblem:
    """A bad row as data: its 0-based position (and a DataFrame's index label), column, and the value refused
    (a dict row's cell, a str row)."""
    if isinstance(row, str):
        value: Any = row
    elif isinstance(row, Mapping) and err.field is not None:
        value = row.get(err.field)
    else:
        value = None
    return InputProblem(message=err.message, source=err.path, row=err.row, index=count.label(err.row),
                        column=err.field, value=value)


def spool(src: RowSource, cmap: ColumnMap, out: IO[bytes], *, max_errors: int = 20,
          max_requests: int = InputLimits().max_requests,
          progress: Callable[[int], None] | None = None, images: ImageChecker | None = None,
          staged: Prevalidated | None = None, max_line_bytes: int = InputLimits().max_line_bytes) -> int:
    """Validate every row of ``src`` into ``out`` (lmdq JSONL, one line per row: line n is row n-1).

    Returns the rows written; raises SubmitRejected naming the first bad rows (up to ``max_errors``)
    or the duplicate ids, having read the whole source (a file's submit shows every problem too).
    Memory is flat in the rows: the ids' hashes wait on disk beside ``out`` (:class:`IdHashes`).
    ``staged``: pass 1's state for submit, built as the rows are written where the column path can
    (:class:`_Columns`); left ``ok`` False where it could not (submit then parses the spool)."""
    directory = os.path.dirname(out.name) if isinstance(getattr(out, "name", None), str) else None
    with IdHashes(directory or None) as hashes:
        return _spool(src, cmap, out, hashes, max_errors=max_errors, max_requests=max_requests, progress=progress,
                      images=images, staged=staged, max_line_bytes=max_line_bytes)


def _spool(src: RowSource, cmap: ColumnMap, out: IO[bytes], hashes: IdHashes, *, max_errors: int,
           max_requests: int, progress: Callable[[int], None] | None, images: ImageChecker | None = None,
           staged: Prevalidated | None = None, max_line_bytes: int = InputLimits().max_line_bytes) -> int:
    problems: list[InputProblem] = []
    mapper = RowMapper(src.name, cmap, images, src.count)
    fast: _FastPath | None = None
    columns: _Columns | None = None
    n = 0
    for chunk in src.chunks:
        done: list[tuple[str, bytes]] | None = None
        if staged is not None and staged.ok:
            if isinstance(chunk, list):
                staged.ok = False
            else:
                if fast is None:
                    fast = _FastPath(cmap, mapper, chunk.schema)
                if columns is None:
                    columns = _Columns(fast, mapper, chunk.schema, staged, max_line_bytes)
                if columns.ok and not problems and columns.take(chunk, n, out, hashes):
                    n += chunk.num_rows
                    if n > max_requests:
                        raise SubmitRejected(f"{src.name}: too many requests: the limit is {max_requests:,} per "
                                             "batch")
                    if progress is not None:
                        progress(n - n % 5000)
                    continue
                staged.ok = False
        if not isinstance(chunk, list):  # a RecordBatch
            if fast is None:
                fast = _FastPath(cmap, mapper, chunk.schema)
            done = fast.lines(chunk, n) if fast.ok and not problems else None
            if done is None:
                chunk = chunk.to_pylist()
        if done is not None:
            for cid, line in done:
                out.write(line)
                hashes.add(id_hash(cid))
            n += len(done)
        else:
            if n == 0 and chunk and isinstance(chunk[0], str):
                _columns_need_columns(cmap)
            for row in chunk:
                item = mapper(row, n)
                n += 1
                if isinstance(item, RowError):
                    problems.append(_row_problem(item, row, src.count))
                    if len(problems) >= max_errors:
                        break
                    continue
                if not problems:
                    parsed, obj = item
                    out.write(_line(obj))
                    hashes.add(id_hash(parsed.custom_id))
            if len(problems) >= max_errors:
                problems.append(InputProblem(message=f"stopping after {max_errors} errors", source=src.name))
                break
        if n > max_requests:
            raise SubmitRejected(f"{src.name}: too many requests: the limit is {max_requests:,} per batch")
        if progress is not None:
            progress(n - n % 5000)
    if not problems and n == 0:
        problems.append(InputProblem(message="no rows (expected at least one request)", source=src.name))
    if not problems:
        dup = hashes.duplicates()
        if dup:
            out.flush()
            problems.extend(_name_duplicates(out.name, dup, src, cmap, max_errors))
    if problems:
        raise SubmitRejected("\n".join(_text(p, src.count) for p in problems), problems=problems)
    return n


def _columns_need_columns(cmap: ColumnMap) -> None:
    """Rows that are plain strings have no columns: an option naming one would be silently ignored
    (issue 45: ``prompt_column=`` on a list of strings), so it is an error naming the option."""
    named = [name for name in ("prompt_column", "messages_column", "id_column", "model_column", "params_columns",
                               "image_column")
             if getattr(cmap, name)]
    if named:
        raise InvalidArgument(f"{named[0]}: the rows are strings (each one a prompt), which have no columns; "
                              f"pass dicts or a table to name columns, or leave {named[0]} out",
                              field=named[0], value=getattr(cmap, named[0]))


def _text(p: InputProblem, count: RowCount) -> str:
    """A problem's one line, its row as ``count`` says (``rows: row 4 (0-based): column 'q': ...``)."""
    if p.row is None:
        return f"{p.source}: {p.message}" if p.source else p.message
    where = f"{p.source}: {count.where(p.row)}"
    return f"{where}: column '{p.column}': {p.message}" if p.column else f"{where}: {p.message}"


def _name_duplicates(path: str, dup: set[int], src: RowSource, cmap: ColumnMap, max_errors: int
                     ) -> list[InputProblem]:
    """Re-read the spool for the rows whose id hashes collided, naming both rows of each duplicate."""
    column = cmap.id_column or "custom_id"
    first: dict[str, int] = {}
    out: list[InputProblem] = []
    with open(path, "rb") as f:
        for row, line in enumerate(f):
            cid = json.loads(line)["custom_id"]
            if id_hash(cid) not in dup:
                continue
            if cid in first:
                out.append(InputProblem(message=f"expected a unique id, {cid!r} already used on "
                                                f"{src.count.where(first[cid])}", source=src.name, row=row,
                                        index=src.count.label(row), column=column, value=cid))
                if len(out) >= max_errors:
                    break
            else:
                first[cid] = row
    return out
