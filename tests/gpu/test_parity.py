"""Greedy parity, LMDeploy (PyTorch backend) vs transformers, on random-weight Llamas built here.

Shapes: 8 heads / 8 KV heads, and 9 heads / 3 KV heads with head_dim 64 and tied embeddings
(SmolLM2-135M's shape). The first 16 generated token ids must be identical.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

SHAPES = {
    "8h-8kv": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, intermediate_size=1024,
                   tie_word_embeddings=False),
    "9h-3kv-tied": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                        intermediate_size=1536, tie_word_embeddings=True),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
RESULTS: list[dict] = []


def _build(tmp: Path, shape: dict, model_path: Path, dtype: str) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, num_hidden_layers=4, max_position_embeddings=2048, rope_theta=100000.0,
                      rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, torch_dtype=dtype, **shape)
    m = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    m.save_pretrained(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (model_path / f).exists():
            shutil.copy(model_path / f, tmp / f)
    return tmp


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_greedy_parity(name: str, dtype: str, tokenizer_dir: Path, tmp_path: Path) -> None:
    import torch
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    from transformers import AutoModelForCausalLM

    folder = _build(tmp_path / name, SHAPES[name], tokenizer_dir, dtype)
    pipe = pipeline(str(folder), backend_config=PytorchEngineConfig(dtype=dtype, cache_max_entry_count=0.2,
                                                                      session_len=512))
    try:
        tok = pipe.async_engine.tokenizer
        gen = GenerationConfig(max_new_tokens=16, do_sample=False, ignore_eos=True)
        outs = pipe(PROMPTS, gen_config=gen, do_preprocess=False)
        ld = [list(o.token_ids) for o in outs]
        ids = [tok.encode(p) for p in PROMPTS]
    finally:
        pipe.close()
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype)).cuda().eval()
    tf = []
    for x in ids:
        out = hf.generate(torch.tensor([x]).cuda(), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        tf.append(out[0, len(x):].tolist())
    same = [sum(a == b for a, b in zip(p, q)) for p, q in zip(ld, tf)]
    RESULTS.append({"shape": name, "dtype": dtype, "matching_tokens": same, "of": 16})
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(Path(out_dir) / "parity.jsonl", "a") as fh:
            fh.write(json.dumps(RESULTS[-1]) + "\n")
    assert ld == tf, f"{name}/{dtype}: matching tokens per prompt {same}"
