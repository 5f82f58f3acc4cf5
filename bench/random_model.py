"""A random-weight Llama-3-8B-shaped model folder, built on the GPU (throughput benchmarks only).

Weights are random, so text is gibberish; with ignore_eos every request decodes exactly
output_len tokens, which is what a throughput comparison needs. The tokenizer is borrowed from
a real model folder with the same vocabulary size (SmolLM2's 49152).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)


def build_random_llama(dst: Path, tokenizer_from: Path, vocab_size: int = 49152, **overrides: object) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (dst / "config.json").exists():
        return dst
    t0 = time.time()
    cfg = LlamaConfig(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                      torch_dtype="bfloat16", **{**LLAMA3_8B, **overrides})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    tmp = dst.with_suffix(".tmp")
    model.save_pretrained(tmp, max_shard_size="4GB")
    del model
    torch.cuda.empty_cache()
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (tokenizer_from / f).exists() and f != "generation_config.json":
            shutil.copy(tokenizer_from / f, tmp / f)
    tmp.rename(dst)
    print(f"random Llama-3-8B-shaped model at {dst} in {time.time() - t0:.1f} s", flush=True)
    return dst
