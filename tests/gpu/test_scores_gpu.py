"""Issue 24, GPU half of the scores: endpoint ``score`` through LMDeploy (PyTorch backend, every position's
logits of prompt + continuation, log_softmax in float32) against the transformers engine on the same weights
in float32 (exact for SmolLM2's bf16 weights), held to tests/gpu/score_bar.py: 1e-2 per token over all scored
tokens, and no pair over 5e-2 per token. Why not 1e-2 on every pair: no float16 engine meets that against
float32 (transformers float16 itself is 2.68e-2 off on its worst pair; the reasons and the numbers are in
score_bar's docstring). LMDeploy's PyTorch engine forced to
float32 (session 10) loaded and warmed up, and the test had not ended 5 minutes later: not offered. Every
pair's numbers against transformers float32 and float16 go to ``$OUT/scores_gpu.json``, and the same bar is
asserted for transformers float16 (so a bar float16 cannot meet would show here first).

Self-checking: every pair is compared (the bar's verdict and its numbers are asserted and written to
``$OUT/scores_gpu.json`` with every pair's numbers), the token counts must agree (both engines tokenize
prompt and continuation separately), ``is_greedy`` must be a bool from both and agree, and a ``reward``
request on SmolLM2 (not a reward model LMDeploy serves) must fail alone with ``unsupported_feature`` while
the score requests of the same call complete. A second check runs a multiple-choice batch through the real
worker loop on a real Redis and compares its picks with the transformers engine's.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmdq.contract import Endpoint
from lmdq.worker.engines.base import EngineEvent, EngineRequest
from tests.gpu.score_bar import COMPARISONS, verdict
from tests.helpers import final_events

PROMPTS: list[str | list[dict[str, str]]] = [
    "The capital of France is",
    "Question: What is 2 + 2?\nAnswer:",
    "Once upon a time, there was a",
    "The three primary colors are",
    "def add(a, b):\n    return",
    "import numpy as",
    "The quick brown fox",
    "In 1492, Columbus",
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name a fruit."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    [{"role": "user", "content": "Is water wet? Answer yes or no."}],
]
CONTINUATIONS = (" Paris", " a small village by the sea", " np", " 4", "The capital of France is Paris.")

MC = [
    ("The capital of France is", [" Paris", " Berlin", " Madrid", " Rome"]),
    ("Two plus two equals", [" four", " five", " seven", " ten"]),
    ("The opposite of hot is", [" cold", " warm", " blue", " fast"]),
    ("The sun rises in the", [" east", " west", " north", " south"]),
    ("A baby cat is called a", [" kitten", " puppy", " calf", " foal"]),
    ("Bees make", [" honey", " milk", " silk", " wool"]),
]
MC_BASE = 100  # the multiple-choice requests' indices in the reference call


def _mc_requests(base: int = 0) -> list[EngineRequest]:
    return [EngineRequest(index=base + i, prompt=q, endpoint=Endpoint.score, continuations=tuple(c))
            for i, (q, c) in enumerate(MC)]


def _requests() -> list[EngineRequest]:
    reqs = []
    for i, p in enumerate(PROMPTS):
        kw: dict[str, Any] = {"prompt": p} if isinstance(p, str) else {"messages": p}
        reqs.append(EngineRequest(index=i, endpoint=Endpoint.score, continuations=CONTINUATIONS, **kw))
    return reqs


@pytest.fixture(scope="module")
def reference(model_path: Path, gpu_dtype: str) -> dict[int, EngineEvent]:
    """The transformers engine's scores on the same GPU, same dtype (loaded, used, freed before LMDeploy)."""
    import torch

    from lmdq.worker.engines.transformers_engine import TransformersEngine

    finals: dict[int, EngineEvent] = {}
    for dtype, base in (("float32", 0), (gpu_dtype, 1000)):
        eng = TransformersEngine(model_path=model_path, served_model_name="smollm2", device="cuda", dtype=dtype)
        try:
            got = final_events(eng.stream([*_requests(), *_mc_requests(MC_BASE)], threading.Event()))
        finally:
            eng.close()
            torch.cuda.empty_cache()
        finals.update({base + i: ev for i, ev in got.items()})
    return finals


@pytest.fixture(scope="module")
def lmdeploy_engine(model_path: Path, gpu_dtype: str, gpu_mp_engine: bool) -> Iterator[Any]:
    from lmdq.worker.engines.lmdeploy_engine import LMDeployEngine

    eng = LMDeployEngine.load(model_path=str(model_path), served_model_name="smollm2", backend="pytorch",
                         dtype=gpu_dtype, session_len=1024, cache_max_entry_count=0.3, mp_engine=gpu_mp_engine)
    yield eng
    eng.close()


def test_lmdeploy_score_within_1e_2_per_token_of_transformers(reference: dict[int, EngineEvent],
                                                              lmdeploy_engine: Any, gpu_dtype: str) -> None:
    """Asserted: the suite's LMDeploy engine against transformers float32 within score_bar's bar, the same
    bar for transformers float16 (what float16 itself costs), and ``is_greedy`` equal to transformers'
    in the same dtype. Recorded beside it, per pair: LMDeploy against transformers float16."""
    reqs = _requests()
    reward = EngineRequest(index=len(reqs), endpoint=Endpoint.reward,
                           messages=[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}])
    got = final_events(lmdeploy_engine.stream([*reqs, reward], threading.Event()))
    assert got[reward.index].finish_reason == "error" and got[reward.index].error_code == "unsupported_feature"
    rows: list[dict[str, Any]] = []
    for r in reqs:
        ld, tf, tf16 = got[r.index], reference[r.index], reference[1000 + r.index]
        assert ld.finish_reason == "stop" and ld.scores is not None, (ld.error_code, ld.error_message)
        assert tf.finish_reason == "stop" and tf.scores is not None, (tf.error_code, tf.error_message)
        assert tf16.scores is not None
        assert ld.input_token_len == tf.input_token_len, "both engines must tokenize the prompt alike"
        for cont, (lp16, n, g), (tlp, tn, tg), (hlp, _, hg) in zip(CONTINUATIONS, ld.scores, tf.scores, tf16.scores,
                                                                   strict=True):
            assert n == tn, f"token counts differ for {cont!r}: lmdeploy {n}, transformers {tn}"
            assert isinstance(g, bool) and isinstance(tg, bool)
            rows.append({"prompt": r.prompt if r.prompt is not None else r.messages, "continuation": cont,
                         "tokens": n, "lmdeploy_fp16": lp16, "transformers_fp32": tlp,
                         "transformers_fp16": hlp,
                         "is_greedy": {"lmdeploy": g, "transformers_fp16": hg, "transformers_fp32": tg}})
            rows[-1]["per_token_diff"] = {k: abs(rows[-1][a] - rows[-1][b]) / n for k, (a, b) in COMPARISONS.items()}
    summary, problems = verdict(rows, gpu_dtype)
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "scores_gpu.json").write_text(json.dumps({**summary, "rows": rows}, indent=1))
    print(f"\nscore lmdeploy vs transformers: {json.dumps(summary)}")
    assert len(rows) == len(PROMPTS) * len(CONTINUATIONS)
    assert not problems, problems


def test_multiple_choice_through_the_worker_on_lmdeploy(reference: dict[int, EngineEvent], lmdeploy_engine: Any,
                                                        tmp_path: Path) -> None:
    """submit -> the worker loop on LMDeploy (a real redis-server) -> results: each question's pick (the
    argmax of its 4 summed logprobs) equals the transformers engine's, and is_greedy is a bool throughout."""
    import redis

    from lmdq.redis.keys import Keys
    from lmdq.results.store import ResultStore
    from lmdq.submission.submit import SubmitOptions, submit_file
    from lmdq.worker.engines.base import Borrowed
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings
    from tests.conftest import RedisServer

    server = RedisServer().start()
    try:
        client = redis.Redis.from_url(server.url)
        f = tmp_path / "mc.jsonl"
        f.write_text("".join(json.dumps({"custom_id": f"q{i}", "prompt": q, "endpoint": "score",
                                         "continuations": c}) + "\n" for i, (q, c) in enumerate(MC)))
        keys = Keys("gpuscore")
        batch, _ = submit_file(f, SubmitOptions(model=lmdeploy_engine.model_name, allow_unknown_model=True),
                               client=client, keys=keys, ttl_s=3600)
        s = WorkerSettings(redis_url=server.url, key_prefix="gpuscore", burst=True, health_port=0)
        Worker(engine=Borrowed(lmdeploy_engine), client=client, settings=s).run()
        from lmdq.contract import Result, ResultStatus

        results = [Result.model_validate_json(raw) for _, raw in  # type: ignore[arg-type]
                   ResultStore(client, keys=keys).iter_results(batch.id, len(MC), partial=False)]
    finally:
        server.stop()
        server.cleanup()
    picks, want = [], []
    for i, r in enumerate(results):
        assert r.status is ResultStatus.completed and r.scores is not None and len(r.scores) == 4
        assert all(isinstance(x.is_greedy, bool) for x in r.scores)
        got = [x.logprob for x in r.scores]
        ref = [lp for lp, _, _ in reference[MC_BASE + i].scores or []]
        picks.append(got.index(max(got)))
        want.append(ref.index(max(ref)))
    assert picks == want, (picks, want)
