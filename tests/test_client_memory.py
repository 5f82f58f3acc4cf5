"""The Python client's memory is flat in the rows it spools (issue 44: ~42 bytes a row before, 2,000,000
generator rows peaked at 141 MB against 65 MB for 200,000). What the spooling kept per row, an 8-byte
hash of each custom_id for the duplicate check in a growing array, now waits on disk in sorted runs
(lmdq.client.sources.IdHashes). Measured with tracemalloc (Python's own allocations: deterministic,
unlike RSS), at N and 10 N rows. bench/client_memory.py measures the whole submit's RSS at 200k and 2M."""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmdq.client.sources import IdHashes, classify, spool
from lmdq.errors import SubmitRejected
from lmdq.submission.formats.tabular import ColumnMap


def _rows(n: int, dup_at: int | None = None) -> Iterator[dict[str, str]]:
    for i in range(n):
        yield {"prompt": f"question number {i}: what comes after it?", "custom_id": f"r{0 if i == dup_at else i}"}


def _spool_peak(n: int, tmp: Path) -> int:
    cmap = ColumnMap()
    src = classify(_rows(n), fmt=None, cmap=cmap)
    tracemalloc.start()
    try:
        with (tmp / f"spool-{n}.jsonl").open("wb") as f:
            assert spool(src, cmap, f) == n
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_spooling_ten_times_the_rows_takes_no_more_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # runs of 4,096 hashes (a generator's chunk) instead of 32,768: the same code at an eighth of the scale,
    # so the test takes seconds; N is several runs already, so 10 N is the same shape, longer
    monkeypatch.setattr(IdHashes, "RUN", 4096)
    n = 5 * IdHashes.RUN
    _spool_peak(100, tmp_path)  # the first spool imports the row parser (its allocations are not the rows')
    small, large = _spool_peak(n, tmp_path), _spool_peak(10 * n, tmp_path)
    print(f"spool peak: {n:,} rows {small / 1e6:.2f} MB, {10 * n:,} rows {large / 1e6:.2f} MB")
    # before: +8 bytes a row for the hash array alone (~7 MiB more at 10 N); now the same within 20 %
    assert large <= 1.2 * small, (small, large)
    assert (large - small) / (9 * n) < 1.0, f"{(large - small) / (9 * n):.2f} bytes a row"


def test_a_duplicate_id_is_still_found_across_runs_on_disk(tmp_path: Path) -> None:
    n = 2 * IdHashes.RUN + 17
    cmap = ColumnMap()
    src = classify(_rows(n, dup_at=n - 1), fmt=None, cmap=cmap)  # the last row reuses row 0's id
    with (tmp_path / "s.jsonl").open("wb") as f, pytest.raises(SubmitRejected) as bad:
        spool(src, cmap, f)
    assert (bad.value.row, bad.value.column, bad.value.value) == (n - 1, "custom_id", "r0")
    assert str(bad.value) == f"rows: row {n - 1}: column 'custom_id': expected a unique id, 'r0' already used on row 0"
    assert [p.name for p in tmp_path.iterdir()] == ["s.jsonl"]  # the hashes' file is gone


def test_id_hashes_merge_every_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(IdHashes, "RUN", 7)
    monkeypatch.setattr(IdHashes, "READ", 3)
    rng = random.Random(44)
    values = [rng.getrandbits(64) for _ in range(500)]
    dups = set(rng.sample(values, 9))
    feed = values + list(dups)
    rng.shuffle(feed)
    with IdHashes() as h:
        for v in feed:
            h.add(v)
        assert len(h) == len(feed)
        assert h.duplicates() == dups
