"""LoRA adapters served by the worker (issue 24): ``lmdq-worker --adapter NAME=PATH``.

The transformers engine serves adapters through peft: one batch whose lines name the base model and
an adapter (a random-weight peft LoRA on the embedded SmolLM2, so it changes the outputs), one worker
(real redis-server, the real CLIs as processes). Adapter requests must equal a direct transformers +
peft greedy run, base requests the base model's. And the refusals: TurboMind, the sim engine, bad names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from lmdq.contract import BatchStatus, Result, ResultStatus
from tests.conftest import run_cli, start_worker
from tests.helpers import wait_batch, write_jsonl

peft = pytest.importorskip("peft")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BASE = "smol-base"
ADAPTER = "smol-lora"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at",
           "The best way to learn", "Roses are red,"]
MAX_NEW = 8


@pytest.fixture(scope="module")
def base_dir() -> Path:
    from lmdq.worker.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="module")
def adapter_dir(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter with random A and B (init_lora_weights=False): a real adapter file, far from zero."""
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    cfg = peft.LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                          task_type="CAUSAL_LM")
    lora = peft.get_peft_model(model, cfg)
    out = tmp_path_factory.mktemp("adapter") / "lora"
    lora.save_pretrained(out)
    return out


def _greedy(model: Any, tok: Any, prompt: str) -> str:
    # the engine's raw (completion) prompt: tokenized with special tokens, as LMDeploy does
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=True)])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                             pad_token_id=tok.eos_token_id)
    return str(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))


@pytest.fixture(scope="module")
def direct(base_dir: Path, adapter_dir: Path) -> dict[str, list[str]]:
    """Greedy texts straight from transformers (base) and transformers + peft (adapter)."""
    tok = transformers.AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    model.eval()
    base = [_greedy(model, tok, p) for p in PROMPTS]
    lora = peft.PeftModel.from_pretrained(model, adapter_dir)
    lora.eval()
    adapted = [_greedy(lora, tok, p) for p in PROMPTS]
    return {BASE: base, ADAPTER: adapted}


def test_adapter_and_base_requests_in_one_batch_match_transformers_and_peft(
        tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str, base_dir: Path, adapter_dir: Path,
        direct: dict[str, list[str]]) -> None:
    assert direct[ADAPTER] != direct[BASE]  # the premise: the adapter changes what the model writes
    rows = []
    for i, p in enumerate(PROMPTS):
        for model in (ADAPTER, BASE) if i % 2 else (BASE, ADAPTER):
            rows.append({"custom_id": f"{model}-{i}", "prompt": p, "endpoint": "completion", "model": model,
                         "params": {"max_new_tokens": MAX_NEW}})
    f = write_jsonl(tmp_path / "lora.jsonl", rows)
    p = run_cli("lmdq.producer", "models", "add", BASE, ADAPTER, env=env)
    assert p.returncode == 0, p.stderr.decode()
    p = run_cli("lmdq.producer", "submit", str(f), "--batch-size", "3", "--json", env=env)
    assert p.returncode == 0, p.stderr.decode()
    bid = json.loads(p.stdout)["id"]
    log = tmp_path / "worker.log"
    w = start_worker("--engine", "transformers", "--model", str(base_dir), "--served-model-name", BASE,
                     "--adapter", f"{ADAPTER}={adapter_dir}", "--burst", env=env, log=log)
    assert w.wait(600) == 0, log.read_text()[-3000:]
    b = wait_batch(client, prefix, bid)
    assert b.status is BatchStatus.completed, log.read_text()[-3000:]
    assert b.model_counts is not None
    assert {m: c.completed for m, c in b.model_counts.items()} == {BASE: len(PROMPTS), ADAPTER: len(PROMPTS)}
    out = run_cli("lmdq.producer", "results", bid, env=env)
    results = [Result.model_validate_json(x) for x in out.stdout.splitlines()]
    assert [r.custom_id for r in results] == [r["custom_id"] for r in rows]
    for r, row in zip(results, rows):
        assert r.status is ResultStatus.completed, r.error
        assert r.model == row["model"]
        i = int(row["custom_id"].rsplit("-", 1)[1])
        assert r.text == direct[row["model"]][i], (row, r.text)
    # the worker registered the adapter as a model it serves
    models = run_cli("lmdq.producer", "models", "list", "--json", env=env)
    assert models.returncode == 0
    assert {BASE, ADAPTER} <= {m["model"] for m in map(json.loads, models.stdout.splitlines())}


@pytest.mark.parametrize("flags, message", [
    (("--engine", "lmdeploy", "--model", "/nonexistent", "--backend", "turbomind"), "TurboMind"),
    (("--engine", "sim",), "sim engine"),
])
def test_engines_that_cannot_serve_adapters_refuse_at_start(
        env: dict[str, str], adapter_dir: Path, flags: tuple[str, ...], message: str) -> None:
    p = run_cli("lmdq.worker", *flags, "--adapter", f"{ADAPTER}={adapter_dir}", "--burst", env=env, timeout=120)
    err = p.stderr.decode()
    assert p.returncode == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "--adapter" in lines[0] and message in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("spec, message", [
    ("no-equals-sign", "expected NAME=PATH"),
    ("bad name=/x", "model name"),
    ("ok=", "expected NAME=PATH"),
])
def test_bad_adapter_flags_are_one_line_errors(env: dict[str, str], spec: str, message: str) -> None:
    p = run_cli("lmdq.worker", "--engine", "transformers", "--adapter", spec, "--burst", env=env, timeout=120)
    err = p.stderr.decode()
    assert p.returncode == 2, err
    assert message in err and "Traceback" not in err


def _one_line_refusal(p: Any) -> str:
    err = p.stderr.decode()
    assert p.returncode == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: --adapter"), lines[0]
    return lines[0]


@pytest.mark.parametrize("flags, spec, message", [
    # the base model's served name: its requests would get the adapter's text
    (("--served-model-name", "smol"), "smol={adapter}", "'smol' is the base model's served name"),
    ((), "smollm2-135m-instruct={adapter}", "'smollm2-135m-instruct' is the base model's served name"),
    ((), "twin={adapter},twin={adapter}", "'twin' given twice"),
    # names lmdq takes but peft / LMDeploy cannot load (torch module names hold no '.')
    ((), "lora.v1={adapter}", "'lora.v1' contains '.'"),
    ((), "lora={adapter}", "'lora' is part of peft's LoRA prefix"),
])
def test_adapter_names_the_engine_cannot_serve_are_refused_before_the_load(
        env: dict[str, str], adapter_dir: Path, flags: tuple[str, ...], spec: str, message: str) -> None:
    e = {**env, "LMDQ_ADAPTER": spec.format(adapter=adapter_dir)} if "," in spec else env
    args = () if "," in spec else ("--adapter", spec.format(adapter=adapter_dir))
    p = run_cli("lmdq.worker", "--engine", "transformers", *flags, *args, "--burst", env=e, timeout=120)
    assert message in _one_line_refusal(p)


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing", "does not exist"),
    (lambda d: (d / "file").write_text("x") and d / "file", "is not a folder"),
    (lambda d: (d / "empty").mkdir() or d / "empty", "has no adapter_config.json"),
    (lambda d: ((d / "bad").mkdir(), (d / "bad" / "adapter_config.json").write_text("{"))[0] or d / "bad",
     "adapter_config.json is not valid JSON"),
    (lambda d: ((d / "bin").mkdir(), (d / "bin" / "adapter_config.json").write_bytes(b"\xff\xfe"))[0] or d / "bin",
     "adapter_config.json is not UTF-8"),
])
def test_bad_adapter_paths_are_one_line_before_the_load(
        tmp_path: Path, env: dict[str, str], make: Any, message: str) -> None:
    path = make(tmp_path)
    p = run_cli("lmdq.worker", "--engine", "transformers", "--adapter", f"sql={path}", "--burst", env=env,
                timeout=120)
    line = _one_line_refusal(p)
    assert "'sql'" in line and str(path) in line and message in line, line


def test_adapter_checks_are_one_rule_for_every_engine(adapter_dir: Path) -> None:
    """LMDeploy's PyTorch backend gets the same name and path checks (no GPU needed: before the load)."""
    from lmdq.errors import BadSetting
    from lmdq.worker.settings import load_worker_settings

    for spec, message in ((f"a.b={adapter_dir}", "contains '.'"), ("x=/nonexistent", "does not exist"),
                          (f"m={adapter_dir}", "base model's served name")):
        with pytest.raises(BadSetting, match=message):
            load_worker_settings(engine="lmdeploy", model="/models/m", backend="pytorch", adapter=[spec])
    s = load_worker_settings(engine="lmdeploy", model="/models/m", backend="pytorch", adapter=[f"sql={adapter_dir}"])
    assert s.adapters == {"sql": str(adapter_dir)}
