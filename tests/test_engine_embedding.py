"""worker/engines/embedding.py: reading a sentence-transformers folder's pooling, and the pooling arithmetic
(checked against hand-computed values on small tensors; the model-level check is tests/test_embeddings.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lmdq.worker.engines.embedding import EmbeddingLayout, EmbeddingModelError, pool, read_pooling

ST = "sentence_transformers.models."


def _folder(tmp_path: Path, modules: list[tuple[str, str]], pooling: dict[str, Any] | None = None,
            st_cfg: dict[str, Any] | None = None) -> Path:
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": p, "type": ST + t} for i, (t, p) in enumerate(modules)]))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if st_cfg is not None:
        (tmp_path / "sentence_bert_config.json").write_text(json.dumps(st_cfg))
    return tmp_path


def test_minilm_layout_mean_and_normalize(tmp_path: Path) -> None:
    f = _folder(tmp_path, [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")],
                {"word_embedding_dimension": 4, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False},
                {"max_seq_length": 256, "do_lower_case": False})
    assert read_pooling(f) == EmbeddingLayout(encoder_dir=f, modes=("mean_tokens",), normalize=True,
                                              max_seq_length=256, lower_case=False)


def test_encoder_subfolder_and_modes_in_sentence_transformers_order(tmp_path: Path) -> None:
    f = _folder(tmp_path, [("Transformer", "0_Transformer"), ("Pooling", "1_Pooling")],
                {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True, "pooling_mode_lasttoken": True})
    layout = read_pooling(f)
    assert layout is not None and layout.encoder_dir == f / "0_Transformer"
    assert layout.modes == ("cls_token", "mean_tokens", "lasttoken") and not layout.normalize
    assert layout.max_seq_length is None


def test_not_an_embedding_model(tmp_path: Path) -> None:
    assert read_pooling(tmp_path) is None  # no modules.json: a causal LM folder
    assert read_pooling(_folder(tmp_path, [("Transformer", "")])) is None  # no Pooling module


@pytest.mark.parametrize(("modules", "pooling", "want"), [
    ([("Transformer", ""), ("Pooling", "1_Pooling"), ("Dense", "2_Dense")], {"pooling_mode_mean_tokens": True},
     r"module 'Dense' \(2_Dense\) is not supported"),
    ([("Transformer", ""), ("Pooling", "1_Pooling")], {"pooling_mode_weightedmean_tokens": True},
     "weightedmean pooling is not supported"),
    ([("Transformer", ""), ("Pooling", "1_Pooling")], {"pooling_mode_mean_tokens": False}, "no pooling mode is on"),
    ([("Transformer", ""), ("Pooling", "1_Pooling")], None, "expected a readable JSON file"),
])
def test_layouts_lmdq_cannot_compute_exactly_are_refused(
        tmp_path: Path, modules: list[tuple[str, str]], pooling: dict[str, Any] | None, want: str) -> None:
    with pytest.raises(EmbeddingModelError, match=want):
        read_pooling(_folder(tmp_path, modules, pooling))


def test_pool_arithmetic_ignores_padding() -> None:
    torch = pytest.importorskip("torch")
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, -100.0]],   # row 0: 2 real tokens + padding
                           [[0.0, 1.0], [2.0, 3.0], [4.0, 8.0]]])       # row 1: 3 real tokens
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])

    def run(*modes: str, normalize: bool = False) -> list[list[float]]:
        out: list[list[float]] = pool(torch, hidden, mask, EmbeddingLayout(Path("."), modes, normalize)).tolist()
        return out

    assert run("mean_tokens") == [[2.0, 3.0], [2.0, 4.0]]
    assert run("cls_token") == [[1.0, 2.0], [0.0, 1.0]]
    assert run("max_tokens") == [[3.0, 4.0], [4.0, 8.0]]
    assert run("lasttoken") == [[3.0, 4.0], [4.0, 8.0]]
    got = run("mean_sqrt_len_tokens")
    assert got[0] == pytest.approx([4.0 / 2**0.5, 6.0 / 2**0.5]) and got[1] == pytest.approx([6 / 3**0.5, 12 / 3**0.5])
    assert run("cls_token", "mean_tokens") == [[1.0, 2.0, 2.0, 3.0], [0.0, 1.0, 2.0, 4.0]]
    unit = run("mean_tokens", normalize=True)
    assert unit[0] == pytest.approx([2 / 13**0.5, 3 / 13**0.5]) and unit[1] == pytest.approx([2 / 20**0.5, 4 / 20**0.5])
