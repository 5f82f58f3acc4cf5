"""The job/result contract: the ONE module producer and worker both import.

Everything that crosses Redis is one of these pydantic models serialised as JSON, so the
producer (no torch, no lmdeploy) and the worker agree on the wire format by construction.
Bump ``FORMAT_VERSION`` on any incompatible change; readers reject versions they don't know.
"""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Sequence
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo

__all__ = [
    "BATCH_ID_PATTERN",
    "FORMAT_VERSION",
    "MAX_JOB_REQUESTS",
    "JOB_FUNCTION",
    "BatchStatus",
    "Batch",
    "ChatMessage",
    "ContinuationScore",
    "MAX_CONTINUATIONS",
    "MAX_CONTINUATION_CHARS",
    "ResponseFormat",
    "TensorRef",
    "TokenLogprob",
    "Endpoint",
    "ErrorCode",
    "decode_embedding",
    "encode_embedding",
    "ErrorInfo",
    "FinishReason",
    "GenerationParams",
    "JobPayload",
    "Priority",
    "Request",
    "RequestCounts",
    "MAX_SAMPLES",
    "MAX_REUSE_TTL_S",
    "Result",
    "ResultStatus",
    "ReusedFrom",
    "Sample",
    "Timings",
]

FORMAT_VERSION: Literal[1] = 1
"""Wire format version carried by every job payload, batch and result."""

JOB_FUNCTION = "lmdq.jobs.queue.generate"
"""The only RQ function name a worker runs; anything else on a queue is refused, never imported."""

BATCH_ID_PATTERN = r"^batch_[0-9a-f]{24}$"
"""What every batch id lmdq makes looks like (``new_batch_id`` in the producer). A worker builds file
names and Redis keys from a job's batch id, so a job carrying anything else (``../../x``, a slash, a
NUL, 10 kB of text) is refused instead of being trusted."""

MAX_JOB_REQUESTS = 100_000
"""Most requests one job can carry: the producer's largest ``--batch-size``."""


MAX_SAMPLES = 128
"""Most samples (``params.n``) one request may ask for (OpenAI's ``n`` allows 128 as well)."""


class _Strict(BaseModel):
    # defer_build: a model's validator is built at its first use, not at import: `lmdq-producer --help` reads
    # GenerationParams' fields for its flags and validates nothing, `status` builds Batch only (issue 49)
    model_config = ConfigDict(extra="forbid", frozen=False, defer_build=True)


class _Value(str, Enum):
    """A str enum that prints as its value: ``print(r.finish_reason)`` shows ``stop``, as LMDeploy and the
    OpenAI SDK show it, not ``FinishReason.stop`` (issue 45). Formatting already gave the value."""

    def __str__(self) -> str:
        return str(self.value)


class Priority(_Value):
    """Queue priority; workers drain high before normal before low."""

    high = "high"
    normal = "normal"
    low = "low"


class Endpoint(_Value):
    """How a prompt is fed to the model: chat goes through the chat template, completion is raw.

    ``score`` and ``reward`` generate nothing (docs/outputs.md, "Scores"): ``score`` gives the
    log-likelihood of each of the request's ``continuations`` after its prompt (lm-eval-harness'
    ``loglikelihood``; a ``prompt`` is raw text, ``messages`` go through the chat template with the
    generation prompt), ``reward`` a reward model's score of a chat (``messages``, LMDeploy's
    ``get_reward_score``). ``embedding`` generates nothing either: the result holds the ``prompt``'s vector
    (docs/outputs.md, "Embeddings"; OpenAI's ``/v1/embeddings``)."""

    chat = "chat"
    completion = "completion"
    score = "score"
    reward = "reward"
    embedding = "embedding"

    @property
    def generates(self) -> bool:
        """False for the scoring endpoints: no sampling, no text, no finish by length or stop word."""
        return self in (Endpoint.chat, Endpoint.completion)


MAX_CONTINUATIONS = 64
"""Most ``continuations`` one score request may carry (a multiple-choice item has a handful; a request of
thousands would be one engine forward of unbounded width)."""

MAX_CONTINUATION_CHARS = 100_000
"""Longest single continuation, in characters (it must fit the model's context with its prompt anyway)."""


class FinishReason(_Value):
    """Why generation stopped; the same values as LMDeploy's ``Response.finish_reason``."""

    stop = "stop"
    length = "length"
    error = "error"
    abort = "abort"


class ErrorCode(_Value):
    """Every error code a user sees: a failed result's ``error.code``, OpenAI-format outputs, the HTTP
    API's errors. What users filter, count and alert on.

    The values are the wire strings results always had (and LMDeploy's own names where the engine
    reports them), so outputs do not change. An engine may still hand up a code of its own (LMDeploy
    grows new ones); results keep it verbatim, so ``ErrorInfo.code`` stays a ``str``. Code in lmdq
    never spells a code as a bare string (tests/test_engine_contract.py checks it)."""

    #: the request itself is unusable (the caller's fault)
    bad_request = "bad_request"
    #: prompt at or over the engine's session length (LMDeploy's name)
    context_length_exceeded = "context_length_exceeded"
    #: the engine failed this request (LMDeploy's name for a per-request engine error)
    internal_error = "internal_error"
    #: LMDeploy: the engine is not there to take the request
    engine_unavailable = "engine_unavailable"
    #: an image the request names could not be read by the worker (gone, unreadable, too large, not an image)
    invalid_image = "invalid_image"
    #: the engine cannot serve what the request asks for with its configuration (e.g. prefix caching + all logits)
    unsupported_feature = "unsupported_feature"
    #: the engine failed the job on its last attempt
    engine_error = "engine_error"
    #: the engine died each time this request ran alone
    engine_crash = "engine_crash"
    max_attempts_exceeded = "max_attempts_exceeded"
    max_runs_exceeded = "max_runs_exceeded"
    #: not started within the batch's completion window
    expired = "expired"
    #: the batch names an output URL this worker may not write to
    output_url_not_allowed = "output_url_not_allowed"
    #: tensors asked for, no blob store configured
    no_blob_store = "no_blob_store"
    tensor_too_large = "tensor_too_large"
    #: a job no worker of this build can decode (newer format, oversized)
    undecodable_job = "undecodable_job"
    #: the submit that was staging the batch died before it staged this request, and nobody resumed it within
    #: its staging lease (LMDQ_STAGING_LEASE_S; docs/reliability.md): it never ran
    submit_interrupted = "submit_interrupted"

    # -- OpenAI-format result files (``results --format openai``, the HTTP API's output file) --
    #: a cancelled request, in OpenAI's name for it
    batch_cancelled = "batch_cancelled"
    #: an expired request, in OpenAI's name for it
    batch_expired = "batch_expired"

    # -- the HTTP API (lmdq-api): error bodies and a batch's ``errors`` (OpenAI's codes where one fits) --
    invalid_api_key = "invalid_api_key"
    service_unavailable = "service_unavailable"
    model_not_found = "model_not_found"
    duplicate_custom_id = "duplicate_custom_id"
    #: a batch input line without a field OpenAI requires (``custom_id``)
    missing_required_parameter = "missing_required_parameter"
    invalid_url = "invalid_url"
    mismatched_model = "mismatched_model"
    invalid_json_line = "invalid_json_line"
    invalid_request = "invalid_request"
    invalid_file = "invalid_file"
    #: the batch's record is gone from Redis (its TTL ran out)
    batch_gone = "batch_gone"

    def __str__(self) -> str:  # the wire string in messages and f-strings too, not 'ErrorCode.expired'
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class ResultStatus(_Value):
    """Final state of one request; ``in_progress`` only ever appears on partial records."""

    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"
    expired = "expired"
    in_progress = "in_progress"


class BatchStatus(_Value):
    """Batch lifecycle, modelled on OpenAI batches."""

    validating = "validating"
    queued = "queued"
    in_progress = "in_progress"
    completed = "completed"
    failed = "failed"
    cancelling = "cancelling"
    cancelled = "cancelled"
    expired = "expired"
    #: lmdq's own: a quality gate failed (``submit --canary`` / ``--gate-window``, lmdq.gates); nothing more of
    #: the batch runs until ``resume`` (the rest runs) or ``cancel`` (the rest ends ``cancelled``). Not terminal.
    #: OpenAI has no such state: the HTTP API shows it as ``in_progress`` with ``lmdq_status: "paused"``.
    paused = "paused"

    @property
    def terminal(self) -> bool:
        return self in (BatchStatus.completed, BatchStatus.failed, BatchStatus.cancelled, BatchStatus.expired)


MAX_SCHEMA_DEPTH = 64
"""Deepest nesting (objects and arrays) a ``response_format`` JSON schema may have. Real schemas nest a few
levels; a deeper one would only exhaust the stack of whatever walks it next (pydantic's serializer, the
grammar compiler): refused as a field error, with the file and line, instead."""


def _nesting(value: Any) -> int:
    """How deeply ``value`` nests dicts and lists, walked without recursion (so any depth is safe)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            items: Any = v.values()
        elif isinstance(v, list):
            items = v
        else:
            continue
        deepest = max(deepest, d)
        if deepest > MAX_SCHEMA_DEPTH:
            return deepest
        stack.extend((x, d + 1) for x in items)
    return deepest


class ResponseFormat(_Strict):
    """Constrained output, as in LMDeploy's ``response_format`` / OpenAI's: a JSON schema or a regex."""

    type: Literal["json_schema", "json_object", "regex"]
    json_schema: dict[str, Any] | None = None
    regex: Annotated[str, Field(min_length=1, max_length=10_000)] | None = None

    @field_validator("json_schema")
    @classmethod
    def _shallow(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and _nesting(v) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels of objects/arrays")
        return v

    @model_validator(mode="after")
    def _payload(self) -> ResponseFormat:
        if self.type == "json_schema" and not self.json_schema:
            raise ValueError("type 'json_schema' needs 'json_schema' (an object with 'schema')")
        if self.type == "regex" and not self.regex:
            raise ValueError("type 'regex' needs 'regex'")
        return self


def _param(description: str, engine_default: Any = None, **constraints: Any) -> Any:
    """A generation parameter: unset (None) by default so params layer (request over batch), with the
    value engines use when nobody sets it (LMDeploy's ``GenerationConfig`` default) declared beside it."""
    return Field(default=None, description=description, json_schema_extra={"engine_default": engine_default},
                 **constraints)


def _engine_default(info: FieldInfo) -> Any:
    extra = info.json_schema_extra
    return extra.get("engine_default") if isinstance(extra, dict) else None


_DEFAULTS: dict[str, Any] = {}


def _engine_defaults() -> dict[str, Any]:
    """Every generation parameter's engine default, read from the declarations once (the fields are fixed
    at import): ``resolved`` runs per request where reuse computes identities (issue 47)."""
    if not _DEFAULTS:
        _DEFAULTS.update({name: _engine_default(info) for name, info in GenerationParams.model_fields.items()})
    return _DEFAULTS


class GenerationParams(_Strict):
    """Sampling/stopping parameters, mirroring LMDeploy's ``GenerationConfig`` field for field.

    Every field is optional so that per-request params can be layered over batch defaults with
    :meth:`merged`; engines read the effective values through :meth:`resolved`. This is the ONE
    declaration of the parameters: the producer's flags and the file ``params`` checks derive from it.
    """

    max_new_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = _param("max tokens to generate", 512)
    min_new_tokens: Annotated[int, Field(ge=0, le=1_000_000)] | None = _param(
        "generate at least this many tokens (stop words and eos wait)")
    do_sample: bool | None = _param("sample (else greedy: argmax, ignoring temperature/top-k/top-p)", False)
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = _param("sampling temperature", 0.8)
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = _param("nucleus sampling mass", 1.0)
    top_k: Annotated[int, Field(ge=0, le=100_000)] | None = _param("sample among the k likeliest tokens", 50)
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = _param(
        "drop tokens below min_p x the likeliest one's probability", 0.0)
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = _param(
        "penalty for tokens already present (1.0 = none)", 1.0)
    random_seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = _param("sampling seed (default: random)")
    stop_words: list[Annotated[str, Field(min_length=1, max_length=1000)]] | None = _param(
        "stop at this text (repeatable)", max_length=64)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = _param("stop at this token id (repeatable)",
                                                                      max_length=64)
    ignore_eos: bool | None = _param("do not stop at eos (generate max_new_tokens)", False)
    skip_special_tokens: bool | None = _param("leave special tokens out of the text", True)
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = _param("top-k logprobs per generated token")
    output_logits: Literal["all", "generation"] | None = _param("logits: all | generation (tensors go to the blob URL)")
    output_last_hidden_state: Literal["all", "generation"] | None = _param(
        "last hidden states: all | generation (tensors go to the blob URL)")
    response_format: ResponseFormat | None = _param("constrain the output to a JSON schema or a regex")
    n: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] | None = _param(
        "samples per prompt: one result holds them all; the prompt is prefilled once", 1)

    @model_validator(mode="after")
    def _min_le_max(self) -> GenerationParams:
        if self.min_new_tokens is not None and self.max_new_tokens is not None:
            if self.min_new_tokens > self.max_new_tokens:
                raise ValueError("min_new_tokens must be <= max_new_tokens")
        return self

    def merged(self, override: GenerationParams | None) -> GenerationParams:
        """Return these params with every field set in ``override`` taking precedence."""
        if override is None:
            return self
        data = self.model_dump(exclude_none=True)
        data.update(override.model_dump(exclude_none=True))
        return GenerationParams.model_validate(data)

    def resolved(self) -> dict[str, Any]:
        """Effective values with LMDeploy's defaults filled in (what every engine must honour); each field
        declares its default beside it (``engine_default``)."""
        out = dict(_engine_defaults())
        out.update(self.model_dump(exclude_none=True))
        return out


class ChatMessage(BaseModel):
    """One OpenAI chat message; content may be a string or a list of parts: text parts, and image parts
    ``{"type": "image_url", "image_url": {"url": ...}}`` (issue 48; the url is a reference a worker reads:
    :mod:`lmdq.images`)."""

    model_config = ConfigDict(extra="allow", defer_build=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def check_parts(self) -> None:
        """Raise ValueError unless every content part is a text part or a well-formed image part."""
        if not isinstance(self.content, list):
            return
        for part in self.content:
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("text"), str):
                continue
            if kind == "image_url":
                img = part.get("image_url")
                if isinstance(img, dict) and isinstance(img.get("url"), str) and img["url"]:
                    continue
                raise ValueError("an image_url part needs {'image_url': {'url': '...'}}")
            raise ValueError("content parts must be text or image_url parts")

    def image_urls(self) -> list[str]:
        """The urls of this message's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [p["image_url"]["url"] for p in self.content
                if p.get("type") == "image_url" and isinstance(p.get("image_url"), dict)]

    def text(self) -> str:
        """Flatten content parts to text, for a text-only model: a message with an image part raises
        ValueError (a text model must not answer as if it had seen the image)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") == "image_url":
                raise ValueError("this message has an image part: it needs a vision-language model")
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class Request(_Strict):
    """One prompt of a batch, as carried inside a job payload."""

    index: Annotated[int, Field(ge=0, le=10**9)]
    custom_id: Annotated[str, Field(min_length=1, max_length=512)]
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=10_000)
    endpoint: Endpoint = Endpoint.chat
    params: GenerationParams | None = None
    #: ``score`` requests only: the texts whose log-likelihood after the prompt is wanted
    continuations: list[Annotated[str, Field(min_length=1, max_length=MAX_CONTINUATION_CHARS)]] | None = Field(
        default=None, min_length=1, max_length=MAX_CONTINUATIONS)

    @model_validator(mode="after")
    def _one_input(self) -> Request:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of 'prompt' or 'messages' is required")
        if self.messages is not None:
            for m in self.messages:
                m.check_parts()  # text and image_url parts only
        if self.endpoint is Endpoint.completion and self.prompt is None:
            raise ValueError("completion requests need 'prompt'")
        if self.endpoint is Endpoint.reward and self.messages is None:
            raise ValueError("reward requests need 'messages' (the chat to score)")
        if self.endpoint is Endpoint.embedding and self.prompt is None:
            raise ValueError("embedding requests need 'prompt' (the text to embed)")
        if (self.endpoint is Endpoint.score) != (self.continuations is not None):
            raise ValueError("'continuations' is required for endpoint 'score' and only allowed there")
        return self


class JobPayload(_Strict):
    """The single argument of an lmdq RQ job: a slice of one batch.

    Untrusted on the worker side (anyone with queue access can write one): ids, indices and sizes are
    bounded here; whether the job belongs to a real batch and may write where it says is checked
    against the batch record by :func:`lmdq.jobs.decode.decode_job`.
    """

    format_version: Literal[1] = FORMAT_VERSION
    batch_id: Annotated[str, Field(pattern=BATCH_ID_PATTERN)]
    model: Annotated[str, Field(min_length=1, max_length=512)]
    job_no: Annotated[int, Field(ge=0, le=10**9)]
    params: GenerationParams = Field(default_factory=GenerationParams)
    requests: list[Request] = Field(min_length=1, max_length=MAX_JOB_REQUESTS)
    #: the batch's results sink: final results go to JSONL shards there, Redis keeps one index entry per job
    results_url: str | None = None
    #: the batch's blob store for tensors (logits, hidden states); the worker's LMDQ_BLOB_URL otherwise
    blob_url: str | None = None
    #: the batch takes part in result reuse (issue 47, ``--reuse``): its requests are answered from the reuse
    #: index where they can be, and its completed results are recorded there for this many seconds
    reuse_ttl_s: Annotated[int, Field(ge=1, le=MAX_REUSE_TTL_S)] | None = None
    #: its results feed the batch's quality gates (a canary job, or any job under ``--gate-window``): the
    #: worker judges them when the job ends (lmdq.gates); False costs nothing
    gated: bool = False

    @model_validator(mode="after")
    def _unique_indices(self) -> JobPayload:
        # Results are keyed by index: a repeated index would answer one request twice and another never.
        seen: set[int] = set()
        for r in self.requests:
            if r.index in seen:
                raise ValueError(f"request index {r.index} appears twice in the job")
            seen.add(r.index)
        return self


class ErrorInfo(_Strict):
    code: str
    message: str


class Timings(_Strict):
    """Unix timestamps (seconds, float) of one request's life."""

    enqueued_at: float | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None


class TokenLogprob(_Strict):
    """One generated token: its id, its logprob, and the top-k alternatives as [token_id, logprob]."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)


class ContinuationScore(_Strict):
    """One continuation of a ``score`` request: lm-eval-harness' ``loglikelihood`` answer.

    ``logprob`` is the SUM of the continuation tokens' log-probabilities given the prompt and the
    continuation tokens before each; ``num_tokens`` how many tokens that is (prompt and continuation are
    tokenized separately and the ids concatenated, as lm-eval does); ``is_greedy`` whether every one of
    them is the model's argmax at its position, None where the backend cannot tell."""

    logprob: float
    num_tokens: int
    is_greedy: bool | None = None


class TensorRef(_Strict):
    """A tensor stored outside Redis (safetensors in a blob store), referenced from a result."""

    uri: str
    key: str
    dtype: str
    shape: list[int]
    nbytes: int


class Sample(_Strict):
    """One of the ``n`` samples of a request (``params.n > 1``); ``index`` is its place, 0..n-1.

    Sample ``i`` of a request with ``random_seed=s`` was drawn with seed ``s + i``, so a re-run gives the
    same samples where the engine repeats a seeded draw (docs/outputs.md, "Seeds"). ``prefill_token_len``
    is how many prompt tokens the engine computed for this sample (0 when it reused another sample's
    prefill; None when the engine does not say)."""

    index: int
    text: str = ""
    finish_reason: FinishReason | None = None
    generate_token_len: int = 0
    logprobs: list[TokenLogprob] | None = None
    prefill_token_len: int | None = None
    error: ErrorInfo | None = None


MAX_REUSE_TTL_S = 10 * 365 * 86400
"""Longest ``--reuse-ttl``: ten years (the index's entries are bytes; what bounds them is the sink)."""


class ReusedFrom(_Strict):
    """Where a reused result's answer was computed (issue 47): that batch and that request's custom_id."""

    batch: str
    custom_id: str


class Result(_Strict):
    """One request's outcome; exactly one final Result per accepted request.

    With ``params.n > 1`` the result holds ``samples`` (all n, written together, never some of them);
    ``text``/``finish_reason``/``logprobs`` then repeat sample 0 (what a reader that knows nothing of
    samples sees, like OpenAI's ``choices[0]``), ``input_token_len`` counts the prompt ONCE and
    ``generate_token_len`` is the sum over the samples. ``prefill_token_len`` is the prompt tokens the
    engine actually computed for the request, over all its samples (the shared prefill's saving)."""

    format_version: Literal[1] = FORMAT_VERSION
    batch_id: str
    custom_id: str
    index: int
    status: ResultStatus
    text: str = ""
    finish_reason: FinishReason | None = None
    input_token_len: int = 0
    generate_token_len: int = 0
    error: ErrorInfo | None = None
    model: str
    backend: str | None = None
    worker: str | None = None
    attempt: int = 1
    endpoint: Endpoint = Endpoint.chat
    timings: Timings = Field(default_factory=Timings)
    logprobs: list[TokenLogprob] | None = None
    tensors: dict[str, TensorRef] | None = None
    #: the n samples of a request with ``params.n > 1`` (None for n = 1)
    samples: list[Sample] | None = None
    #: prompt tokens the engine computed (not served from a prefix cache or a shared prefill); None: unknown
    prefill_token_len: int | None = None
    #: endpoint ``score``: one entry per continuation, in the request's order
    scores: list[ContinuationScore] | None = None
    #: endpoint ``reward``: the reward model's score of the chat
    reward: float | None = None
    #: endpoint ``embedding``: the vector, base64 of its little-endian float32 bytes (:func:`decode_embedding`);
    #: float32 is what the model computed, and its base64 is a third of the size of JSON decimals
    embedding: str | None = None
    #: answered from the reuse index (issue 47), not by the engine: the request whose stored answer this is
    reused_from: ReusedFrom | None = None

    @property
    def final(self) -> bool:
        return self.status is not ResultStatus.in_progress


def encode_embedding(vector: Sequence[float]) -> str:
    """A vector as ``Result.embedding`` holds it: base64 of its little-endian float32 bytes (OpenAI's
    ``encoding_format: "base64"`` spelling, byte for byte)."""
    a = array("f", vector)
    if sys.byteorder == "big":  # pragma: no cover - every platform lmdq runs on is little-endian
        a.byteswap()
    return base64.b64encode(a.tobytes()).decode("ascii")


def decode_embedding(data: str) -> list[float]:
    """``Result.embedding`` back to its floats (each exactly the float32 the engine returned)."""
    raw = base64.b64decode(data, validate=True)
    if len(raw) % 4:
        raise ValueError(f"an embedding is float32s: {len(raw)} bytes is not a multiple of 4")
    a = array("f")
    a.frombytes(raw)
    if sys.byteorder == "big":  # pragma: no cover
        a.byteswap()
    return a.tolist()


class RequestCounts(_Strict):
    total: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0

    @property
    def done(self) -> int:
        return self.completed + self.failed + self.cancelled + self.expired


class Batch(_Strict):
    """One submission: what the producer accepted, plus live status and counts."""

    format_version: Literal[1] = FORMAT_VERSION
    id: str
    model: str
    status: BatchStatus
    input_file: str | None = None
    priority: Priority = Priority.normal
    batch_size: int
    num_jobs: int = 0
    #: jobs were formed by prompt prefix (src/lmdq/submission/prefix_groups.py): a job's requests are not the
    #: consecutive indices ``job_no * batch_size ...``, so readers find a request by scanning jobs
    prefix_groups: bool = False
    params: GenerationParams = Field(default_factory=GenerationParams)
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    #: a batch over several models (each line's ``model`` / ``body.model``): the request counts of each
    #: model, in the order the input first named it (``model`` is the first). None: one model, ``model``.
    #: Totals are fixed at submit; the other counts are live (the results script keeps them per model)
    model_counts: dict[str, RequestCounts] | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    idempotency_key: str | None = None
    completion_window_s: float | None = None
    #: Unix time the batch should be done by (``submit --deadline``, issue 46): its jobs are claimed
    #: earliest-deadline-first within their priority class, and the fleet is sized for it
    deadline: float | None = None
    results_url: str | None = None
    blob_url: str | None = None
    #: ``--reuse``: how long its completed results stay in the reuse index (None: the batch does not reuse)
    reuse_ttl_s: Annotated[int, Field(ge=1, le=MAX_REUSE_TTL_S)] | None = None
    #: ``--reuse``: its requests the reuse index could answer when it was submitted (None: not counted)
    reusable: int | None = None
    #: ``--webhook`` (issue 48, lmdq.webhooks): the URL told of the batch's end (and pauses), checked against
    #: the allow list at submit; read by the batch-end Lua from the record's meta JSON
    webhook: str | None = None
    #: whose secret signs the batch's events (the HTTP API's tenant; None: ``default``)
    webhook_tenant: str | None = None
    #: the HTTP API batch this batch runs (its events name that id; the API announces its end itself)
    webhook_as: str | None = None
    created_at: float
    queued_at: float | None = None
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    expires_at: float | None = None
    expired_at: float | None = None

    @property
    def models(self) -> list[str]:
        """Every model the batch's requests run on (queues, cancel, purge go over each)."""
        return list(self.model_counts) if self.model_counts else [self.model]

    @field_validator("metadata")
    @classmethod
    def _small_metadata(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > 16:
            raise ValueError("at most 16 metadata keys")
        for k, val in v.items():
            if len(k) > 64 or len(val) > 512:
                raise ValueError("metadata keys are <= 64 chars and values <= 512 chars")
        return v
