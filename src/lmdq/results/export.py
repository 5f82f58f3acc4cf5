"""A batch's results exported: lmdq's own JSONL lines (:func:`iter_lmdq_lines`, ``results``), and Arrow
with ONE schema (:data:`RESULT_COLUMNS`) for ``to_arrow``, ``to_pandas``, ``to_parquet`` and
``lmdq-producer results -o out.parquet``. Every export reads through the one reader
(:class:`lmdq.results.reader.ResultReader`); OpenAI's lines are :mod:`lmdq.results.openai`.

One row per request that has a final result, in input order (``row`` is the request's 0-based input
position, the index a DataFrame source had). Records are converted a chunk at a time
(:data:`CHUNK_ROWS` results or :data:`CHUNK_BYTES` of records, whichever comes first) and a Parquet file
is written one row group per chunk, so exporting 1 M results of any size holds one chunk, not the batch.
The batch's own record (id, model, params, metadata) goes into the
file's key-value metadata under ``lmdq.batch``, not into a column repeated on every row.

``embedding`` is a ``fixed_size_list<float32>[dim]`` column (what vector stores and numpy read without a
copy per row), ``dim`` being the batch's vectors' size: read from the first result that has one (a batch
that has no vector at all: its column is a null ``list<float32>``). In memory (``to_arrow``) the records
before it are held until then; a Parquet export holds nothing back (:func:`write_parquet`). Vectors of
two sizes in one batch (two embedding models) cannot share the column: that
export is refused, naming both sizes (export JSONL instead).
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from lmdq.contract import Batch
from lmdq.errors import LmdqError
from lmdq.results.reader import ResultReader
from lmdq.results.store import ResultStore

__all__ = ["CHUNK_BYTES", "CHUNK_ROWS", "RESULT_COLUMNS", "embedding_schema", "iter_lmdq_lines", "record_batches",
           "result_schema", "write_parquet"]


def iter_lmdq_lines(store: ResultStore, batch: Batch, *, partial: bool = True) -> Iterator[bytes]:
    """One JSON line per request, in input order, read through the one reader (Redis and sealed
    shards alike); requests with no record yet are skipped."""
    for _, raw in ResultReader.of(store, batch).records(partial=partial):
        if raw is not None:
            yield raw + b"\n"


CHUNK_ROWS = 10_000
"""Results per record batch / Parquet row group at most."""

CHUNK_BYTES = 8 << 20
"""Bytes of result records per record batch / Parquet row group at most (2,000 results of 4 KB): what
keeps an export's memory flat whatever the texts' length (:func:`record_batches`)."""

#: (column, Arrow type, what it holds). ``logprobs`` is nested; ``tensors`` is the JSON of the refs.
RESULT_COLUMNS: list[tuple[str, str, str]] = [
    ("custom_id", "string", "the request's id (id_column, a file's custom_id, else its row number)"),
    ("row", "int64", "0-based input position (Result.index)"),
    ("status", "string", "completed | failed | cancelled | expired"),
    ("text", "string", "the generated text"),
    ("finish_reason", "string", "stop | length | error | abort (null when it never ran)"),
    ("input_token_len", "int64", "prompt tokens"),
    ("generate_token_len", "int64", "generated tokens"),
    ("error_code", "string", "null unless failed/cancelled/expired"),
    ("error_message", "string", "null unless failed/cancelled/expired"),
    ("model", "string", "served model name"),
    ("backend", "string", "engine backend that ran it"),
    ("worker", "string", "worker name"),
    ("attempt", "int32", "attempt that produced the result (1 = first)"),
    ("endpoint", "string", "chat | completion | score | reward"),
    ("enqueued_at", "float64", "unix seconds"),
    ("started_at", "float64", "unix seconds"),
    ("first_token_at", "float64", "unix seconds"),
    ("finished_at", "float64", "unix seconds"),
    ("logprobs", "list<struct<token_id: int64, logprob: float64, top: list<struct<token_id: int64, "
                 "logprob: float64>>>>", "per generated token, when logprobs were asked for"),
    ("tensors", "string", "JSON of the tensor references (logits, hidden states) in the blob store"),
    ("samples", "list<struct<index: int32, text: string, finish_reason: string, generate_token_len: int64, "
                "logprobs: (as the logprobs column)>>",
     "params.n > 1: the n samples of the request (text/finish_reason repeat sample 0); null for n = 1"),
    ("prefill_token_len", "int64", "prompt tokens the engine computed, over all samples (null: not reported)"),
    ("scores", "list<struct<logprob: float64, num_tokens: int64, is_greedy: bool>>",
     "endpoint score: per continuation, sum logprob, tokens, all-argmax (null where unknown)"),
    ("reward", "float64", "endpoint reward: the reward model's score"),
    ("reused_from", "string", "answered from the reuse index (issue 47): JSON {batch, custom_id} of the request "
                              "that computed it; null when this request was computed"),
    ("embedding", "fixed_size_list<float32>[dim]",
     "endpoint embedding: the vector, dim = the model's (a batch without vectors: list<float32>, all null)"),
]


def _pa() -> Any:
    try:
        import pyarrow

        return pyarrow
    except ImportError:
        raise LmdqError("Arrow/Parquet output needs pyarrow: pip install 'lmdq[data]'") from None


def result_schema(embedding_dim: int | None = None) -> Any:
    """The pyarrow schema of :data:`RESULT_COLUMNS` (``embedding_dim``: the vectors' size, None: no vectors)."""
    pa = _pa()
    top = pa.list_(pa.struct([("token_id", pa.int64()), ("logprob", pa.float64())]))
    lp = pa.list_(pa.struct([("token_id", pa.int64()), ("logprob", pa.float64()), ("top", top)]))
    sc = pa.list_(pa.struct([("logprob", pa.float64()), ("num_tokens", pa.int64()), ("is_greedy", pa.bool_())]))
    types = {"string": pa.string(), "int64": pa.int64(), "int32": pa.int32(), "float64": pa.float64()}
    samples = pa.list_(pa.struct([("index", pa.int32()), ("text", pa.string()), ("finish_reason", pa.string()),
                                  ("generate_token_len", pa.int64()), ("logprobs", lp)]))
    emb = pa.list_(pa.float32(), embedding_dim) if embedding_dim else pa.list_(pa.float32())
    nested = {"logprobs": lp, "samples": samples, "scores": sc, "embedding": emb}
    return pa.schema([(name, nested.get(name) or types[t]) for name, t, _ in RESULT_COLUMNS])


def _logprob_rows(lps: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    return None if lps is None else [
        {"token_id": x["token_id"], "logprob": x["logprob"],
         "top": [{"token_id": i, "logprob": v} for i, v in x.get("top", [])]} for x in lps]


from orjson import loads as _loads  # noqa: E402 - a base dependency (issue 49)


def _columns(raws: list[bytes], embedding_dim: int | None = None) -> dict[str, Any]:
    cols: dict[str, Any] = {name: [] for name, _, _ in RESULT_COLUMNS}
    vectors: list[str | None] = cols["embedding"]
    for raw in raws:
        r = _loads(raw)
        t = r.get("timings") or {}
        err = r.get("error") or {}
        cols["custom_id"].append(r["custom_id"])
        cols["row"].append(r["index"])
        cols["status"].append(r["status"])
        cols["text"].append(r.get("text", ""))
        cols["finish_reason"].append(r.get("finish_reason"))
        cols["input_token_len"].append(r.get("input_token_len", 0))
        cols["generate_token_len"].append(r.get("generate_token_len", 0))
        cols["error_code"].append(err.get("code"))
        cols["error_message"].append(err.get("message"))
        cols["model"].append(r.get("model"))
        cols["backend"].append(r.get("backend"))
        cols["worker"].append(r.get("worker"))
        cols["attempt"].append(r.get("attempt", 1))
        cols["endpoint"].append(r.get("endpoint", "chat"))
        for k in ("enqueued_at", "started_at", "first_token_at", "finished_at"):
            cols[k].append(t.get(k))
        cols["logprobs"].append(_logprob_rows(r.get("logprobs")))
        tensors = r.get("tensors")
        cols["tensors"].append(None if tensors is None else json.dumps(tensors, sort_keys=True))
        samples = r.get("samples")
        cols["samples"].append(None if samples is None else [
            {"index": x["index"], "text": x.get("text", ""), "finish_reason": x.get("finish_reason"),
             "generate_token_len": x.get("generate_token_len", 0), "logprobs": _logprob_rows(x.get("logprobs"))}
            for x in samples])
        cols["prefill_token_len"].append(r.get("prefill_token_len"))
        scores = r.get("scores")
        cols["scores"].append(None if scores is None else [
            {"logprob": x["logprob"], "num_tokens": x["num_tokens"], "is_greedy": x.get("is_greedy")} for x in scores])
        cols["reward"].append(r.get("reward"))
        reused = r.get("reused_from")
        cols["reused_from"].append(None if reused is None else json.dumps(reused, sort_keys=True))
        vectors.append(r.get("embedding"))
    cols["embedding"] = _embedding_array(vectors, embedding_dim)
    return cols


_EMBEDDING_KEY = b'"embedding":"'


def _embedding_dim(raw: bytes) -> int | None:
    """The size of the vector in one raw result record (None: it has none); the JSON is parsed only when
    the record holds the key at all."""
    if _EMBEDDING_KEY not in raw and b'"embedding": "' not in raw:
        return None
    data = _loads(raw).get("embedding")
    return len(base64.b64decode(data)) // 4 if isinstance(data, str) else None


def _embedding_array(vectors: list[str | None], dim: int | None) -> Any:
    """The chunk's ``embedding`` column: one ``fixed_size_list<float32>[dim]`` array built from the
    vectors' bytes in one buffer (no Python float per value), null where a row has none."""
    pa = _pa()
    if not dim:
        return pa.nulls(len(vectors), pa.list_(pa.float32()))
    size = 4 * dim
    buf = bytearray(size * len(vectors))
    mask = []
    for i, v in enumerate(vectors):
        if v is None:
            mask.append(True)
            continue
        data = base64.b64decode(v)
        if len(data) != size:
            raise LmdqError(f"vectors of {dim} and {len(data) // 4} floats in one batch cannot share the Parquet/Arrow "
                            "fixed-size embedding column: export this batch as JSONL (results -o out.jsonl)")
        buf[i * size : (i + 1) * size] = data
        mask.append(False)
    values = pa.py_buffer(bytes(buf))
    flat = pa.Array.from_buffers(pa.float32(), dim * len(vectors), [None, values])
    if sys.byteorder == "big":  # pragma: no cover - the stored bytes are little-endian float32
        raise LmdqError("exporting embeddings needs a little-endian machine")
    return pa.FixedSizeListArray.from_arrays(flat, dim, mask=pa.array(mask, pa.bool_()) if any(mask) else None)


class _Chunks:
    """Records in chunks of at most ``chunk`` rows or ``chunk_bytes`` of records, and the batch's vector size:
    known from the first record holding a vector, the chunks before it held back until then (see the module's
    docstring). Each chunk is a list the caller empties once converted (:func:`_to_batch`).

    ``look_ahead=False`` holds nothing back and leaves ``dim`` None: for :func:`write_parquet`, which
    finds the vectors' size itself so that a batch without vectors is not held whole (issue 49)."""

    def __init__(self, records: Iterable[bytes], chunk: int = CHUNK_ROWS, chunk_bytes: int | None = None, *,
                 look_ahead: bool = True) -> None:
        self._records = iter(records)
        self._chunk = chunk
        self._limit = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        self.held: list[list[bytes]] = []
        self.dim: int | None = None
        self.done = False
        while look_ahead and self.dim is None and not self.done:  # look ahead to the first vector (or the end)
            part = self._next_chunk()
            if part:
                self.held.append(part)
                self.dim = next((d for d in map(_embedding_dim, part) if d is not None), None)

    def _next_chunk(self) -> list[bytes]:
        buf: list[bytes] = []
        size = 0
        for raw in self._records:
            buf.append(raw)
            size += len(raw)
            if len(buf) >= self._chunk or size >= self._limit:
                return buf
        self.done = True
        return buf

    def __iter__(self) -> Iterator[list[bytes]]:
        while self.held:
            yield self.held.pop(0)
        while not self.done:
            part = self._next_chunk()
            if part:
                yield part


def record_batches(records: Iterable[bytes] | _Chunks, chunk: int = CHUNK_ROWS, chunk_bytes: int | None = None,
                   *, schema: Any = None) -> Iterator[Any]:
    """Final result records (raw JSON, input order) -> record batches of :func:`result_schema` (with the
    batch's vector size: :func:`embedding_schema` tells it first when the caller needs the schema up front),
    each cut at ``chunk`` rows or ``chunk_bytes`` (default :data:`CHUNK_BYTES`) of records, whichever comes
    first.

    Why by bytes too: a chunk is held three ways at once while it is converted (the raw records, their
    parsed columns, the Arrow arrays), so 10,000 results of 4 KB held ~300 MB (issue 49: 450 MB peak RSS
    at 100,000 results). Each form is dropped as soon as the next one is built, so at most two are held."""
    chunks = records if isinstance(records, _Chunks) else _Chunks(records, chunk, chunk_bytes)
    if schema is None:
        schema = result_schema(chunks.dim)
    for part in chunks:
        yield _to_batch(part, schema, chunks.dim)  # not bound here: the caller's reference is the only one


def _to_batch(buf: list[bytes], schema: Any, embedding_dim: int | None = None) -> Any:
    """One record batch of the records in ``buf``, which is emptied before the Arrow arrays are built."""
    cols = _columns(buf, embedding_dim)
    buf.clear()
    return _pa().RecordBatch.from_pydict(cols, schema=schema)  # the parsed columns go on return


def embedding_schema(records: Iterable[bytes], chunk: int = CHUNK_ROWS) -> tuple[Any, Any]:
    """``(schema, chunks)``: the records' schema (their vector size read ahead) and the records, to pass to
    :func:`record_batches` as they are (nothing is read twice)."""
    chunks = _Chunks(records, chunk)
    return result_schema(chunks.dim), chunks


def schema_with_batch(batch_json: str, embedding_dim: int | None = None) -> Any:
    return result_schema(embedding_dim).with_metadata({"lmdq.batch": batch_json})


def write_parquet(path: Path, records: Iterable[bytes], *, batch_json: str, chunk: int = CHUNK_ROWS,
                  chunk_bytes: int | None = None) -> int:
    """Stream ``records`` into a Parquet file at ``path`` (one row group per chunk); returns the rows.

    Written to ``path``.tmp and renamed when complete, so a failed export never leaves a truncated
    file under the name a pipeline reads.

    Flat in the rows whatever the vectors (issue 49): nothing is read ahead. The file's ``embedding`` type
    is the one :func:`record_batches` gives (``fixed_size_list<float32>[dim]`` from the first vector, a null
    ``list<float32>`` in a batch without any), but the chunks before the first vector are not held for it:
    they are written at once as vector-less row groups, and only if a vector turns up later are those row
    groups copied, one at a time, into a file of the vectors' schema (:func:`_rewrite_with_vectors`). The
    file is the same as when the chunks were held; a batch of vectors from its first record, or of none,
    is never copied."""
    import pyarrow.parquet as pq

    _pa()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    early = path.with_name(path.name + ".novec.tmp")
    n = 0
    dim: int | None = None
    w: Any = None
    try:
        for part in _Chunks(records, chunk, chunk_bytes, look_ahead=False):
            found = None if dim is not None else next((d for d in map(_embedding_dim, part) if d is not None), None)
            if w is None or found is not None:
                if w is not None:  # the first vector after vector-less row groups: rewrite those
                    w.close()
                    tmp.replace(early)
                dim = found
                schema = schema_with_batch(batch_json, dim)
                w = pq.ParquetWriter(tmp, schema, compression="zstd")
                if early.exists():
                    _rewrite_with_vectors(early, w, schema)
                    early.unlink()
            rb = _to_batch(part, schema, dim)
            w.write_batch(rb)
            n += rb.num_rows
            del rb, part  # written: not held while the next chunk is converted
        if w is None:  # no record at all: an empty file of the vector-less schema
            w = pq.ParquetWriter(tmp, schema_with_batch(batch_json, None), compression="zstd")
        w.close()
        w = None
        tmp.replace(path)
    except BaseException:
        if w is not None:
            w.close()
        tmp.unlink(missing_ok=True)
        early.unlink(missing_ok=True)
        raise
    return n


def _rewrite_with_vectors(src: Path, w: Any, schema: Any) -> None:
    """Copy the vector-less row groups of ``src`` into ``w`` (``schema``: the vectors' fixed-size column), one
    row group in memory at a time, their null ``embedding`` column retyped: the same row groups as if they
    had been held until the first vector."""
    import pyarrow.parquet as pq

    pa = _pa()
    idx = schema.get_field_index("embedding")
    field = schema.field(idx)
    f = pq.ParquetFile(src)
    for g in range(f.metadata.num_row_groups):
        t = f.read_row_group(g)
        t = t.set_column(idx, field, pa.nulls(t.num_rows, field.type)).replace_schema_metadata(schema.metadata)
        w.write_table(t, row_group_size=t.num_rows)  # one row group in, one out, as when it was written
        del t
