"""Where does LMDeploy's bf16 SmolLM2-135M-Instruct diverge from transformers? (GPU host only)

Compares, for the chat prompt "What is the capital of France?":
  * the greedy answers of transformers fp32 / bf16 and LMDeploy (PyTorch backend) bf16 / fp16;
  * per-layer hidden states: LMDeploy truncated to k layers (hf_overrides num_hidden_layers=k,
    output_last_hidden_state='all') vs transformers fp32 at layer k (final norm applied), next to
    transformers bf16's own error at layer k, so "normal bf16 noise" and a real divergence can be
    told apart;
  * the residual stream's largest magnitude per layer (fp32), which explains where bf16 rounding bites.
Writes $OUT/bf16_probe.json and prints a table.
usage: python scripts/gpu/bf16_probe.py MODEL_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    import torch
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = sys.argv[1] if len(sys.argv) > 1 else "/root/models/smollm2-135m-instruct"
    out_dir = os.environ.get("OUT", ".")
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    report: dict = {"model": model, "config": json.load(open(os.path.join(model, "config.json")))}
    tok = AutoTokenizer.from_pretrained(model)
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    report["input_ids"] = list(ids)
    x = torch.tensor([ids]).cuda()

    def hf(dtype: torch.dtype) -> tuple:
        m = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).cuda().eval()
        with torch.no_grad():
            o = m(x, output_hidden_states=True)
            hs = [h[0].float() for h in o.hidden_states]
            normed = [m.model.norm(h.to(dtype)[None])[0].float() for h in o.hidden_states]
            g = m.generate(x, max_new_tokens=16, do_sample=False)
        text = tok.decode(g[0, len(ids):], skip_special_tokens=True)
        del m
        torch.cuda.empty_cache()
        return hs, normed, text

    hs32, n32, t32 = hf(torch.float32)
    hsb, nb, tb = hf(torch.bfloat16)
    L = len(hs32) - 1
    report["hf_fp32_answer"], report["hf_bf16_answer"] = t32, tb
    report["residual_max_abs_fp32"] = [round(float(h.abs().max()), 2) for h in hs32]
    report["residual_max_abs_dim_fp32"] = [int(h.abs().max(0).values.argmax()) for h in hs32]

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    def run_lmdeploy(dtype: str, layers: int | None) -> tuple[str, torch.Tensor | None, float]:
        t0 = time.time()
        cfg = PytorchEngineConfig(dtype=dtype, cache_max_entry_count=0.1, session_len=256, eager_mode=True,
                                  hf_overrides={"num_hidden_layers": layers} if layers else None)
        pipe = pipeline(model, backend_config=cfg)
        try:
            r = pipe([msgs], gen_config=GenerationConfig(max_new_tokens=16 if layers is None else 1,
                                                          do_sample=False, output_last_hidden_state="all"))[0]
        finally:
            pipe.close()
        h = r.last_hidden_state
        return r.text, (h.float().cuda() if h is not None else None), time.time() - t0

    answers = {}
    for dt in ("bfloat16", "float16"):
        text, h, secs = run_lmdeploy(dt, None)
        answers[dt] = text
        if h is not None:
            n = len(ids)
            report[f"lmdeploy_{dt}_final_rel_err_vs_hf_fp32"] = rel(h[:n], n32[L])
    report["lmdeploy_answers"] = answers
    rows = []
    for k in sorted({1, 2, 3, 4, 6, 8, 12, 16, 20, 24, L}):
        text, h, secs = run_lmdeploy("bfloat16", k)
        n = len(ids)
        row = {"layers": k, "hf_bf16_rel_err": rel(nb[k], n32[k]) if k < L else rel(nb[L], n32[L]),
               "lmdeploy_bf16_rel_err": rel(h[:n], n32[k] if k < L else n32[L]) if h is not None else None,
               "residual_max_abs": report["residual_max_abs_fp32"][k], "start_s": round(secs, 1)}
        if h is not None:
            per_pos = ((h[:n] - n32[k]).norm(dim=-1) / n32[k].norm(dim=-1)).tolist()
            row["worst_positions"] = sorted(range(n), key=lambda i: -per_pos[i])[:3]
            row["worst_pos_rel_err"] = [round(per_pos[i], 4) for i in row["worst_positions"]]
        rows.append(row)
        print(json.dumps(row), flush=True)
    report["layer_sweep"] = rows
    with open(os.path.join(out_dir, "bf16_probe.json"), "w") as f:
        json.dump(report, f, indent=1)
    print("hf fp32:", t32, "| hf bf16:", tb, "| lmdeploy:", answers)


if __name__ == "__main__":
    main()
