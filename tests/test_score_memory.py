"""Score memory is bounded by ``score_logits_mb`` whatever the continuation's length (issue 44).

The transformers engine scores a continuation whose logits would exceed the budget in chunks of positions
through the KV cache, each chunk's logits reduced to log-probs before the next: the same numbers as one
forward, and never more than the budget of logits at once. The sim engine's scores are linear in words.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from lmdq.contract import Endpoint
from lmdq.worker.engines.base import EngineRequest
from lmdq.worker.engines.scoring import logit_positions
from tests.helpers import direct_score, final_events

ROOT = Path(__file__).resolve().parents[1]
LONG = " ".join(f"item {i} of the list, then" for i in range(40))  # ~280 tokens


def _score(engine: Any, prompt: str, conts: tuple[str, ...]) -> list[tuple[float, int, bool]]:
    ev = final_events(engine.stream([EngineRequest(index=0, prompt=prompt, endpoint=Endpoint.score,
                                                   continuations=conts)], threading.Event()))[0]
    assert ev.finish_reason == "stop" and ev.scores is not None, ev
    return list(ev.scores)


def _lm_head_rows(engine: Any) -> tuple[list[int], Any]:
    """Positions of logits each forward turned out (a hook on the output embedding) and the hook handle."""
    seen: list[int] = []

    def hook(_module: Any, _inputs: Any, output: Any) -> None:
        seen.append(int(output.numel() // output.shape[-1]))

    return seen, engine._model.get_output_embeddings().register_forward_hook(hook)


def test_logit_positions_follow_the_budget() -> None:
    assert logit_positions(128 * 2**20, 49152) == 227  # SmolLM2, float32 logits: 12 bytes a value
    assert logit_positions(128 * 2**20, 49152, logit_bytes=2) == 273  # bfloat16 logits + float32 copies
    assert logit_positions(1, 49152) == 1  # never zero


@pytest.mark.model
def test_chunked_scores_equal_one_forward(tf_engine: Any, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny budget (a few positions a forward) and a large one (one forward) give the same log-probs,
    both equal to a direct one-forward log_softmax; short continuations batched beside a long one too."""
    conts = (LONG, " Paris", " a b c")
    big = _score(tf_engine, "The list:", conts)
    rows, handle = _lm_head_rows(tf_engine)
    try:
        monkeypatch.setattr(tf_engine, "config", tf_engine.config.model_copy(update={"score_logits_mb": 4}))
        small = _score(tf_engine, "The list:", conts)
    finally:
        handle.remove()
    step = logit_positions(4 * 2**20, tf_engine._vocab_size)
    assert step < 10 and rows and max(rows) <= step, (step, rows)  # the long one really went in chunks
    assert len(rows) > 280 // step
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype="float32").eval()
    for (lp_s, n_s, g_s), (lp_b, n_b, g_b), cont in zip(small, big, conts, strict=True):
        want_lp, want_n, want_g = direct_score(tok, ref, "The list:", cont)
        assert n_s == n_b == want_n and g_s == g_b == want_g
        assert abs(lp_s - lp_b) <= 1e-4 * max(1, n_s / 100), (cont[:20], lp_s, lp_b)
        assert abs(lp_s - want_lp) <= 1e-4 * max(1, n_s / 100), (cont[:20], lp_s, want_lp)
    assert small[0][1] > 250


_PEAK = textwrap.dedent("""
    import json, resource, sys, threading
    from lmdq.contract import Endpoint
    from lmdq.worker.engines.base import EngineRequest
    from lmdq.worker.engines.transformers_engine import TransformersEngine
    mb, n = int(sys.argv[1]), int(sys.argv[2])
    eng = TransformersEngine(model_path=sys.argv[3], served_model_name="m", score_logits_mb=mb, device="cpu")
    warm = EngineRequest(index=0, prompt="Hi", endpoint=Endpoint.score, continuations=(" there" * 64,))
    list(eng.stream([warm], threading.Event()))  # allocator and kernels warm, as a serving worker's are
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    req = EngineRequest(index=0, prompt="Count:", endpoint=Endpoint.score, continuations=(" one two" * n,))
    ev = [e for e in eng.stream([req], threading.Event()) if e.scores][0]
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth_mb": (after - before) / 1024, "tokens": ev.scores[0][1],
                      "kv_mb": ev.scores[0][1] * eng._model.config.num_hidden_layers * 2
                      * eng._model.config.num_key_value_heads * 64 * 4 / 2**20}))
""")


@pytest.mark.model
def test_peak_memory_of_a_long_score_stays_within_the_budget(model_dir: Path) -> None:
    """A 2,000-token continuation: its logits alone are 2000 x 49152 x 4 bytes = 375 MiB (and as much again
    for their log-softmax), which one forward held at once; with a 16 MiB budget the process grows by at
    most the budget, the KV cache of the sequence and a fixed allowance for activations, in a fresh process
    (ru_maxrss is a high-water mark)."""
    p = subprocess.run([sys.executable, "-c", _PEAK, "16", "1000", str(model_dir)], capture_output=True,
                       timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    got = json.loads(p.stdout.decode().splitlines()[-1])
    assert got["tokens"] == 2000
    unchunked_logits_mb = 2000 * 49152 * 4 * 2 / 2**20
    limit = 16 + got["kv_mb"] + 150  # budget + KV cache + activations of one chunk and allocator slack
    assert got["growth_mb"] < limit < unchunked_logits_mb / 2, got
    print(f"\nRSS growth for a 2000-token score: {got['growth_mb']:.0f} MiB (limit {limit:.0f})")


class _CountingHash:
    """sha256 that counts the bytes it hashes (the sim's scoring work)."""

    fed = 0

    def __init__(self, data: bytes = b"") -> None:
        self._h = hashlib.sha256()
        self.update(data)

    def update(self, data: bytes) -> None:
        _CountingHash.fed += len(data)
        self._h.update(data)

    def copy(self) -> _CountingHash:
        new = _CountingHash.__new__(_CountingHash)
        new._h = self._h.copy()
        return new

    def digest(self) -> bytes:
        return self._h.digest()


def test_sim_scores_hash_each_byte_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scoring a valid 100,000-character continuation hashes the prompt and each word once (it re-hashed
    every prefix: quadratic, 15 s), and the numbers are those of the prefix definition."""
    from lmdq.worker.engines import sim

    prompt = "Q: list words"
    small = ("alpha beta gamma delta",)
    before = sim._sim_score(EngineRequest(index=0, prompt=prompt, endpoint=Endpoint.score, continuations=small),
                            prompt, len, 64)
    words = small[0].split()
    want = [8 * sim._unit(prompt, *words[: k + 1]) for k in range(len(words))]
    assert before.scores == [(-round(sum(want), 6), 4, all(c < 1.0 for c in want))]

    monkeypatch.setattr(sim, "_HASH", _CountingHash)
    cont = " ".join(f"w{i % 997}" for i in range(25_000))[:100_000].rstrip()
    assert len(cont) == 100_000 or len(cont) > 99_000
    _CountingHash.fed = 0
    ev = sim._sim_score(EngineRequest(index=0, prompt=prompt, endpoint=Endpoint.score, continuations=(cont,)),
                        prompt, len, 64)
    assert ev.scores is not None and ev.scores[0][1] == len(cont.split())
    assert _CountingHash.fed <= len(prompt.encode()) + len(cont.encode()) + 1, _CountingHash.fed
