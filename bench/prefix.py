"""Prefix-sharing throughput: a shuffled document-QA workload, raw ``pipe(prompts)`` vs lmdq.

The workload (:func:`make_workload`): D documents of about T tokens of random words, Q questions
about each, one request per question (document first, question after: the document is the shared
prefix), shuffled, written as a JSONL that ``lmdq-producer submit`` takes as is. Both paths run on
ONE engine built as the worker builds it, with prefix caching on and a KV cache that holds about
``cache_docs`` documents (default 10 % of them):

* raw: every prompt in one ``pipe(prompts)`` call, in file order (LMDeploy schedules in arrival
  order: a document's questions are far apart, its blocks are evicted in between);
* lmdq: the file through the real submit (prefix groups on: a document's questions in one job)
  and one worker.

lmdq runs FIRST, after a short warm-up on other prompts: what the raw run then finds in the cache
from the lmdq run (at most ``cache_docs`` documents) only helps the raw side.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmdq.worker.engines.base import Engine
from lmdq_bench.efficiency import EfficiencyConfig, make_prompts, run_lmdq, run_raw

__all__ = ["PrefixConfig", "kv_blocks", "make_workload", "run_prefix"]

#: block size of LMDeploy's PyTorch engine KV cache (PytorchEngineConfig.block_size) and TurboMind's
#: cache_block_seq_len, both 64 in lmdeploy 0.18
KV_BLOCK_TOKENS = 64
#: what a request adds to its document: the question and the answer, in tokens (generous)
_QUESTION_TOKENS = 32

_VOCAB = ("time year people way day man thing woman life child world school state family student group country "
          "problem hand part place case week company system program question work government number night point "
          "home water room mother area money story fact month lot right study book eye job word business issue "
          "side kind head house service friend father power hour game line end member law car city community "
          "name president team minute idea kid body information back parent face others level office door health "
          "person art war history party result change morning reason research girl guy moment air teacher force "
          "education river mountain garden window letter engine market picture report season song table voice")
_WORDS = _VOCAB.split()


@dataclass
class PrefixConfig:
    docs: int = 200
    doc_tokens: int = 2000
    questions: int = 8
    output_len: int = 64
    batch_size: int = 32
    #: documents the KV cache holds at once (None: 10 % of ``docs``)
    cache_docs: float | None = None
    jobs_in_flight: int = 0
    seed: int = 0

    @property
    def n(self) -> int:
        return self.docs * self.questions

    @property
    def cached_docs(self) -> float:
        return self.cache_docs if self.cache_docs is not None else max(1.0, self.docs / 10)


def kv_blocks(cfg: PrefixConfig) -> int:
    """KV blocks for ``cached_docs`` documents with their questions and answers."""
    per_doc = cfg.doc_tokens + _QUESTION_TOKENS + cfg.output_len
    return max(1, math.ceil(cfg.cached_docs * per_doc / KV_BLOCK_TOKENS))


def make_workload(engine: Engine, cfg: PrefixConfig, path: Path) -> list[str]:
    """Write the shuffled document-QA JSONL to ``path``; returns its prompts in file order. Documents
    are sized with the engine's own tokenizer (the sim counts words)."""
    rnd = random.Random(cfg.seed)
    probe = " ".join(rnd.choice(_WORDS) for _ in range(400))
    per_word = engine.count_tokens(probe) / 400
    n_words = max(1, round(cfg.doc_tokens / per_word))
    rows = []
    for d in range(cfg.docs):
        doc = " ".join(rnd.choice(_WORDS) for _ in range(n_words))
        for q in range(cfg.questions):
            question = " ".join(rnd.choice(_WORDS) for _ in range(8))
            prompt = (f"Read the document, then answer the question.\n\nDocument {d}:\n{doc}\n\n"
                      f"Question {q}: which {question}?\nAnswer:")
            rows.append({"custom_id": f"doc{d}-q{q}", "prompt": prompt, "endpoint": "completion",
                         "params": {"max_new_tokens": cfg.output_len, "ignore_eos": True}})
    rnd.shuffle(rows)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return [str(r["prompt"]) for r in rows]


def _prefill_counts(engine: Engine) -> dict[str, int] | None:
    stats = getattr(engine, "stats", None)
    return dict(stats()) if callable(stats) else None


def run_prefix(engine: Engine, cfg: PrefixConfig, *, workload: Path, redis_url: str, log: Any = print
               ) -> dict[str, Any]:
    prompts = make_workload(engine, cfg, workload)
    log(f"workload: {cfg.docs} documents x {cfg.questions} questions = {cfg.n} requests, shuffled, in {workload}")
    eff = EfficiencyConfig(n=cfg.n, batch_size=cfg.batch_size, output_len=cfg.output_len,
                           jobs_in_flight=cfg.jobs_in_flight, naive=False)
    warm = make_prompts(engine, min(32, cfg.n), 64, seed=cfg.seed + 1)
    run_raw(engine, warm, EfficiencyConfig(n=len(warm), output_len=8))  # CUDA graphs, allocator: not timed
    out: dict[str, Any] = {}
    before = _prefill_counts(engine)
    secs, toks = run_lmdq(engine, prompts, eff, redis_url=redis_url, jobs_in_flight=cfg.jobs_in_flight,
                          prefix="benchprefix", input_file=workload)
    after = _prefill_counts(engine)
    out["lmdq"] = {"s": round(secs, 3), "tokens": toks, "tok_s": round(toks / secs, 1)}
    if before is not None and after is not None:
        out["lmdq"]["prefilled_tokens"] = after["prefilled_tokens"] - before["prefilled_tokens"]
    log(f"lmdq: {toks:,} tokens in {secs:.2f} s = {toks / secs:,.0f} tok/s")
    secs, toks = run_raw(engine, prompts, eff)
    final = _prefill_counts(engine)
    out["raw"] = {"s": round(secs, 3), "tokens": toks, "tok_s": round(toks / secs, 1)}
    if after is not None and final is not None:
        out["raw"]["prefilled_tokens"] = final["prefilled_tokens"] - after["prefilled_tokens"]
    log(f"raw:  {toks:,} tokens in {secs:.2f} s = {toks / secs:,.0f} tok/s")
    return {"raw_tok_s": out["raw"]["tok_s"], "lmdq_tok_s": out["lmdq"]["tok_s"],
            "ratio": round(out["lmdq"]["tok_s"] / out["raw"]["tok_s"], 4), "runs": out}
