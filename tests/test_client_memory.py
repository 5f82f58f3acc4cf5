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
from typing import Any

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
    assert str(bad.value) == (f"rows: row {n - 1} (0-based): column 'custom_id': expected a unique id, 'r0' already "
                              "used on row 0 (0-based)")
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


def _submit_peak(api: Any, n: int) -> int:
    """tracemalloc's peak over a whole ``Client.submit`` of a generator of ``n`` prompts: the spooling, then
    the file pipeline's two passes, the staging ids and every job staged."""

    def rows() -> Iterator[str]:
        for i in range(n):
            yield f"question number {i}: what comes after it?"

    tracemalloc.start()
    try:
        batch = api.submit(rows(), model="m", batch_size=64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert batch.counts().total == n
    return peak


def test_a_whole_submit_of_ten_times_the_rows_takes_no_more_memory(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 44's must-show, deterministic (tracemalloc, not RSS): a generator's whole submit at N and 10 N rows.
    # Before, the file pipeline kept ~40 bytes a request in memory (two hashes, an offset and a line number for
    # prefix groups, the staging lease's custom_ids): +7 MB at 10 N for N = 20,000. Now each waits on disk
    # (lmdq.submission.spill) with a bounded buffer, shrunk here so that N rows already spill: 10 N is the same
    # shape, longer.
    import lmdq
    from lmdq.submission.settings import ProducerSettings
    from lmdq.submission.spill import SpillArray

    monkeypatch.setattr(IdHashes, "RUN", 4096)
    monkeypatch.setattr(SpillArray, "BUF", 2048)
    api = lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix))
    api.register_models(["m"])
    n = 20_000
    _submit_peak(api, 100)  # the first submit imports and warms what every submit uses (not the rows')
    small, large = _submit_peak(api, n), _submit_peak(api, 10 * n)
    print(f"submit peak: {n:,} rows {small / 1e6:.2f} MB, {10 * n:,} rows {large / 1e6:.2f} MB, "
          f"{(large - small) / (9 * n):.2f} bytes a row")
    assert large <= 1.2 * small + 256 * 1024, (small, large)
    assert (large - small) / (9 * n) < 2.0, f"{(large - small) / (9 * n):.2f} bytes a row"


def test_spill_array_reads_back_by_index_and_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lmdq.submission.spill import SpillArray

    monkeypatch.setattr(SpillArray, "BUF", 7)
    monkeypatch.setattr(SpillArray, "WINDOW", 5)
    rng = random.Random(44)
    values = [rng.getrandbits(32) for _ in range(103)]
    with SpillArray("I", str(tmp_path)) as a:
        for v in values:
            a.append(v)
        assert len(a) == len(values) and list(a) == values
        order = list(range(len(values)))
        rng.shuffle(order)
        assert [a[i] for i in order] == [values[i] for i in order]  # any order: windows re-read as needed
        assert [a[i] for i in range(len(values))] == values and a[-1] == values[-1]
    assert list(tmp_path.iterdir()) == []  # anonymous temporary files: nothing left behind


def test_id_chunks_read_back_as_the_staging_list_holds_them(tmp_path: Path) -> None:
    import json

    from lmdq.submission.spill import IdChunks

    ids = [f"r{i}" for i in range(2500)] + ["é\"\n"]
    with IdChunks(1000, str(tmp_path)) as chunks:
        for cid in ids:
            chunks.add(cid)
        got = list(chunks.chunks())
        assert len(chunks) == len(got) == 3
        assert [x for c in got for x in json.loads(c)] == ids
    assert list(tmp_path.iterdir()) == []


def test_spill_array_mapped_reads_any_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lmdq.submission.spill import SpillArray

    monkeypatch.setattr(SpillArray, "BUF", 7)
    monkeypatch.setattr(SpillArray, "DROP", 5)  # pages dropped every 5 reads: still read back right
    rng = random.Random(45)
    values = [rng.getrandbits(64) for _ in range(101)]
    with SpillArray("Q", str(tmp_path)) as a:
        for v in values:
            a.append(v)
        a.map()
        order = list(range(len(values)))
        rng.shuffle(order)
        assert [a[i] for i in order] == [values[i] for i in order]
    assert list(tmp_path.iterdir()) == []
