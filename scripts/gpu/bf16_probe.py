"""Where does LMDeploy's bf16 SmolLM2-135M-Instruct diverge from transformers? (GPU host only)

For the chat prompt "What is the capital of France?" (37 tokens) this compares, layer by layer,
the prefill activations of LMDeploy's PyTorch backend (bf16 and fp16, tp=1: the model runs
in-process, so forward hooks reach its decoder layers) with transformers in fp32 (reference) and
bf16 (what "normal" bf16 rounding looks like): each layer's attention output, MLP output and the
residual stream after the layer, as relative L2 errors against fp32. The first layer where
LMDeploy-bf16's error jumps far above transformers-bf16's is where it diverges.
Writes $OUT/bf16_probe.json.  usage: python scripts/gpu/bf16_probe.py MODEL_DIR
"""

from __future__ import annotations

import json
import os
import sys


def _first(x):  # type: ignore[no-untyped-def]
    return x[0] if isinstance(x, tuple) else x


def _hook_layers(model, store: dict, n_tokens: int):  # type: ignore[no-untyped-def]
    """Capture (attn out, mlp out, residual stream) of every decoder layer for the prefill pass."""
    import torch

    layers = [m for _, m in model.named_modules() if type(m).__name__.endswith("DecoderLayer")]
    hidden = None

    def grab(key: str):  # type: ignore[no-untyped-def]
        def hook(_m, _inp, out):  # type: ignore[no-untyped-def]
            if key in store:
                return
            if isinstance(out, tuple) and len(out) == 2 and key.endswith("/stream") and out[1] is not None \
                    and out[1].shape == out[0].shape:
                t = out[0].float() + out[1].float()  # LMDeploy: (hidden, residual) -> stream = sum
            else:
                t = _first(out).float()
            t = t.reshape(-1, t.shape[-1])
            if t.shape[0] == n_tokens:
                store[key] = t.detach().clone()
        return hook

    for i, layer in enumerate(layers):
        layer.self_attn.register_forward_hook(grab(f"{i}/attn"))
        layer.mlp.register_forward_hook(grab(f"{i}/mlp"))
        layer.register_forward_hook(grab(f"{i}/stream"))
        hidden = layer
    return len(layers), hidden, torch


def main() -> None:
    import torch
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = sys.argv[1] if len(sys.argv) > 1 else "/root/models/smollm2-135m-instruct"
    out_dir = os.environ.get("OUT", ".")
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    with open(os.path.join(model, "config.json")) as f:
        report: dict = {"model": model, "config": json.load(f)}
    tok = AutoTokenizer.from_pretrained(model)
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    n = len(ids)
    report["n_input_tokens"] = n
    x = torch.tensor([ids]).cuda()

    acts: dict[str, dict] = {}
    answers: dict[str, str] = {}
    for name, dt in (("hf_fp32", torch.float32), ("hf_bf16", torch.bfloat16), ("hf_fp16", torch.float16)):
        m = AutoModelForCausalLM.from_pretrained(model, dtype=dt).cuda().eval()
        store: dict = {}
        n_layers, _, _ = _hook_layers(m, store, n)
        with torch.no_grad():
            m(x)
            g = m.generate(x, max_new_tokens=16, do_sample=False)
        answers[name] = tok.decode(g[0, n:], skip_special_tokens=True)
        acts[name] = store
        del m
        torch.cuda.empty_cache()

    for name, dt in (("lmdeploy_bf16", "bfloat16"), ("lmdeploy_fp16", "float16")):
        pipe = pipeline(model, backend_config=PytorchEngineConfig(dtype=dt, eager_mode=True, session_len=256,
                                                                   cache_max_entry_count=0.1))
        try:
            eng = pipe.async_engine.engine
            agent = eng.executor.model_agent
            pm = agent.patched_model
            root = getattr(pm, "model", pm)
            store = {}
            _hook_layers(root, store, n)
            r = pipe([msgs], gen_config=GenerationConfig(max_new_tokens=16, do_sample=False))[0]
            answers[name] = r.text
            report[f"{name}_input_token_len"] = r.input_token_len
            acts[name] = store
        except Exception as e:  # noqa: BLE001 - report what we could not reach
            report[f"{name}_error"] = repr(e)
        finally:
            pipe.close()
    report["answers"] = answers

    ref = acts["hf_fp32"]

    def rel(a: torch.Tensor | None, b: torch.Tensor) -> float | None:
        if a is None:
            return None
        return round(float((a.cuda() - b.cuda()).norm() / b.cuda().norm()), 5)

    rows = []
    for i in range(n_layers):
        row: dict = {"layer": i, "stream_max_abs_fp32": round(float(ref[f"{i}/stream"].abs().max()), 1)}
        for part in ("attn", "mlp", "stream"):
            for name in ("hf_bf16", "hf_fp16", "lmdeploy_bf16", "lmdeploy_fp16"):
                row[f"{part}:{name}"] = rel(acts.get(name, {}).get(f"{i}/{part}"), ref[f"{i}/{part}"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    report["layers"] = rows
    # the first layer where LMDeploy-bf16 is 5x worse than transformers-bf16, per part
    first = {}
    for part in ("attn", "mlp", "stream"):
        for row in rows:
            a, b = row.get(f"{part}:lmdeploy_bf16"), row.get(f"{part}:hf_bf16")
            if a is not None and b is not None and a > 5 * b and a > 0.02:
                first[part] = row["layer"]
                break
    report["first_divergent_layer"] = first
    with open(os.path.join(out_dir, "bf16_probe.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    print("answers:", json.dumps(answers), "\nfirst divergent:", first, flush=True)


if __name__ == "__main__":
    main()
