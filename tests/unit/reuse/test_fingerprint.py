"""The weights' fingerprint hashes content: same size and mtime with other bytes is another fingerprint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lmdq.reuse import fingerprint
from lmdq.reuse.fingerprint import folder_digest


def _model(root: Path, weights: bytes) -> Path:
    root.mkdir()
    (root / "config.json").write_text('{"a": 1}')
    (root / "model.safetensors").write_bytes(weights)
    return root


def test_same_names_sizes_and_mtimes_with_other_bytes_differ(tmp_path: Path) -> None:
    a = _model(tmp_path / "a", b"\x00" * 1000 + b"\x01" + b"\x00" * 1000)
    b = _model(tmp_path / "b", b"\x00" * 1000 + b"\x02" + b"\x00" * 1000)  # one byte in the middle
    for f in ("config.json", "model.safetensors"):
        st = (a / f).stat()
        os.utime(b / f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert folder_digest(a) != folder_digest(b)
    assert folder_digest(a) == folder_digest(_model(tmp_path / "c", (a / "model.safetensors").read_bytes()))


def test_digests_are_cached_by_path_size_and_mtime(tmp_path: Path) -> None:
    a = _model(tmp_path / "a", b"w" * 100)
    cache = tmp_path / "cache" / "fp.json"
    first = folder_digest(a, cache)
    entries = json.loads(cache.read_text())
    assert len(entries) == 2
    # the cache is what a restart reads: a planted digest for the same (path, size, mtime) is believed
    planted = {k: "0" * 40 for k in entries}
    cache.write_text(json.dumps(planted))
    from_cache = folder_digest(a, cache)
    assert from_cache != first
    # a rewrite changes the mtime: that file is hashed again (the config's planted digest still stands)
    st = (a / "model.safetensors").stat()
    os.utime(a / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    again = folder_digest(a, cache)
    assert again not in (first, from_cache)
    assert folder_digest(a) == first  # no cache: the content alone


def test_pieces_on_any_number_of_threads_give_one_digest_and_see_a_byte_in_any_piece(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files are hashed in pieces on a thread pool: the digest must not depend on the thread count, and a
    changed byte in a middle piece of a many-piece file must change it (pieces of 1 KiB here)."""
    monkeypatch.setattr(fingerprint, "PIECE", 1024)
    data = bytes(range(256)) * 40  # 10 KiB: 10 pieces
    a = _model(tmp_path / "a", data)
    (a / "empty.bin").write_bytes(b"")
    digests = {folder_digest(a, threads=t) for t in (1, 2, 8)}
    assert len(digests) == 1
    changed = bytearray(data)
    changed[5 * 1024 + 7] ^= 1
    b = _model(tmp_path / "b", bytes(changed))
    (b / "empty.bin").write_bytes(b"")
    assert folder_digest(b, threads=4) not in digests
    # the piece size is part of the layout: a file hashed whole (one piece) has another digest
    monkeypatch.setattr(fingerprint, "PIECE", 1 << 26)
    assert folder_digest(a, threads=2) not in digests


def test_a_fingerprint_started_before_the_engine_loads_is_the_one_the_worker_gets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker starts hashing before its engine's load and picks the result up after it, under the
    folder's resolved name whichever way the engine names it; an unknowable model stays None."""
    from lmdq.worker import reuse

    monkeypatch.setattr(reuse, "_cache_file", lambda: tmp_path / "cache.json")
    a = _model(tmp_path / "a", b"w" * 5000)
    reuse.start_weights_fingerprint(str(a / "."))
    assert reuse._started, "the hash runs in the background"
    assert reuse.weights_fingerprint(a) == folder_digest(a)
    assert not reuse._started  # taken once
    assert reuse.weights_fingerprint(str(a)) == folder_digest(a)
    reuse.start_weights_fingerprint("no-such-org/no-such-model")
    assert reuse.weights_fingerprint("no-such-org/no-such-model") is None
