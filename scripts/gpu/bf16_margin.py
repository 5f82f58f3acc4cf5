"""Is LMDeploy-bf16's SmolLM2 answer a bug, or ordinary bf16 rounding on a near tie? (GPU host)

scripts/gpu/bf16_probe.py showed LMDeploy-bf16's per-layer errors equal transformers-bf16's, averaged
over all 37 prompt positions. This one looks where the answer is decided:

1. France prompt, the LAST position (it predicts the first answer token): the residual stream after
   every layer (relative error vs transformers fp32), and the top-5 logits of each engine/dtype
   (LMDeploy's through a forward hook on its lm_head, cross-checked with logprobs=5 from the pipeline).
2. Many prompts, greedy, 24 tokens, ignore_eos: where each engine/dtype first leaves transformers-fp32's
   token sequence, and fp32's own logit margin there (fp32 logit of fp32's token minus fp32 logit of
   the engine's token, on the shared prefix). Ordinary rounding flips only near ties (small margins)
   and does so for transformers-bf16 as well; a kernel bug flips tokens fp32 prefers by a wide margin.

Writes $OUT/bf16_margin.json.  usage: python scripts/gpu/bf16_margin.py MODEL_DIR
(without CUDA it runs the transformers half only, for a dry run of the script itself)
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

QUESTIONS = [
    "What is the capital of France?", "What is the capital of Japan?", "Name three primary colors.",
    "What is 12 times 7?", "Who wrote Romeo and Juliet?", "Explain photosynthesis in one sentence.",
    "What is the boiling point of water in Celsius?", "Give me a synonym for happy.",
    "What is the largest planet in the solar system?", "Translate 'good morning' into Spanish.",
    "How many legs does a spider have?", "What does CPU stand for?", "Write a haiku about the sea.",
    "What is the square root of 81?", "Who painted the Mona Lisa?", "What language is spoken in Brazil?",
    "List two benefits of exercise.", "What is the chemical symbol for gold?", "Why is the sky blue?",
    "What is the capital of Italy?", "Name a mammal that can fly.", "What year did World War II end?",
    "How many days are in a leap year?", "What is the freezing point of water in Fahrenheit?",
]
N_TOKENS = 24


def rel(a: Any, b: Any) -> float:
    return round(float((a.float() - b.float()).norm() / b.float().norm()), 5)


def top5(logits: Any, tok: Any) -> list[list[Any]]:
    v, i = logits.float().topk(5)
    return [[int(t), tok.decode([int(t)]), round(float(x), 3)] for x, t in zip(v, i)]


def hook_streams(layers: list[Any], store: dict[int, Any]) -> None:
    """Residual stream after each decoder layer, last position, prefill call only."""
    def make(i: int):  # type: ignore[no-untyped-def]
        def hook(_m, _inp, out):  # type: ignore[no-untyped-def]
            if i in store:
                return
            if isinstance(out, tuple) and len(out) == 2 and out[1] is not None and out[1].shape == out[0].shape:
                t = out[0].float() + out[1].float()  # LMDeploy layers return (hidden, residual)
            else:
                t = (out[0] if isinstance(out, tuple) else out).float()
            t = t.reshape(-1, t.shape[-1])
            if t.shape[0] > 1:
                store[i] = t[-1].detach().clone()
        return hook
    for i, layer in enumerate(layers):
        layer.register_forward_hook(make(i))


def decoder_layers(model: Any) -> list[Any]:
    return [m for _, m in model.named_modules() if type(m).__name__.endswith("DecoderLayer")]


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = sys.argv[1] if len(sys.argv) > 1 else "/root/models/smollm2-135m-instruct"
    out_dir = os.environ.get("OUT", ".")
    n_q = int(os.environ.get("BF16_MARGIN_PROMPTS", len(QUESTIONS)))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(model)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS[:n_q]]
    ids = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False) for c in chats]
    report: dict[str, Any] = {"model": model, "n_prompts": n_q, "n_tokens": N_TOKENS, "france_input_ids": len(ids[0])}
    streams: dict[str, dict[int, Any]] = {}
    last_logits: dict[str, Any] = {}
    gens: dict[str, list[list[int]]] = {}

    hf_runs = [("hf_fp32", torch.float32, "sdpa"), ("hf_bf16", torch.bfloat16, "sdpa"),
               ("hf_bf16_eager_attn", torch.bfloat16, "eager"), ("hf_fp16", torch.float16, "sdpa")]
    ref_model = None
    for name, dt, attn in hf_runs:
        m = AutoModelForCausalLM.from_pretrained(model, dtype=dt, attn_implementation=attn).to(dev).eval()
        store: dict[int, Any] = {}
        hook_streams(decoder_layers(m), store)
        with torch.no_grad():
            x = torch.tensor([ids[0]], device=dev)
            last_logits[name] = m(x).logits[0, -1].float().cpu()
            streams[name] = {k: v.cpu() for k, v in store.items()}
            out = []
            for p in ids:
                g = m.generate(torch.tensor([p], device=dev), max_new_tokens=N_TOKENS, min_new_tokens=N_TOKENS,
                               do_sample=False, pad_token_id=tok.eos_token_id)
                out.append([int(t) for t in g[0, len(p):]])
        gens[name] = out
        if name == "hf_fp32":
            ref_model = m
        else:
            del m
        print(name, "done:", json.dumps(tok.decode(gens[name][0], skip_special_tokens=True)), flush=True)

    if dev == "cuda":
        from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline

        for name, dt in (("lmdeploy_bf16", "bfloat16"), ("lmdeploy_fp16", "float16")):
            # logprobs_mode: without it the PyTorch engine returns no logprobs (session 3 got []); in-process
            # engine (the default): the lm_head hook below needs the model in this process
            pipe = pipeline(model, backend_config=PytorchEngineConfig(dtype=dt, eager_mode=True, session_len=512,
                                                                       cache_max_entry_count=0.1,
                                                                       logprobs_mode="raw_logprobs"))
            try:
                pm = pipe.async_engine.engine.executor.model_agent.patched_model
                pm = getattr(pm, "model", pm)  # a CUDAGraphRunner wraps the model even in eager mode
                store = {}
                hook_streams(decoder_layers(pm), store)
                grabbed: list[Any] = []
                head = next((mod for n, mod in pm.named_modules() if n.endswith("lm_head")), None)
                if head is not None:
                    head.register_forward_hook(lambda _m, _i, o, g=grabbed: g.append(o.detach().float().cpu())
                                               if not g else None)
                r0 = pipe([chats[0]], gen_config=GenerationConfig(max_new_tokens=1, do_sample=False, logprobs=5))[0]
                streams[name] = {k: v.cpu() for k, v in store.items()}
                if grabbed:
                    last_logits[name] = grabbed[0].reshape(-1, grabbed[0].shape[-1])[-1]
                report[f"{name}_first_token_logprobs"] = [
                    [int(t), tok.decode([int(t)]), round(float(v), 4)]
                    for t, v in sorted((r0.logprobs or [{}])[0].items(), key=lambda kv: -kv[1])]
                rs = pipe(chats, gen_config=GenerationConfig(max_new_tokens=N_TOKENS, min_new_tokens=N_TOKENS,
                                                             do_sample=False, ignore_eos=True))
                gens[name] = [list(map(int, r.token_ids))[:N_TOKENS] for r in rs]
                report[f"{name}_input_lens_equal"] = all(r.input_token_len == len(p) for r, p in zip(rs, ids))
            except Exception as e:  # noqa: BLE001 - report what could not be reached
                report[f"{name}_error"] = repr(e)
            finally:
                pipe.close()
            if name in gens:
                print(name, "done:", json.dumps(tok.decode(gens[name][0], skip_special_tokens=True)), flush=True)

    # 1. France, last position
    ref_s, ref_l = streams["hf_fp32"], last_logits["hf_fp32"]
    layers = sorted(ref_s)
    report["france_last_position"] = {
        name: {
            "answer": tok.decode(gens.get(name, [[]])[0], skip_special_tokens=True),
            "top5_logits": top5(last_logits[name], tok) if name in last_logits else None,
            "logits_rel_err_vs_fp32": rel(last_logits[name], ref_l) if name in last_logits else None,
            "stream_rel_err_by_layer": [rel(streams[name][i], ref_s[i]) for i in layers if i in streams.get(name, {})],
        } for name in streams
    }
    report["stream_max_abs_last_position_fp32"] = [round(float(ref_s[i].abs().max()), 1) for i in layers]

    # 2. first divergence from fp32 and fp32's margin there
    assert ref_model is not None
    div: dict[str, Any] = {}
    for name, seqs in gens.items():
        if name == "hf_fp32":
            continue
        rows = []
        for p, ref, got in zip(ids, gens["hf_fp32"], seqs):
            d = next((k for k, (a, b) in enumerate(zip(ref, got)) if a != b), None)
            if d is None:
                rows.append(None)
                continue
            with torch.no_grad():
                lg = ref_model(torch.tensor([p + ref[:d]], device=dev)).logits[0, -1].float()
            rank = int((lg > lg[got[d]]).sum())
            rows.append({"pos": d, "fp32_margin": round(float(lg[ref[d]] - lg[got[d]]), 4), "fp32_rank": rank})
        margins = [r["fp32_margin"] for r in rows if r]
        div[name] = {"identical_24_tokens": sum(r is None for r in rows), "diverged": len(margins),
                     "max_fp32_margin_at_divergence": max(margins) if margins else None,
                     "median_fp32_margin_at_divergence": sorted(margins)[len(margins) // 2] if margins else None,
                     "per_prompt": rows}
        print(name, json.dumps({k: v for k, v in div[name].items() if k != "per_prompt"}), flush=True)
    report["divergence_from_fp32"] = div
    with open(os.path.join(out_dir, "bf16_margin.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "stream_rel_err_by_layer"}
                      for k, v in report["france_last_position"].items()}, ensure_ascii=False), flush=True)
    for k in ("lmdeploy_bf16_first_token_logprobs", "lmdeploy_fp16_first_token_logprobs"):
        print(k, report.get(k), flush=True)


if __name__ == "__main__":
    main()
