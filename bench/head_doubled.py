"""The same model with every attention head doubled, so that tp=2 can serve a model with an odd head count.

LMDeploy needs tp to divide num_attention_heads. The only real model on the GPU host is SmolLM2-135M
(9 heads, 3 KV heads), and random weights make poor greedy-equality tests (their logits are nearly flat,
so any change of summation order flips ties). Doubling the heads gives 18 heads / 6 KV heads that compute
the SAME function with the real weights: each query head h becomes two identical heads 2h and 2h+1, each
KV head g two identical heads 2g and 2g+1 (head 2h or 2h+1 still reads a copy of g = h // group), and
o_proj's columns for both copies are halved (exact in floating point), so their sum is the original
head's contribution. tests/test_head_doubled.py checks the equivalence with transformers on CPU.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

__all__ = ["double_heads"]


def double_heads(src: Path, dst: Path) -> Path:
    """Write ``src`` (a Llama-architecture HF folder) with doubled attention heads to ``dst``."""
    from safetensors.torch import load_file, save_file

    if (dst / "config.json").exists():
        return dst
    cfg = json.loads((src / "config.json").read_text())
    nh, nkv = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    hd = int(cfg.get("head_dim") or cfg["hidden_size"] // nh)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, tmp / f.name)
    state = {}
    for shard in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    for k, w in list(state.items()):
        if k.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            state[k] = w.reshape(nh, hd, *w.shape[1:]).repeat_interleave(2, dim=0).reshape(2 * nh * hd, *w.shape[1:])
        elif k.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_proj.bias",
                         "self_attn.v_proj.bias")):
            state[k] = w.reshape(nkv, hd, *w.shape[1:]).repeat_interleave(2, dim=0).reshape(2 * nkv * hd, *w.shape[1:])
        elif k.endswith("self_attn.o_proj.weight"):
            state[k] = (w.reshape(w.shape[0], nh, hd).repeat_interleave(2, dim=1) / 2).reshape(w.shape[0], 2 * nh * hd)
    state = {k: v.contiguous() for k, v in state.items()}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg.update(num_attention_heads=2 * nh, num_key_value_heads=2 * nkv, head_dim=hd)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tmp.rename(dst)
    return dst
