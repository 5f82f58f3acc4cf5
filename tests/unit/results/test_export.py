"""lmdq.results.export: result records as Arrow record batches, the ``embedding`` column in particular."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lmdq.contract import Endpoint, Result, ResultStatus, encode_embedding
from lmdq.errors import LmdqError
from lmdq.results.export import RESULT_COLUMNS, embedding_schema, record_batches, result_schema, write_parquet

pa = pytest.importorskip("pyarrow")


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
