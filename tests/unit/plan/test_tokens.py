"""lmdq.plan.tokens: counting with a tokenizer folder and its chat template; the estimate without one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmdq.plan.tokens import block_keys, find_tokenizer, load_counter, write_word_tokenizer

pytest.importorskip("tokenizers")


def test_the_word_tokenizer_counts_as_the_sim_engine_does(tmp_path: Path) -> None:
    c = load_counter("sim", write_word_tokenizer(tmp_path / "tok", ["user:", "assistant:", "hello"]))
    assert c.exact and "tokenizer and chat template" in c.basis
    # the sim renders a chat prompt 'user: {prompt}\nassistant:' and counts its words
    assert c.count("hello big world", None, chat=True) == len(["user:", "hello", "big", "world", "assistant:"])
    assert c.count("hello big world", None, chat=False) == 3
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert c.count(None, msgs, chat=True) == len(["system:", "be", "brief", "user:", "hi", "assistant:"])


def test_no_tokenizer_is_an_estimate_that_says_so(tmp_path: Path) -> None:
    c = load_counter("org/not-here", tmp_path / "missing")
    assert not c.exact and "estimated at 4 characters a token" in c.basis and "--tokenizer" in c.basis
    assert c.count("x" * 40, None, chat=False) == 10
    assert c.ids("x", None, chat=True) is None


def test_find_tokenizer_looks_in_the_hugging_face_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snap = tmp_path / "hub" / "models--org--m" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "tokenizer.json").write_text(json.dumps({}))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert find_tokenizer("org/m", None) == snap
    assert find_tokenizer("org/other", None) is None
    assert find_tokenizer("x", snap / "tokenizer.json") == snap


def test_block_keys_chain_over_earlier_blocks() -> None:
    a = block_keys([1, 2, 3, 4, 5], 2)
    assert len(a) == 2  # full blocks only
    assert block_keys([1, 2, 3, 4], 2) == a
    assert block_keys([9, 9, 3, 4], 2)[1] != a[1]  # same block, different prefix: different key
