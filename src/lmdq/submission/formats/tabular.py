"""Rows as requests: tabular sources (Parquet, CSV, Arrow tables and streams, DataFrames, HF datasets)
and Python iterables of strings or dicts, validated row by row with the file formats' own checks.

A source is read as a stream of row chunks (an Arrow record batch at a time, or 4,096 items of an
iterable), never whole. Each row becomes the same object an lmdq JSONL line is
(``custom_id``, ``prompt`` | ``messages``, ``params``, ``endpoint``) through a :class:`ColumnMap`,
and is checked by the JSONL parser (:func:`producer.formats.jsonl._parse_jsonl`), so a DataFrame
row and a file line are refused for exactly the same reasons; the error names the row as its user counts
it (:class:`RowCount`: a DataFrame's index label, a file's 1-based row, an in-memory table's or iterable's
0-based position, each said as such) and the column it came from.

Decisions:

* Columns not mapped are ignored (a Parquet file often carries answers, splits, ...).
* Without a mapping the lmdq JSONL names are the columns: ``prompt`` or ``messages``, ``custom_id``,
  ``params`` (a struct/dict of generation parameters), ``endpoint``.
* ``id_column`` unset: the row number is the custom_id (``"0"``, ``"1"``, ...). Set: every row needs
  one (a string or an integer), unique over the source.
* ``template`` is :meth:`str.format` with the row's columns by name (``"Q: {question}\\nA:"``): no
  code runs in a template (Jinja2 would need a sandbox), and literal braces are ``{{``/``}}``.
* ``params_columns`` is a list of columns named like generation parameters (``max_new_tokens``,
  ``temperature``; the JSONL aliases ``max_tokens``/``seed``/``stop`` too), or a dict
  ``{column: parameter}``. A null cell means "not set for this row".
* ``model_column`` names each row's served model (one batch over several models); rows never take a
  ``model`` column unless it is named (a dataset's ``model`` column often says which model wrote a row).
* A ``messages`` cell is a list of ``{role, content}`` structs, or a JSON string of one (CSV).
* ``image_column`` (issue 48) names each row's image: a path or URL string (a relative path resolves against
  the batch's ``image_dir``), the image's bytes (kept inline as a ``data:`` URL, up to
  ``LMDQ_MAX_IMAGE_BYTES``), or a Hugging Face ``Image`` struct ``{bytes, path}``. The row becomes one user
  message: the image part, then the prompt's text (``prompt_column`` / ``template``) when the row has one.
  The reference is checked here (exists, an image, the size limit), so a bad one names its row and column.
"""

from __future__ import annotations

import json
import string
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lmdq.contract import Endpoint
from lmdq.images.refs import ImageChecker, ImageRefError, data_url, sniff
from lmdq.submission.formats.jsonl import _parse_jsonl
from lmdq.submission.formats.records import ParsedLine, _got, _LineError

__all__ = ["ColumnMap", "RowCount", "RowError", "RowMapper", "chunked", "iter_row_requests"]

_IMAGE_FIELD = "image"
"""The field name an image column's errors carry (mapped back to the column by :meth:`RowMapper.column_of`)."""

ROW_CHUNK = 4096
"""Items of a Python iterable converted per chunk."""


@dataclass(frozen=True)
class RowCount:
    """How the user counts a source's rows, so that an error names a row where they would look for it
    (issue 45): a pandas DataFrame's rows by their index label (``index 'a7'``, ``index 42``: what
    ``df.loc`` takes); a Parquet or CSV file's rows from 1, as a viewer or a spreadsheet numbers them
    (``row 4 (1-based)``, the CSV header not counted); an in-memory table's or an iterable's by position
    from 0, as Python and Arrow index them (``row 3 (0-based)``). The count is always said: a bare
    ``row 3`` is ambiguous. Positions inside lmdq stay 0-based (``InputProblem.row``)."""

    base: int = 0
    """The number the first row gets in the text: 0 (in-memory sources) or 1 (files)."""
    labels: Any = None
    """The source's row labels (a pandas Index), or None: rows are named by position."""

    def label(self, row: int) -> Hashable | None:
        """The index label of the row at 0-based position ``row`` (a plain Python value), None without labels."""
        if self.labels is None:
            return None
        v = self.labels[row]
        out: Hashable = v.item() if type(v).__module__ == "numpy" and hasattr(v, "item") else v
        return out

    def where(self, row: int) -> str:
        """The row at 0-based position ``row`` as its user counts it: ``index 'a7'``, ``row 4 (1-based)``."""
        if self.labels is not None:
            return f"index {self.label(row)!r}"
        return f"row {row + self.base} ({self.base}-based)"


@dataclass(frozen=True)
class RowError:
    """A bad row: ``row`` is its 0-based position, ``field`` the column, ``where`` the row as its user
    counts it (:meth:`RowCount.where`)."""

    path: str
    row: int
    field: str | None
    message: str
    where: str = ""

    def __str__(self) -> str:
        where = f"{self.path}: {self.where or RowCount().where(self.row)}"
        if self.field:
            return f"{where}: column '{self.field}': {self.message}"
        return f"{where}: {self.message}"


@dataclass(frozen=True)
class ColumnMap:
    """Which columns make a request (see the module's docstring for the defaults)."""

    prompt_column: str | None = None
    messages_column: str | None = None
    id_column: str | None = None
    params_columns: Sequence[str] | Mapping[str, str] | None = None
    template: str | None = None
    endpoint: Endpoint | None = None
    #: the column naming each row's served model (one batch over several models); None: every row runs
    #: on the batch's ``model``. Never picked by default: a dataset's ``model`` column often says which
    #: model WROTE a row, not which should answer it
    model_column: str | None = None
    #: the column holding each row's image (a path / URL, or bytes): the row's user message gets an image part
    image_column: str | None = None

    def __post_init__(self) -> None:
        given = [n for n, v in (("prompt_column", self.prompt_column), ("messages_column", self.messages_column),
                                ("template", self.template)) if v is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)}: pass one of them")
        if self.image_column is not None and self.messages_column is not None:
            raise ValueError("image_column and messages_column: an image column goes with prompt_column or template "
                             "(put image parts in the messages themselves instead)")
        if self.template is not None:
            self.template_fields()  # a malformed template fails here, before any row is read

    def template_fields(self) -> list[str]:
        """The columns the template names (``{question}`` -> ``question``)."""
        assert self.template is not None
        try:
            names = [f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None]
        except ValueError as e:
            raise ValueError(f"template: {e}") from None
        out = []
        for f in names:
            col = f.split(".")[0].split("[")[0]
            if not col or col.isdigit():
                raise ValueError(f"template: expected named fields like {{question}}, got {{{f}}}")
            out.append(col)
        names = out
        return names

    @property
    def params(self) -> dict[str, str]:
        """{column: parameter name as the JSONL ``params`` takes it}."""
        if self.params_columns is None:
            return {}
        if isinstance(self.params_columns, Mapping):
            return dict(self.params_columns)
        return {c: c for c in self.params_columns}

    def columns(self) -> list[str]:
        """The columns a tabular source must have (checked against its schema before any row)."""
        out = [c for c in (self.prompt_column, self.messages_column, self.id_column, self.model_column,
                           self.image_column) if c]
        if self.template is not None:
            out += self.template_fields()
        return out + list(self.params)


class RowMapper:
    """One row (a dict of columns, or a string) -> a ParsedLine or a RowError."""

    def __init__(self, name: str, cmap: ColumnMap, images: ImageChecker | None = None,
                 count: RowCount | None = None) -> None:
        self.name = name
        self.cmap = cmap
        #: how the source's user counts its rows (an error's ``where``)
        self.count = count if count is not None else RowCount()
        #: checks an image column's references (its image_dir, size limit); default: no image_dir
        self.images = images if images is not None else ImageChecker()
        self.params = cmap.params
        self.explicit = cmap.prompt_column or cmap.messages_column or cmap.template
        self.prompt_col = cmap.prompt_column or ("prompt" if not self.explicit else None)
        self.messages_col = cmap.messages_column or ("messages" if not self.explicit else None)
        self.id_col = cmap.id_column or "custom_id"
        self.param_src = {p: c for c, p in self.params.items()}
        self.endpoint = cmap.endpoint.value if cmap.endpoint is not None else None

    def column_of(self, field: str | None) -> str | None:
        """The column a JSONL field path came from (``params.temperature`` -> its params column)."""
        if field is None:
            return None
        head, _, rest = field.partition(".")
        base, bracket, tail = head.partition("[")
        if base == "prompt":
            return "template" if self.cmap.template is not None else self.prompt_col
        if base == "messages":
            return f"{self.messages_col}{bracket}{tail}" + (f".{rest}" if rest else "")
        if base == "custom_id":
            return self.id_col
        if base == "model" and self.cmap.model_column is not None:
            return self.cmap.model_column
        if base == _IMAGE_FIELD and self.cmap.image_column is not None:
            return self.cmap.image_column
        if base == "params" and rest:
            name = rest.split(".")[0].split("[")[0]
            return self.param_src.get(name, field)
        return field

    def __call__(self, row: Any, row_no: int) -> tuple[ParsedLine, dict[str, Any]] | RowError:
        """The request and the lmdq JSONL object it was parsed from (custom_id filled in), or the error."""
        try:
            obj = self._object(row)
            item = _parse_jsonl(obj, row_no)
        except _LineError as e:
            return RowError(self.name, row_no, self.column_of(e.field), e.message, self.count.where(row_no))
        obj["custom_id"] = item.custom_id
        return item, obj

    def _object(self, row: Any) -> dict[str, Any]:
        if isinstance(row, str):
            obj: dict[str, Any] = {"custom_id": None, "prompt": row}
            if self.endpoint:
                obj["endpoint"] = self.endpoint
            return obj
        if not isinstance(row, Mapping):
            raise _LineError(None, f"expected a string or a dict, got {_got(row)}")
        cm = self.cmap
        obj = {}
        cid = row.get(self.id_col)
        if cm.id_column is not None and cid is None:
            raise _LineError("custom_id", "expected a string or an integer id, got null")
        obj["custom_id"] = cid
        if cm.template is not None:
            obj["prompt"] = self._render(row)
        else:
            if self.prompt_col is not None and row.get(self.prompt_col) is not None:
                obj["prompt"] = row[self.prompt_col]
            if self.messages_col is not None and row.get(self.messages_col) is not None:
                obj["messages"] = _messages(row[self.messages_col])
            if "prompt" not in obj and "messages" not in obj:
                col = cm.prompt_column or cm.messages_column
                if col is not None:
                    raise _LineError("prompt" if cm.prompt_column else "messages",
                                     "expected a value, got null" if col in row else "the column is missing")
        params: dict[str, Any] = {}
        if not self.explicit and row.get("params") is not None:
            raw = row["params"]
            if isinstance(raw, Mapping):
                params.update({k: v for k, v in raw.items() if v is not None})
            else:
                obj["params"] = raw  # the parser says what it expected
        for col, p in self.params.items():
            v = row.get(col)
            if v is not None:
                params[p] = v
        if params:
            obj["params"] = params
        if cm.model_column is not None:
            obj["model"] = row.get(cm.model_column)
            if obj["model"] is None:
                raise _LineError("model", "expected a served model name, got null")
        if cm.image_column is not None:
            self._add_image(obj, row.get(cm.image_column), cm.image_column in row)
        ep = self.endpoint or (row.get("endpoint") if not self.explicit else None)
        if ep is not None:
            obj["endpoint"] = ep
        if ep == "score" and row.get("continuations") is not None:  # the texts to score: always this column
            cont = row["continuations"]
            obj["continuations"] = list(cont) if isinstance(cont, tuple) else cont
        return obj

    def _add_image(self, obj: dict[str, Any], cell: Any, present: bool) -> None:
        """Turn the row's prompt into one user message: its image part (the cell, checked), then its text."""
        if isinstance(cell, Mapping):  # a Hugging Face Image feature: {"bytes": ..., "path": ...}
            cell = cell.get("bytes") if cell.get("bytes") is not None else cell.get("path")
        if cell is None:
            raise _LineError(_IMAGE_FIELD, "expected an image (a path, a URL or its bytes), got null" if present
                             else "the column is missing")
        try:
            if isinstance(cell, (bytes, bytearray, memoryview)):
                data = bytes(cell)
                if len(data) > self.images.max_bytes:
                    raise ImageRefError(f"image is {len(data):,} bytes, over the limit of {self.images.max_bytes:,} "
                                        "(LMDQ_MAX_IMAGE_BYTES)")
                if sniff(data[:16]) is None:
                    raise ImageRefError("the bytes are not an image lmdq knows (PNG, JPEG, GIF, WebP, BMP, TIFF)")
                url = data_url(data)
            elif isinstance(cell, str):
                url = self.images.check(cell)
            else:
                raise ImageRefError(f"expected a path, a URL or the image's bytes, got {_got(cell)}")
        except ImageRefError as e:
            raise _LineError(_IMAGE_FIELD, str(e)) from None
        content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}}]
        prompt = obj.pop("prompt", None)
        if prompt is not None:
            content.append({"type": "text", "text": prompt})
        obj["messages"] = [{"role": "user", "content": content}]

    def _render(self, row: Mapping[str, Any]) -> str:
        assert self.cmap.template is not None
        for f in self.cmap.template_fields():
            if row.get(f) is None:
                raise _LineError(f, "expected a value for the template, got null" if f in row
                                 else "the template names this column; the row has none")
        try:
            return self.cmap.template.format_map(row)
        except (KeyError, IndexError, ValueError) as e:
            raise _LineError("prompt", f"the template could not be filled: {e}") from None


def _messages(cell: Any) -> Any:
    """A messages cell: Arrow structs come back as dicts with every struct field (None where unset)."""
    if isinstance(cell, str):
        try:
            cell = json.loads(cell)
        except ValueError as e:
            raise _LineError("messages", f"expected a list of chat messages (or its JSON), got a string that is "
                             f"not JSON ({e})") from None
    if isinstance(cell, list):
        return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in cell]
    return cell


def iter_row_requests(name: str, chunks: Iterable[Sequence[Any]], cmap: ColumnMap,
                      images: ImageChecker | None = None, count: RowCount | None = None
                      ) -> Iterator[tuple[ParsedLine, dict[str, Any]] | RowError]:
    """Per row of ``chunks`` (lists of rows), in order, rows numbered from 0: (the request, the lmdq JSONL
    object that parses to it) or a RowError naming the row as ``count`` says."""
    mapper = RowMapper(name, cmap, images, count)
    row_no = 0
    for chunk in chunks:
        for row in chunk:
            yield mapper(row, row_no)
            row_no += 1


def chunked(items: Iterable[Any], size: int = ROW_CHUNK) -> Iterator[list[Any]]:
    """``items`` in lists of ``size``: an iterable of 10 M rows is never held whole."""
    out: list[Any] = []
    for it in items:
        out.append(it)
        if len(out) >= size:
            yield out
            out = []
    if out:
        yield out
