"""lmdq.results.export: record batches and Parquet row groups are cut by bytes as well as rows, so an
export's memory stays flat whatever the texts' length (issue 49: 10,000-row chunks of 4 KB results held
~300 MB), and every row still comes out, in order, with its text whole; the ``embedding`` column is a
fixed_size_list<float32>[dim] read ahead from the first vector (issue 48)."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmdq.contract import Endpoint, Result, ResultStatus, encode_embedding
from lmdq.errors import LmdqError
from lmdq.results import export
from lmdq.results.export import RESULT_COLUMNS, embedding_schema, record_batches, result_schema, write_parquet


def _records(n: int, text_bytes: int) -> list[bytes]:
    return [Result(batch_id="b", custom_id=f"r{i}", index=i, status=ResultStatus.completed, model="m",
                   text=f"{i:06d}" + "x" * (text_bytes - 6)).model_dump_json(exclude_none=True).encode()
            for i in range(n)]


def test_batches_are_cut_at_the_byte_limit_before_the_row_limit() -> None:
    recs = _records(50, 4000)
    size = len(recs[0])
    batches = list(export.record_batches(recs, chunk=10_000, chunk_bytes=10 * size))
    assert [b.num_rows for b in batches] == [10] * 5
    rows = [r for b in batches for r in b.column("row").to_pylist()]
    texts = [t for b in batches for t in b.column("text").to_pylist()]
    assert rows == list(range(50))
    assert all(t.startswith(f"{i:06d}") and len(t) == 4000 for i, t in enumerate(texts))


def test_small_records_are_still_cut_at_the_row_limit() -> None:
    batches = list(export.record_batches(_records(25, 10), chunk=10, chunk_bytes=1 << 30))
    assert [b.num_rows for b in batches] == [10, 10, 5]


def test_a_parquet_export_writes_one_row_group_per_byte_chunk(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    recs = _records(40, 4000)
    monkeypatch.setattr(export, "CHUNK_BYTES", 8 * len(recs[0]))
    out = tmp_path / "out.parquet"
    assert export.write_parquet(out, iter(recs), batch_json="{}") == 40
    f = pq.ParquetFile(out)
    assert [f.metadata.row_group(g).num_rows for g in range(f.metadata.num_row_groups)] == [8] * 5
    assert f.read(columns=["row"]).column("row").to_pylist() == list(range(40))
    assert not (tmp_path / "out.parquet.tmp").exists()


def _python_peak(n: int, tmp_path: Path) -> int:
    """Peak Python-heap bytes of a Parquet export of ``n`` records of 4 KB, 64 KB per chunk."""
    recs = iter(_records(n, 4000))  # built before the trace starts: the source is not the export's memory
    tracemalloc.start()
    try:
        old = export.CHUNK_BYTES
        export.CHUNK_BYTES = 64 << 10
        try:
            export.write_parquet(tmp_path / f"out{n}.parquet", recs, batch_json="{}")
        finally:
            export.CHUNK_BYTES = old
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_export_holds_a_chunk_not_the_batch(tmp_path: Path) -> None:
    """Eight times the records, about the same peak of the export's own Python memory: it holds one chunk
    (parsed columns and their record batch), not the batch."""
    _python_peak(50, tmp_path)  # warm: imports, the schema
    small, big = _python_peak(200, tmp_path), _python_peak(1600, tmp_path)
    assert big < small * 1.5 + (256 << 10), (small, big)
    assert big < 1600 * 4000 / 4  # far below the batch's own bytes (6.4 MB)


# ---- the embedding column (issue 48)


def _raw(i: int, vec: list[float] | None = None, **kw: Any) -> bytes:
    status = kw.pop("status", ResultStatus.completed)
    r = Result(batch_id="batch_x", custom_id=f"c{i}", index=i, model="m", status=status,
               endpoint=Endpoint.embedding if vec is not None else Endpoint.chat,
               embedding=encode_embedding(vec) if vec is not None else None, **kw)
    return r.model_dump_json(exclude_none=True).encode()


def test_schema_lists_every_column() -> None:
    assert [f.name for f in result_schema()] == [c for c, _, _ in RESULT_COLUMNS]
    assert result_schema(3).field("embedding").type == pa.list_(pa.float32(), 3)
    assert result_schema().field("embedding").type == pa.list_(pa.float32())


def test_the_vector_size_is_read_ahead_across_chunks_and_nulls_kept() -> None:
    """The first vector is in the third chunk: the two before it are held, then every chunk has the
    fixed-size column; rows without a vector are null."""
    raws = [_raw(0), _raw(1), _raw(2), _raw(3, [1.0, 2.0]), _raw(4), _raw(5, [0.5, -0.25])]
    schema, chunks = embedding_schema(raws, chunk=2)
    assert schema.field("embedding").type == pa.list_(pa.float32(), 2)
    batches = list(record_batches(chunks, schema=schema))
    assert [b.num_rows for b in batches] == [2, 2, 2]
    table = pa.Table.from_batches(batches)
    assert table.column("embedding").to_pylist() == [None, None, None, [1.0, 2.0], None, [0.5, -0.25]]
    assert table.column("row").to_pylist() == list(range(6))


def test_a_batch_without_vectors_has_a_null_variable_list_column() -> None:
    (b,) = list(record_batches([_raw(0), _raw(1)]))
    assert b.schema.field("embedding").type == pa.list_(pa.float32()) and b.column("embedding").null_count == 2


def test_vectors_of_two_sizes_are_refused() -> None:
    with pytest.raises(LmdqError, match="vectors of 2 and 3 floats in one batch"):
        list(record_batches([_raw(0, [1.0, 2.0]), _raw(1, [1.0, 2.0, 3.0])]))


def test_parquet_keeps_float32_exactly(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    vecs = [[0.1, 0.2, 0.3], [1e-30, -3.5, 7.0]]
    n = write_parquet(tmp_path / "o.parquet", [_raw(i, v) for i, v in enumerate(vecs)], batch_json=json.dumps({}))
    t = pq.read_table(tmp_path / "o.parquet")
    assert n == 2 and t.schema.field("embedding").type == pa.list_(pa.float32(), 3)
    want = pa.array([v for vv in vecs for v in vv], pa.float32()).to_pylist()
    assert t.column("embedding").combine_chunks().flatten().to_pylist() == want


# ---- flat whatever the vectors (issue 49: the look-ahead for the vectors' size held a vector-less batch)


def _peak_without_vectors(n: int, tmp_path: Path) -> int:
    """Peak Python-heap bytes of a Parquet export of ``n`` vector-less records of ~1 KB, 32 KB per chunk.
    The records are made as they are read (as the reader does): a record held is memory traced."""
    template = _raw(0, None, text="y" * 1000)
    recs = (template.replace(b'"c0"', b'"c%d"' % i).replace(b'"index":0', b'"index":%d' % i) for i in range(n))
    old = export.CHUNK_BYTES
    export.CHUNK_BYTES = 32 << 10
    tracemalloc.start()
    try:
        write_parquet(tmp_path / f"nv{n}.parquet", recs, batch_json="{}")
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        export.CHUNK_BYTES = old


def test_a_batch_without_vectors_is_not_held_for_the_vector_size(tmp_path: Path) -> None:
    """N and 10 N vector-less results: the same peak (one chunk), where reading ahead for a vector held
    every record (10 N x 1 KB = 3 MB more) before writing the first row group."""
    _peak_without_vectors(40, tmp_path)  # warm: imports, the schema
    small, big = _peak_without_vectors(300, tmp_path), _peak_without_vectors(3000, tmp_path)
    assert big < small * 1.5 + (256 << 10), (small, big)
    assert big < 3000 * 1000 / 4, big
    t = pq.read_table(tmp_path / "nv3000.parquet")
    assert t.schema.field("embedding").type == pa.list_(pa.float32()) and t.column("embedding").null_count == 3000
    assert t.column("row").to_pylist() == list(range(3000))


def test_a_late_first_vector_gives_the_file_the_held_export_gave(tmp_path: Path) -> None:
    """The first vector in the third chunk: the file has the fixed-size column from its first row group,
    one row group per chunk, exactly the table :func:`record_batches` builds holding the chunks."""
    raws = [_raw(0), _raw(1), _raw(2), _raw(3, [1.0, 2.0]), _raw(4), _raw(5, [0.5, -0.25]), _raw(6)]
    out = tmp_path / "late.parquet"
    assert write_parquet(out, iter(raws), batch_json='{"id": "b"}', chunk=2) == 7
    f = pq.ParquetFile(out)
    assert [f.metadata.row_group(g).num_rows for g in range(f.metadata.num_row_groups)] == [2, 2, 2, 1]
    t = f.read()
    schema, chunks = embedding_schema(raws, chunk=2)
    held = pa.Table.from_batches(list(record_batches(chunks, schema=schema)))
    assert t.schema.field("embedding").type == pa.list_(pa.float32(), 2)
    assert t.schema.metadata[b"lmdq.batch"] == b'{"id": "b"}'
    assert t.equals(held.replace_schema_metadata(t.schema.metadata))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["late.parquet"]


def test_vectors_from_the_first_record_are_written_without_a_copy(tmp_path: Path) -> None:
    raws = [_raw(i, [float(i), 1.0]) for i in range(5)]
    out = tmp_path / "v.parquet"
    assert write_parquet(out, iter(raws), batch_json="{}", chunk=2) == 5
    t = pq.read_table(out)
    assert t.column("embedding").to_pylist() == [[float(i), 1.0] for i in range(5)]
    assert pq.ParquetFile(out).metadata.num_row_groups == 3


def test_an_empty_batch_writes_an_empty_file(tmp_path: Path) -> None:
    assert write_parquet(tmp_path / "e.parquet", iter([]), batch_json="{}") == 0
    t = pq.read_table(tmp_path / "e.parquet")
    assert t.num_rows == 0 and t.schema.field("embedding").type == pa.list_(pa.float32())
