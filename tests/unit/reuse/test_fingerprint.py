"""The weights' fingerprint hashes content: same size and mtime with other bytes is another fingerprint."""

from __future__ import annotations

import json
import os
from pathlib import Path

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
