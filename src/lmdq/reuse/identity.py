"""A request's identity: the hash of everything that determines its output.

Two halves, hashed apart so each side computes only what it knows:

* the **worker key** (:func:`worker_key`): the engine's name, its whole configuration (dtype,
  quantization, session length, chat template, batch sizes: every setting, because "output-affecting"
  is engine-specific and a setting left out would let two differently configured engines share answers),
  the served weights' content fingerprint (:mod:`lmdq.reuse.fingerprint`) and the adapter's. A model
  name is never part of it: a checkpoint swapped under the same name gets a new key;
* the **request key** (:func:`request_key`): endpoint, prompt or messages (the chat template that renders
  them is in the worker key), score continuations, and the generation parameters as the engine resolves
  them (the batch's params layered under the request's, engine defaults filled in, the seed included).

Only deterministic requests qualify (:func:`qualifies`): greedy, or sampling with an explicit seed on an
engine that repeats a seeded draw (``Engine.repeats_seeds``: sim and transformers yes, LMDeploy no:
its sampling kernels are not checked to repeat across batch compositions). Requests that write tensors to
a blob store never qualify: their result points at the first batch's blobs.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from lmdq.contract import GenerationParams, Request

__all__ = ["IDENTITY_BYTES", "identity", "inline_inputs", "params_key", "qualifies", "request_key", "worker_key"]

IDENTITY_BYTES = 16
"""Bytes of an identity (blake2b): 128 bits, so two different requests never share one by chance."""


_NOT_INPUT = {"index", "custom_id", "params"}
"""Request fields that are not its input: its place and name, and its params (hashed as the engine runs
them, :func:`effective_params`)."""


def _canon(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def worker_key(*, engine: str, config: dict[str, Any], weights: str, adapter: str | None = None) -> bytes:
    """The worker's half of every identity it computes (see the module doc)."""
    return hashlib.blake2b(_canon({"engine": engine, "config": config, "weights": weights, "adapter": adapter}),
                           digest_size=IDENTITY_BYTES).digest()


def effective_params(batch_params: GenerationParams, req: Request) -> dict[str, Any]:
    """The parameters the engine runs ``req`` with: the batch's, the request's over them, defaults filled."""
    return batch_params.merged(req.params).resolved()


def qualifies(params: dict[str, Any], *, repeats_seeds: bool) -> bool:
    """Whether a request with these effective ``params`` gives the same output every time it runs."""
    if params.get("output_logits") or params.get("output_last_hidden_state"):
        return False
    if not params.get("do_sample"):
        return True
    return repeats_seeds and params.get("random_seed") is not None


def inline_inputs(req: Request) -> bool:
    """Whether everything the request's answer reads is in the request itself: an image part naming a file
    or a URL (issue 48) is read when the job runs, and the same name may hold another picture tomorrow, so
    only ``data:`` images (their bytes inline) qualify."""
    return all(url.startswith("data:") for m in req.messages or () for url in m.image_urls())


def params_key(params: dict[str, Any]) -> bytes:
    """Effective ``params`` in canonical form: computed once for the many requests that share them."""
    rf = params.get("response_format")
    return _canon({**params, "response_format": rf.model_dump(mode="json", exclude_none=True) if rf is not None
                   else None})


def request_key(params: dict[str, Any] | bytes, req: Request) -> bytes:
    """The request's half: its input and effective ``params`` (or their :func:`params_key`); never its
    custom_id, index or metadata."""
    # every field of the request but its place and name: a field added to Request later is part of the
    # identity without anyone remembering to add it here (leaving one out would share answers across inputs)
    body = req.model_dump(mode="json", exclude=_NOT_INPUT, exclude_none=True)
    body.setdefault("endpoint", req.endpoint.value)
    p = params if isinstance(params, bytes) else params_key(params)
    return _canon(body) + b"\x00" + p


def identity(worker: bytes, request: bytes) -> bytes:
    """The identity of one request on one worker key."""
    return hashlib.blake2b(worker + b"\x00" + request, digest_size=IDENTITY_BYTES).digest()
