"""LoRA through the worker on LMDeploy's PyTorch backend (issue 24): ``lmdq-worker --adapter NAME=PATH``.

A random-weight LoRA adapter made here with peft on SmolLM2-135M-Instruct, served by one worker beside its
base model. One batch mixes adapter and base-model lines (16 prompts each). Greedy outputs of the adapter's
requests must equal transformers + peft on the same weights; the base model's requests must equal the base
model's own outputs, served by LMDeploy with no adapter at all (what an adapter beside it must not change).
Their agreement with transformers alone is printed, not asserted: on the H200 1 base prompt of 16 leaves
transformers' greedy path after 8 tokens in float16 (a near-tie; session 9, docs/gpu-validation.md), which
is two float16 implementations disagreeing, not the adapter leaking. The adapter must change what the model
writes (else the test could not fail).

Run on the GPU host: `python -m pytest tests/gpu/test_lora_gpu.py -v` (docs/gpu-validation.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lmdq.contract import Result, ResultStatus
from tests.conftest import ROOT, RedisServer

BASE = "smollm2"
ADAPTER = "smollm2-lora"
MAX_NEW = 16
PROMPTS = [
    "The capital of France is", "Once upon a time,", "def fibonacci(n):", "Water boils at",
    "The three primary colors are", "In 1969, the first person to walk on the moon was", "A haiku about rain:",
    "The square root of 144 is", "To make a cup of tea, first", "The largest planet in the solar system is",
    "import numpy as np\n", "My favourite book is", "The opposite of hot is", "Photosynthesis is the process",
    "The quick brown fox", "Dear hiring manager,",
]


@pytest.fixture(scope="module")
def adapter_dir(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LoRA on q/k/v/o with random A and small random B: far from a no-op, still readable text."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(24)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                     init_lora_weights=False, task_type="CAUSAL_LM")
    lora = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    out = tmp_path_factory.mktemp("lora") / ADAPTER
    lora.save_pretrained(out)
    return out


def _hf_greedy(model: Any, tok: Any, device: str) -> list[str]:
    import torch

    out = []
    for p in PROMPTS:
        ids = torch.tensor([tok.encode(p)], device=device)
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


@pytest.fixture(scope="module")
def reference(model_path: Path, adapter_dir: Path, gpu_dtype: str) -> dict[str, list[str]]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, gpu_dtype)).cuda().eval()
    base = _hf_greedy(model, tok, "cuda")
    lora = PeftModel.from_pretrained(model, adapter_dir).cuda().eval()
    adapted = _hf_greedy(lora, tok, "cuda")
    del lora, model
    torch.cuda.empty_cache()
    return {BASE: base, ADAPTER: adapted}


@pytest.fixture(scope="module")
def lmdeploy_base(model_path: Path, gpu_dtype: str, gpu_mp_engine: bool) -> list[str]:
    """The base model's greedy outputs from LMDeploy's PyTorch engine with no adapter loaded (the same
    EngineRequests the worker builds for the base lines), loaded, used and closed before the worker starts."""
    import threading

    from lmdq.contract import Endpoint, GenerationParams
    from lmdq.worker.engines.base import EngineRequest
    from lmdq.worker.engines.lmdeploy_engine import LMDeployEngine

    eng = LMDeployEngine.load(model_path=str(model_path), served_model_name=BASE, backend="pytorch", dtype=gpu_dtype,
                              cache_max_entry_count=0.2, mp_engine=gpu_mp_engine)
    try:
        params = GenerationParams(max_new_tokens=MAX_NEW, do_sample=False)
        texts = [""] * len(PROMPTS)
        for ev in eng.stream([EngineRequest(index=i, prompt=p, endpoint=Endpoint.completion, params=params)
                              for i, p in enumerate(PROMPTS)], threading.Event()):
            texts[ev.index] += ev.text
    finally:
        eng.close()
    return texts


def test_adapter_served_by_the_pytorch_backend_equals_transformers_and_peft(
        model_path: Path, adapter_dir: Path, gpu_dtype: str, reference: dict[str, list[str]],
        lmdeploy_base: list[str], tmp_path: Path) -> None:
    changed = sum(a != b for a, b in zip(reference[ADAPTER], reference[BASE]))
    assert changed >= len(PROMPTS) // 2, "the adapter barely changes the outputs: the test could not fail"
    rows = [{"custom_id": f"{m}-{i}", "prompt": p, "endpoint": "completion", "model": m,
             "params": {"max_new_tokens": MAX_NEW, "do_sample": False}}
            for i, p in enumerate(PROMPTS) for m in ((BASE, ADAPTER) if i % 2 else (ADAPTER, BASE))]
    f = tmp_path / "lora.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    srv = RedisServer().start()
    env = {**os.environ, "LMDQ_REDIS_URL": srv.url, "LMDQ_HEALTH_PORT": "0", "LMDQ_LOG_FORMAT": "json"}
    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115
    w = None
    try:
        reg = subprocess.run([sys.executable, "-m", "lmdq.producer", "models", "add", BASE, ADAPTER], env=env, cwd=ROOT,
                             capture_output=True)
        assert reg.returncode == 0, reg.stderr.decode()
        sub = subprocess.run([sys.executable, "-m", "lmdq.producer", "submit", str(f), "--batch-size", "4"], env=env,
                             cwd=ROOT, capture_output=True)
        assert sub.returncode == 0, sub.stderr.decode()
        bid = sub.stdout.decode().strip()
        w = subprocess.Popen([sys.executable, "-m", "lmdq.worker", "--engine", "lmdeploy", "--backend", "pytorch",
                              "--model", str(model_path), "--served-model-name", BASE, "--dtype", gpu_dtype,
                              "--adapter", f"{ADAPTER}={adapter_dir}", "--cache-max-entry-count", "0.2", "--burst"],
                             env=env, cwd=ROOT, stdout=log, stderr=log)
        res = subprocess.run([sys.executable, "-m", "lmdq.producer", "results", bid, "--wait", "--timeout", "300"],
                             env=env, cwd=ROOT, capture_output=True)
        assert res.returncode == 0, res.stderr.decode() + (tmp_path / "worker.log").read_text()[-3000:]
        got = [Result.model_validate_json(x) for x in res.stdout.splitlines()]
        assert [r.custom_id for r in got] == [r["custom_id"] for r in rows]
        mismatches, base_vs_transformers = [], []
        for r, row in zip(got, rows):
            assert r.status is ResultStatus.completed, r.error
            assert r.model == row["model"] and r.backend == "pytorch"
            i = int(row["custom_id"].rsplit("-", 1)[1])
            want = reference[ADAPTER][i] if row["model"] == ADAPTER else lmdeploy_base[i]
            if r.text != want:
                mismatches.append({"custom_id": r.custom_id, "lmdq": r.text, "want": want})
            if row["model"] == BASE and r.text != reference[BASE][i]:
                base_vs_transformers.append({"custom_id": r.custom_id, "lmdq": r.text,
                                             "transformers": reference[BASE][i]})
        print(json.dumps({"prompts": len(PROMPTS), "adapter_changed": changed, "mismatches": mismatches,
                          "base_differs_from_transformers_fp16": base_vs_transformers}, indent=1))
        assert not mismatches
        st = subprocess.run([sys.executable, "-m", "lmdq.producer", "status", bid, "--json"], env=env, cwd=ROOT,
                            capture_output=True)
        counts = json.loads(st.stdout)["model_counts"]
        assert {m: c["completed"] for m, c in counts.items()} == {BASE: len(PROMPTS), ADAPTER: len(PROMPTS)}
        assert w.wait(120) == 0, (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        if w is not None and w.poll() is None:
            w.kill()
        log.close()
        srv.cleanup()


def test_turbomind_refuses_adapters_at_start(model_path: Path, adapter_dir: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "lmdq.worker", "--engine", "lmdeploy", "--backend", "turbomind",
                        "--model", str(model_path), "--adapter", f"{ADAPTER}={adapter_dir}", "--burst"],
                       env={**os.environ, "LMDQ_HEALTH_PORT": "0"}, cwd=ROOT, capture_output=True, timeout=120)
    err = p.stderr.decode()
    assert p.returncode == 2 and "TurboMind cannot serve LoRA adapters" in err and "Traceback" not in err, err
