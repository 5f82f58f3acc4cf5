"""bench/head_doubled.py: SmolLM2-135M with 18 heads / 6 KV heads computes what the 9/3 original does."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.model


def test_doubled_heads_compute_the_same_function(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmdq.worker.default_model import ensure_default_model
    from lmdq_bench.head_doubled import double_heads

    src = ensure_default_model()
    dst = double_heads(src, tmp_path / "doubled")
    tok = AutoTokenizer.from_pretrained(str(src))
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    x = torch.tensor([tok.encode(text, add_special_tokens=False)])
    a = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32).eval()
    assert (b.config.num_attention_heads, b.config.num_key_value_heads) == (18, 6)
    with torch.no_grad():
        la, lb = a(x).logits, b(x).logits
        ga = a.generate(x, max_new_tokens=16, do_sample=False)
        gb = b.generate(x, max_new_tokens=16, do_sample=False)
    assert (la - lb).abs().max().item() < 1e-3 * la.abs().max().item()
    assert ga.tolist() == gb.tolist()
    assert "Paris" in tok.decode(gb[0, x.shape[1]:])
