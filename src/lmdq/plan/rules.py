"""A batch's plan before it runs: tokens in and out, GPU-seconds, ETA and cost, each with what it rests on.

* input tokens: every request rendered and counted with the model's tokenizer (:mod:`lmdq.plan.tokens`);
* expected output tokens: per request ``E[min(L, max_new_tokens)]`` over the lengths this model's earlier
  requests generated (:mod:`lmdq.plan.store`); a request that was cut at its own max_new_tokens had not
  stopped, so it counts as running to each new request's max_new_tokens. No history: every request at its
  max_new_tokens, an upper bound;
* shared-prefix savings: prompt blocks a block-granular prefix cache would find computed (a group's
  requests run back to back in one job: :mod:`lmdq.submission.prefix_groups`); counted off the prefill
  only where the history shows the workers cache prefixes (they prefilled fewer tokens than they were given);
* GPU-seconds: ``prefill × a + decode × b``, ``a`` and ``b`` the seconds a token costs a worker's engine,
  fitted by least squares to the workers' recording windows (each: busy seconds, prefill and decode
  tokens). Windows that all have about the same prompt/output ratio cannot tell the two apart: then one
  rate per output token covers both (exact for a batch shaped like the history, and the plan says so);
* ETA: GPU-seconds shared by the model's live workers, if they start on it now; cost: GPU-hours × price.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from lmdq.contract import Endpoint, GenerationParams
from lmdq.plan.store import History, WorkerRate
from lmdq.plan.tokens import TokenCounter, block_keys
from lmdq.settings import DEFAULT_RESULT_TTL_S

__all__ = ["PREFIX_BLOCK", "RATE_MAX_AGE_S", "Plan", "PlanLine", "Rates", "expected_output", "fit_rates",
           "make_plan"]

PREFIX_BLOCK = 64
"""Tokens per prefix-cache block the savings are counted in (LMDeploy's default block size)."""

RATE_MAX_AGE_S = DEFAULT_RESULT_TTL_S
"""Rate records older than this (as long as a batch's results are kept) are not used while fresher ones exist."""

_SEPARABLE = 0.05
"""Least squares needs windows of different prompt/output ratios: 1 - correlation² of (prefill, decode)
over the windows at least this much, else one rate covers both."""


class PlanLine(Protocol):
    """What a plan reads of a request (:class:`lmdq.submission.formats.ParsedLine` is one)."""

    @property
    def prompt(self) -> str | None: ...
    @property
    def messages(self) -> list[dict[str, Any]] | None: ...
    @property
    def endpoint(self) -> Endpoint: ...
    @property
    def params(self) -> GenerationParams | None: ...
    @property
    def continuations(self) -> tuple[str, ...] | None: ...


@dataclass
class Rates:
    """Seconds a prefill and a decode token cost one worker's engine; None: nothing measured."""

    s_per_prefill: float | None
    s_per_decode: float | None
    basis: str
    workers: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Plan:
    """What a batch will take (see the module doc); every ``*_basis`` says what its figure rests on."""

    model: str
    requests: int
    input_tokens: int
    input_exact: bool
    input_basis: str
    output_tokens: int
    max_output_tokens: int
    output_basis: str
    prefix_saved_tokens: int
    prefix_basis: str
    prefill_tokens: int
    prefill_tok_s: float | None
    decode_tok_s: float | None
    rate_basis: str
    gpu_seconds: float | None
    live_workers: int
    eta_s: float | None
    eta_basis: str
    gpu_hour_price: float | None
    cost: float | None
    cost_basis: str
    workers: list[dict[str, Any]] = field(default_factory=list)
    #: issue 47, with ``reuse``: requests the reuse index answers now (None: reuse off or no worker key yet)
    reused_requests: int | None = None
    reuse_basis: str = "reuse off (submit --reuse)"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        """The plan as a person reads it: one figure a line, what it rests on beside it."""
        def secs(s: float | None) -> str:
            if s is None:
                return "unknown"
            return f"{s:,.1f} s" if s < 120 else f"{s / 60:,.1f} min" if s < 7200 else f"{s / 3600:,.2f} h"

        rate = ("unknown" if self.decode_tok_s is None else
                f"prefill {self.prefill_tok_s:,.0f} tok/s, decode {self.decode_tok_s:,.0f} tok/s a worker"
                if self.prefill_tok_s is not None else f"{self.decode_tok_s:,.0f} output tok/s a worker")
        return [
            f"plan for model {self.model}: {self.requests:,} requests",
            f"  input tokens     {self.input_tokens:,}  ({self.input_basis})",
            f"  output tokens    {self.output_tokens:,} expected, at most {self.max_output_tokens:,}  "
            f"({self.output_basis})",
            f"  shared prefixes  {self.prefix_saved_tokens:,} prompt tokens computed once  ({self.prefix_basis})",
            f"  prefill tokens   {self.prefill_tokens:,}",
            f"  throughput       {rate}  ({self.rate_basis})",
            f"  GPU-seconds      {'unknown' if self.gpu_seconds is None else f'{self.gpu_seconds:,.1f}'}",
            f"  ETA              {secs(self.eta_s)}  ({self.eta_basis})",
            f"  cost             {_money(self.cost)}  ({self.cost_basis})",
            f"  reused           {'-' if self.reused_requests is None else f'{self.reused_requests:,}'}  "
            f"({self.reuse_basis})",
        ]


def _money(v: float | None) -> str:
    return "unknown" if v is None else f"{v:,.2f}" if v >= 1 else f"{v:.4f}"


def expected_output(history: History, max_new: int) -> float:
    """``E[min(L, max_new)]`` over the history's lengths (``max_new`` when there is none); a request that
    was cut at its own max_new_tokens counts as reaching this ``max_new`` too (it had not stopped)."""
    n = history.requests
    if n == 0:
        return float(max_new)
    total = sum(c * min(length, max_new) for length, c in history.stopped.items())
    total += sum(history.cut.values()) * max_new  # it was still going at its cap: it runs to this one too
    return total / n


def _fresh(history: History) -> tuple[list[WorkerRate], str]:
    recs = [r for r in history.rates if r.busy_s > 0 and r.decode > 0]
    fresh = [r for r in recs if history.now - r.at <= RATE_MAX_AGE_S]
    if fresh:
        return fresh, ""
    if recs:
        age = (history.now - max(r.at for r in recs)) / 86400
        return recs, f"; measured {age:.0f} days ago"
    return [], ""


def fit_rates(history: History) -> Rates:
    """The per-token costs from the workers' windows (see the module doc)."""
    recs, stale = _fresh(history)
    if not recs:
        return Rates(None, None, f"no worker has measured throughput for {history.model} yet: GPU-seconds, ETA "
                                 "and cost unknown (run a small batch of this model first)")
    workers = [{"worker": r.worker, "busy_s": round(r.busy_s, 3), "prefill_tokens": r.prefill,
                "decode_tokens": r.decode, "prefill_tok_s_busy": round(r.prefill / r.busy_s, 1),
                "decode_tok_s_busy": round(r.decode / r.busy_s, 1)} for r in recs]
    windows = [w for r in recs for w in r.windows if w[0] > 0]
    spp = sum(p * p for _, p, _ in windows)
    sdd = sum(d * d for _, _, d in windows)
    spd = sum(p * d for _, p, d in windows)
    stp = sum(t * p for t, p, _ in windows)
    std = sum(t * d for t, _, d in windows)
    det = spp * sdd - spd * spd
    busy = sum(r.busy_s for r in recs)
    where = f"{len(recs)} worker(s), {busy:,.1f} busy s, {len(windows)} windows{stale}"
    if len(windows) >= 2 and spp > 0 and sdd > 0 and det / (spp * sdd) >= _SEPARABLE:
        a = (stp * sdd - std * spd) / det
        b = (std * spp - stp * spd) / det
        if a > 0 and b > 0:
            return Rates(a, b, f"fitted to {where}", workers)
    decode = sum(r.decode for r in recs)
    return Rates(None, busy / decode, f"measured over {where}; prefill and decode not separable in this history "
                                      "(its windows had one prompt/output ratio): one rate per output token covers "
                                      "both, exact for a batch shaped like the history", workers)


def make_plan(items: Iterable[PlanLine], *, model: str, params: GenerationParams, counter: TokenCounter,
              history: History, live_workers: int, gpu_hour_price: float | None = None,
              prefix_groups: bool, prefix_block: int = PREFIX_BLOCK) -> Plan:
    """The plan of the requests ``items`` (one model's), batch defaults ``params`` under each line's own."""
    requests = input_tokens = 0
    by_max: Counter[int] = Counter()  # output tokens wanted (max_new_tokens × n) -> requests
    blocks_total = 0
    seen: set[bytes] = set()
    for item in items:
        requests += 1
        chat = item.endpoint is Endpoint.chat
        ids = counter.ids(item.prompt, item.messages, chat=chat)
        n_in = len(ids) if ids is not None else counter.count(item.prompt, item.messages, chat=chat)
        if item.continuations:
            n_in += sum(counter.count(c, None, chat=False) for c in item.continuations)
        input_tokens += n_in
        if ids is not None and prefix_groups:
            keys = block_keys(ids, prefix_block)
            blocks_total += len(keys)
            seen.update(keys)
        if item.endpoint.generates:
            p = params.merged(item.params) if item.params is not None else params
            r = p.resolved()
            by_max[int(r["max_new_tokens"]) * int(r.get("n") or 1)] += 1
    max_out = sum(m * c for m, c in by_max.items())
    out = round(sum(expected_output(history, m) * c for m, c in by_max.items()))
    if history.requests:
        cut = sum(history.cut.values())
        also = (f", {cut:,} of them cut at their max_new_tokens (counted as running to each request's "
                "max_new_tokens)") if cut else ""
        output_basis = f"length history of {history.requests:,} earlier requests of {model}{also}"
    else:
        output_basis = (f"no history for this model: every request counted at its max_new_tokens "
                        f"(an upper bound; {model}'s workers record lengths as its batches finish)")
    saved = (blocks_total - len(seen)) * prefix_block
    if counter.encode is None:
        prefix_basis = "not counted: needs the model's tokenizer"
    elif not prefix_groups:
        prefix_basis = "prefix groups off (--no-prefix-groups): not counted"
        saved = 0
    else:
        prefix_basis = (f"blocks of {prefix_block} tokens shared with an earlier request, if the workers cache "
                        "prefixes; not taken off the prefill below")
    prefill = input_tokens
    rates = fit_rates(history)
    gpu_s: float | None = None
    if rates.s_per_decode is not None:
        gpu_s = out * rates.s_per_decode + (prefill * rates.s_per_prefill if rates.s_per_prefill is not None else 0.0)
    eta = None if gpu_s is None or live_workers <= 0 else gpu_s / live_workers
    if gpu_s is None:
        eta_basis = "no measured throughput"
    elif live_workers <= 0:
        eta_basis = f"no live worker serves {model}: starts when one does"
    else:
        eta_basis = f"{live_workers} live worker(s) of {model}, if they start on it now (work queued ahead not counted)"
    if gpu_hour_price is None:
        cost, cost_basis = None, "pass --gpu-hour-price for a cost"
    elif gpu_s is None:
        cost, cost_basis = None, "GPU-seconds unknown"
    else:
        cost, cost_basis = gpu_s / 3600 * gpu_hour_price, f"{gpu_s / 3600:,.3f} GPU-hours at {gpu_hour_price:g} an hour"
    return Plan(
        model=model, requests=requests, input_tokens=input_tokens, input_exact=counter.exact,
        input_basis=counter.basis, output_tokens=out, max_output_tokens=max_out, output_basis=output_basis,
        prefix_saved_tokens=saved, prefix_basis=prefix_basis, prefill_tokens=prefill,
        prefill_tok_s=None if rates.s_per_prefill is None else 1 / rates.s_per_prefill,
        decode_tok_s=None if rates.s_per_decode is None else 1 / rates.s_per_decode,
        rate_basis=rates.basis, gpu_seconds=gpu_s, live_workers=live_workers, eta_s=eta, eta_basis=eta_basis,
        gpu_hour_price=gpu_hour_price, cost=cost, cost_basis=cost_basis, workers=rates.workers,
    )
