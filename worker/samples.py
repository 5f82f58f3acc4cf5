"""``params.n``: n samples of one prompt, fanned out to the engine and gathered into ONE result.

Why here, in the worker, and not in each engine: LMDeploy's ``GenerationConfig.n`` is not supported
("Only 1 is supported now"; lmdeploy #1893, #4073), so every engine sees n plain requests that share a
prompt, sent in the SAME ``stream`` call, side by side. Each engine shares their prefill its own way: the
transformers engine prefills identical prompts of a padded batch once and fans the KV cache out to the n
rows; LMDeploy's prefix cache (``--enable-prefix-caching``) serves the later samples' prompt blocks from
the first one's. Engines report what they really prefilled (``EngineEvent.prefill_token_len``).

The rules, decided once here:

* seeds: with ``random_seed = s``, sample ``i`` runs with seed ``s + i`` (mod 2**63), so sample 0 is what
  the same request with n = 1 would draw and a re-run gives the same n samples. Without a seed every
  sample gets its own random seed.
* greedy (``do_sample`` false, or temperature 0) with n > 1: like vLLM, n identical samples. They are
  identical by definition, so the engine decodes ONE and the result holds n copies (1/n of the work).
* exactly once: a request's result is written when all n samples have their final event, with all of
  them; a job stopped midway (SIGKILL, drain, lost lease) leaves that request without a result and it
  runs again, whole, with the same seeds. There is never a result with some of the samples.
* status: ``failed`` when a sample failed (the first failure's error), else ``cancelled`` when a sample
  was aborted by a cancel, else ``completed``. Usage: the prompt counts once (``input_token_len``),
  ``generate_token_len`` is the sum over the samples (what the result holds, copies included).
* tensors (``output_logits`` / ``output_last_hidden_state``) are per request in the blob store: n > 1
  with them is refused per request (``unsupported_feature``), never half-stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmdq.contract import (
    ErrorInfo,
    FinishReason,
    GenerationParams,
    JobPayload,
    Request,
    ResultStatus,
    Sample,
    TokenLogprob,
)
from lmdq.worker.engines.base import EngineEvent, EngineRequest

__all__ = ["SEED_MODULUS", "SampleSet", "engine_rows", "fan_out", "sample_seed"]

SEED_MODULUS = 2**63
"""Seeds live in [0, 2**63) (GenerationParams.random_seed's bounds): seed + i wraps inside it."""


def sample_seed(seed: int | None, i: int) -> int | None:
    """Sample ``i``'s seed: ``seed + i`` (wrapping), or None (random) when the request has no seed."""
    return None if seed is None else (seed + i) % SEED_MODULUS


def _greedy(p: dict[str, object]) -> bool:
    """The engines' own rule (transformers ``_sampling``, LMDeploy's do_sample=False): argmax decoding."""
    return not p["do_sample"] or p["temperature"] == 0.0


@dataclass
class _SampleLive:
    """One sample's state while it streams."""

    text: list[str] = field(default_factory=list)
    gen_len: int = 0
    final: Sample | None = None


@dataclass
class SampleSet:
    """The samples of one request with n > 1, gathered until every one of them has ended."""

    n: int
    #: samples the engine runs (1 for greedy: the result holds n copies of it)
    runs: int
    live: list[_SampleLive] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.live = [_SampleLive() for _ in range(self.runs)]

    def delta(self, sample: int, ev: EngineEvent) -> None:
        s = self.live[sample]
        if ev.text:
            s.text.append(ev.text)
        s.gen_len = ev.generate_token_len

    @property
    def generated(self) -> int:
        """Tokens generated so far over the samples the engine runs (progress, throughput)."""
        return sum(s.gen_len for s in self.live)

    def end(self, sample: int, ev: EngineEvent, reason: FinishReason, status: ResultStatus,
            error: ErrorInfo | None, logprobs: list[TokenLogprob] | None) -> bool:
        """Record sample ``sample``'s final event; True once every sample has ended."""
        s = self.live[sample]
        s.final = Sample(index=sample, text="".join(s.text), finish_reason=reason,
                         generate_token_len=ev.generate_token_len, logprobs=logprobs,
                         prefill_token_len=ev.prefill_token_len,
                         error=error if status is ResultStatus.failed else None)
        return all(x.final is not None for x in self.live)

    def samples(self) -> list[Sample]:
        """All n samples (greedy: n copies of the one run, each with its own index; copies prefilled nothing)."""
        done = [x.final for x in self.live if x.final is not None]
        if self.runs == self.n:
            return done
        return [done[0].model_copy(update={"index": i, "prefill_token_len": done[0].prefill_token_len if i == 0
                                           else 0 if done[0].prefill_token_len is not None else None})
                for i in range(self.n)]

    def outcome(self, samples: list[Sample]) -> tuple[ResultStatus, ErrorInfo | None]:
        """The request's status from its samples' ends (module docstring)."""
        for s in samples:
            if s.error is not None:
                return ResultStatus.failed, s.error
        if any(s.finish_reason is FinishReason.abort for s in samples):
            return ResultStatus.cancelled, None
        return ResultStatus.completed, None


def engine_rows(payload: JobPayload) -> int:
    """How many sequences a job puts in the engine (n per request; 1 for greedy n > 1): what the worker's
    admission counts against the engine's capacity."""
    rows = 0
    for r in payload.requests:
        p = payload.params.merged(r.params).resolved() if r.params is not None else payload.params.resolved()
        n = int(p["n"] or 1)
        rows += 1 if n == 1 or _greedy(p) else n
    return rows


def fan_out(todo: list[Request], base: GenerationParams, messages_of: dict[int, list[dict[str, Any]]] | None = None,
            ) -> tuple[list[EngineRequest], list[tuple[int, int]], dict[int, SampleSet], dict[int, str]]:
    """The engine requests of a job's ``todo`` requests, in order, the n samples of a request side by side.
    ``messages_of``: the messages the engine gets instead of a position's own (its images read: worker/images.py).

    Returns (engine requests, ``slots`` = engine index → (position in ``todo``, sample number), the
    SampleSet of each position whose request has n > 1, and the refusal message of each position that
    cannot run (n > 1 with tensor outputs))."""
    ereqs: list[EngineRequest] = []
    slots: list[tuple[int, int]] = []
    sets: dict[int, SampleSet] = {}
    refused: dict[int, str] = {}
    for pos, r in enumerate(todo):
        params = base.merged(r.params)
        n = params.n or 1
        if messages_of is not None and pos in messages_of:
            messages: list[dict[str, Any]] | None = messages_of[pos]
        else:
            messages = [m.model_dump(exclude_none=True) for m in r.messages] if r.messages else None
        if n == 1 or not r.endpoint.generates:  # score / reward sample nothing: one engine request, never n
            ereqs.append(EngineRequest(index=len(ereqs), prompt=r.prompt, messages=messages,
                                       endpoint=r.endpoint, params=params,
                                       continuations=tuple(r.continuations) if r.continuations is not None else None))
            slots.append((pos, 0))
            continue
        p = params.resolved()
        if p["output_logits"] or p["output_last_hidden_state"]:
            refused[pos] = ("n > 1 with output_logits/output_last_hidden_state is not supported (tensors are stored "
                            "per request); ask for logprobs, or n = 1")
            continue
        runs = 1 if _greedy(p) else n
        sets[pos] = SampleSet(n=n, runs=runs)
        for i in range(runs):
            sub = params.model_copy(update={"n": None, "random_seed": sample_seed(params.random_seed, i)})
            ereqs.append(EngineRequest(index=len(ereqs), prompt=r.prompt, messages=messages,
                                       endpoint=r.endpoint, params=sub))
            slots.append((pos, i))
    return ereqs, slots, sets, refused
