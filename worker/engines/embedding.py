"""Sentence embeddings the way the model's sentence-transformers config says (endpoint ``embedding``).

An embedding model is a sentence-transformers folder: ``modules.json`` lists its modules in order, a
``Transformer`` (the encoder, in the folder itself or a sub-folder), a ``Pooling`` module whose
``config.json`` names the pooling (``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``, ...), and
optionally ``Normalize`` (unit length). ``sentence_bert_config.json`` gives ``max_seq_length`` and
``do_lower_case``. This module reads that layout (:func:`read_pooling`) and computes what
``SentenceTransformer.encode`` computes from the encoder's last hidden state (:func:`pool`,
:func:`embed_batch`), without depending on the sentence-transformers package: the worker needs only
torch and transformers, and the arithmetic is a few lines that the tests check against a direct run.

What is refused when the engine loads (an ``EngineError`` naming the file), never silently changed: a
module lmdq does not compute (``Dense``, ``LayerNorm``, ... with weights of their own), and the
``weightedmean`` pooling. Several modes at once are concatenated in sentence-transformers' order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["POOLING_MODES", "EmbeddingLayout", "EmbeddingModelError", "embed_batch", "pool", "read_pooling"]

#: sentence-transformers' Pooling config keys, in the order its ``forward`` concatenates them
POOLING_MODES = ("cls_token", "max_tokens", "mean_tokens", "mean_sqrt_len_tokens", "lasttoken")


class EmbeddingModelError(ValueError):
    """The folder is a sentence-transformers model lmdq cannot compute exactly (the engine refuses to load it)."""


@dataclass(frozen=True)
class EmbeddingLayout:
    """What a sentence-transformers folder says about computing its vectors."""

    #: the encoder's folder (``modules.json``'s Transformer path: the model folder itself, or a sub-folder)
    encoder_dir: Path
    #: the pooling modes, in concatenation order (a subset of :data:`POOLING_MODES`)
    modes: tuple[str, ...]
    #: unit-length vectors (a ``Normalize`` module is listed)
    normalize: bool
    #: the longest input in tokens (``sentence_bert_config.json``'s ``max_seq_length``); None: the encoder's
    max_seq_length: int | None = None
    #: the text is lower-cased before tokenizing (``do_lower_case``)
    lower_case: bool = False


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EmbeddingModelError(f"{path}: expected a readable JSON file ({exc})") from exc


def read_pooling(folder: str | Path) -> EmbeddingLayout | None:
    """The folder's :class:`EmbeddingLayout`, or None when it is no sentence-transformers embedding model
    (no ``modules.json``, or one without a Pooling module: a causal LM, a reward model).

    Raises :class:`EmbeddingModelError` for a layout that cannot be computed exactly."""
    folder = Path(folder)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise EmbeddingModelError(f"{modules_file}: expected a list of module objects")
    kinds = [(str(m.get("type", "")).rsplit(".", 1)[-1], str(m.get("path", ""))) for m in modules]
    if not any(kind == "Pooling" for kind, _ in kinds):
        return None
    encoder_dir, normalize = folder, False
    modes: tuple[str, ...] = ()
    for kind, sub in kinds:
        if kind == "Transformer":
            encoder_dir = folder / sub if sub else folder
        elif kind == "Pooling":
            cfg = _json(folder / sub / "config.json")
            if not isinstance(cfg, dict):
                raise EmbeddingModelError(f"{folder / sub / 'config.json'}: expected an object")
            if cfg.get("pooling_mode_weightedmean_tokens"):
                raise EmbeddingModelError(f"{folder / sub / 'config.json'}: weightedmean pooling is not supported "
                                          f"(supported: {', '.join(POOLING_MODES)})")
            modes = tuple(m for m in POOLING_MODES if cfg.get(f"pooling_mode_{m}"))
            if not modes:
                raise EmbeddingModelError(f"{folder / sub / 'config.json'}: no pooling mode is on (expected one of "
                                          f"pooling_mode_{', pooling_mode_'.join(POOLING_MODES)})")
        elif kind == "Normalize":
            normalize = True
        else:
            raise EmbeddingModelError(f"{modules_file}: module {kind!r} ({sub or '.'}) is not supported: lmdq computes "
                                      "Transformer -> Pooling -> Normalize only")
    st_cfg_file = encoder_dir / "sentence_bert_config.json"
    if not st_cfg_file.is_file():
        st_cfg_file = folder / "sentence_bert_config.json"
    st_cfg = _json(st_cfg_file) if st_cfg_file.is_file() else {}
    max_len = st_cfg.get("max_seq_length") if isinstance(st_cfg, dict) else None
    return EmbeddingLayout(encoder_dir=encoder_dir, modes=modes, normalize=normalize,
                           max_seq_length=int(max_len) if isinstance(max_len, int) and max_len > 0 else None,
                           lower_case=bool(st_cfg.get("do_lower_case")) if isinstance(st_cfg, dict) else False)


def pool(torch: Any, hidden: Any, mask: Any, layout: EmbeddingLayout) -> Any:
    """``[rows, dim * len(modes)]`` float32 vectors from the encoder's last hidden state ``[rows, seq, dim]``
    and the attention mask ``[rows, seq]`` (1 = a real token; right padding), as sentence-transformers'
    ``Pooling`` then ``Normalize`` compute them."""
    h = hidden.float()
    m = mask.to(h.dtype).unsqueeze(-1)
    lengths = mask.sum(dim=1)
    parts = []
    for mode in layout.modes:
        if mode == "cls_token":
            parts.append(h[:, 0])
        elif mode == "max_tokens":
            parts.append(h.masked_fill(m == 0, -1e9).max(dim=1).values)
        elif mode in ("mean_tokens", "mean_sqrt_len_tokens"):
            summed = (h * m).sum(dim=1)
            count = m.sum(dim=1).clamp(min=1e-9)
            parts.append(summed / (count if mode == "mean_tokens" else count.sqrt()))
        else:  # lasttoken: the last real token of each row (right padding)
            last = (lengths - 1).clamp(min=0)
            parts.append(h[torch.arange(h.shape[0], device=h.device), last])
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    if layout.normalize:
        out = torch.nn.functional.normalize(out, p=2, dim=1)
    return out


def embed_batch(torch: Any, model: Any, rows: list[list[int]], layout: EmbeddingLayout, *, device: Any,
                pad_id: int) -> list[list[float]]:
    """One padded forward over ``rows`` (token ids, special tokens included) -> one vector per row, each
    value exactly a float32. The caller holds the model lock and ``torch.inference_mode``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long, device=device)
        mask[i, : len(r)] = 1
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    vectors = pool(torch, hidden, mask, layout)
    result: list[list[float]] = vectors.cpu().tolist()  # python floats, each exactly a float32
    return result
