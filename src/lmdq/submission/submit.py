"""Submit a prompt file as one batch: validate the WHOLE file, then stage and commit its jobs.

Two streaming passes keep memory flat however large the file is: pass 1 parses and validates every line ONCE
and writes each accepted request, as the JSON its job will hold, to a temporary file
(:class:`lmdq.submission.spill.RequestSpill`); per request it keeps its custom_id's 8-byte hash (duplicates being
confirmed by a targeted re-scan), a CRC-32 of its line's bytes, its offset and line number (prefix groups), its
model's number (several models) and its custom_id (the staging lease), all on disk in temporary files
(:mod:`lmdq.submission.spill`, issue 44: deleted when the submit returns or fails); pass 2 stages the spilled
requests through the batch ledger (:mod:`lmdq.submission.ledger`), never parsing the input again (issue 49: the
second parse and its per-request hashes were ~40 % of a submit's CPU). Nothing is visible before the WHOLE file
validated, so a bad line enqueues nothing. Then the first ``first_jobs`` jobs become visible as soon as they are
staged and workers start on them while submit stages the rest (issue 27: on the H200 the GPU sat idle for the
1.6-2.4 s a submit of 1,024 lines took): a failure before that deletes what was staged; a failure after it (the
file changed, Redis refused a write) ends the batch cancelled, with the reason
(:meth:`lmdq.submission.ledger.BatchLedger.abandon`).

What is staged is always what pass 1 validated (it comes from the spill, not from the file), so an edit during
the submit can never put an unvalidated request into a job. It is still refused, so a batch is the file as it
was: the file's size, mtime and the CRC-32 of every request line are checked against pass 1's when pass 2
starts (an edit before any job is visible: exit 2, nothing enqueued) and again after the last job is staged,
before the last commit (an edit during staging: the batch ends cancelled, naming the first line that
differs). Each check reads the file's bytes once, without parsing them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import time
from array import array
from collections.abc import Callable, Generator, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any
from zlib import crc32

import orjson
import redis
from pydantic import ValidationError

from lmdq.batches.headroom import check_batch_fits
from lmdq.batches.staging import IDS_CHUNK
from lmdq.contract import Batch, BatchStatus, Endpoint, GenerationParams, Priority, Request, RequestCounts
from lmdq.errors import SubmitRejected, UnknownModel
from lmdq.gates.config import GateConfig
from lmdq.images.parts import image_urls
from lmdq.images.refs import ImageChecker, ImageRefError
from lmdq.jobs.data import DEFAULT_MAX_JOB_BYTES
from lmdq.redis.keys import InvalidModelName, Keys, check_model_name
from lmdq.results.output_urls import check_submit_urls
from lmdq.settings import default_of
from lmdq.submission.foreign import foreign_format, foreign_format_message
from lmdq.submission.formats import (
    InputError,
    InputFormat,
    InputLimits,
    ParsedLine,
    detect_format,
    iter_lines,
    iter_records_data,
    request_lines,
)
from lmdq.submission.formats.records import Sampling
from lmdq.submission.ledger import BatchLedger, StagingLeaseLost, job_payloads, new_batch_id
from lmdq.submission.prefix_groups import JobPlan, PrefixKeys, plan_jobs
from lmdq.submission.settings import ProducerSettings
from lmdq.submission.spill import IdChunks, IdHashes, RequestSpill, SpillArray, id_hash
from lmdq.webhooks.signing import new_secret
from lmdq.webhooks.store import WebhookStore

__all__ = [
    "Prevalidated",
    "SubmitOptions",
    "submit_fingerprint",
    "job_payloads",
    "new_batch_id",
    "submit_file",
]

Progress = Callable[[int], None]

TEXT_ENDPOINTS = (Endpoint.chat, Endpoint.completion, Endpoint.embedding)
"""What ``--endpoint`` may make of a text file's lines (each a plain prompt; score and reward need more)."""


@dataclass
class SubmitOptions:
    model: str | None
    batch_size: int = default_of(ProducerSettings, "batch_size")
    params: GenerationParams = field(default_factory=GenerationParams)
    priority: Priority = Priority.normal
    metadata: dict[str, str] = field(default_factory=dict)
    idempotency_key: str | None = None
    completion_window_s: float | None = None
    allow_unknown_model: bool = False
    known_models: tuple[str, ...] = default_of(ProducerSettings, "known_models")
    limits: InputLimits = field(default_factory=InputLimits)
    max_errors: int = 20
    fmt: InputFormat | None = None
    #: submit's ``--endpoint`` / ``endpoint=``: every line's endpoint (a text file's lines, a JSONL line naming
    #: none); a line naming another is refused. None: each line's own (chat by default)
    endpoint: Endpoint | None = None
    results_url: str | None = None
    blob_url: str | None = None
    #: prefix-aware job formation (src/lmdq/submission/prefix_groups.py): requests sharing a prompt prefix of at
    #: least ``prefix_group_bytes`` go into the same jobs; off = jobs in input order
    prefix_groups: bool = default_of(ProducerSettings, "prefix_groups")
    prefix_group_bytes: int = default_of(ProducerSettings, "prefix_group_bytes")
    #: the share of Redis' maxmemory this submit may fill (LMDQ_MEMORY_HEADROOM_FRACTION; lmdq.batches.headroom)
    memory_fraction: float = default_of(ProducerSettings, "memory_headroom_fraction")
    #: called once after the file validated and the idempotency key is bound, before the staging
    #: pass reads the file again: the moment a concurrent edit is most harmful, so tests edit the
    #: file here (deterministically, not by racing a sleeping process)
    after_validation: Callable[[], None] | None = None
    #: told each warning about the file (one line per kind, with a count: never one per line)
    on_warning: Callable[[str], None] | None = None
    #: jobs made visible as soon as they are staged, before the rest is (then every ``chunk_jobs``): the
    #: GPU starts while submit stages the rest (lmdq.submission.ledger.BatchLedger.enqueue). None = all at once
    first_jobs: int | None = 8
    #: called once, right after the first jobs became visible and before the rest is staged (tests run a
    #: worker, edit the file or make Redis refuse here: deterministically, not by racing a process)
    after_first_commit: Callable[[], None] | None = None
    #: how the caller's surface names the model option and the way past an unknown model (issue 45: one
    #: error, three spellings): the CLI's flags by default, ``model=`` / ``allow_unknown_model=True`` from
    #: Python; None for the HTTP API, whose caller cannot pass one
    model_option: str = "--model"
    endpoint_option: str = "--endpoint"
    allow_unknown_hint: str | None = "--allow-unknown-model"
    #: what the batch record names as its input when ``path`` is a copy of it: ``-`` for stdin (a
    #: temporary file, src/lmdq/submission/stdin_input.py), or the client's spool of a DataFrame, a Parquet file
    #: or Python rows (lmdq.client.sources)
    input_name: str | None = None
    #: LMDQ_STAGING_LEASE_S: the staging lease this submit renews while it stages (lmdq.settings.CommonSettings)
    staging_lease_s: float = default_of(ProducerSettings, "staging_lease_s")
    #: Unix time the batch should be done by (issue 46: earliest-deadline-first claims); None: none
    deadline: float | None = None
    #: issue 48 (lmdq.webhooks): the URL told of the batch's end, already checked against the allow list, and
    #: whose secret signs its events (None: ``default``); submit makes the tenant's secret if it has none
    webhook: str | None = None
    webhook_tenant: str | None = None
    #: the HTTP API batch this submit runs: its events name that id (lmdq.webhooks.store.WEBHOOK_EVENT)
    webhook_as: str | None = None
    #: image inputs (issue 48, lmdq.images.refs): the folder relative image paths resolve against
    #: (``--image-dir``); each reference is checked in pass 1, and a relative path reaches the job absolute
    image_dir: str | None = None
    #: LMDQ_MAX_IMAGE_BYTES: the largest image a reference may name (or a data: URL hold)
    max_image_bytes: int = default_of(ProducerSettings, "max_image_bytes")
    #: the HTTP API's LMDQ_API_IMAGE_ROOT: local image paths must lie inside it; ``allow_local_images`` False
    #: refuses local paths outright (an API without a root)
    image_root: str | None = None
    allow_local_images: bool = True
    #: ``--reuse`` (issue 47): how long the batch's answers stay reusable; None: the batch does not reuse
    reuse_ttl_s: int | None = None

    def image_checker(self) -> ImageChecker:
        """How this submit checks image references (lmdq.images.refs.ImageChecker)."""
        return ImageChecker(max_bytes=self.max_image_bytes, image_dir=self.image_dir, root=self.image_root,
                            allow_local=self.allow_local_images)
    #: quality gates (``--canary``, ``--gate``, ``--gate-window``; lmdq.gates): a canary runs first and the rest
    #: only if it passes; the whole file is staged before anything runs (``first_jobs`` does not apply)
    gates: GateConfig | None = None


@dataclass(frozen=True)
class _Fingerprint:
    """What pass 1 saw and kept: pass 2 stages its requests and must see the same file, or the submit is refused."""

    size: int
    mtime_ns: int
    requests: int
    #: a CRC-32 of the whole file's bytes, read at C speed after pass 1 (an edit while pass 1 ran changes the
    #: mtime pass 1 started with): the checks' fast path (:func:`_check_unchanged`)
    file_crc: int
    #: a CRC-32 of every accepted request's line, by index (on disk): what the check that the file did not
    #: change compares (:func:`_check_unchanged`), naming the first line that differs
    line_crcs: SpillArray = field(default_factory=lambda: SpillArray("I"), compare=False)
    #: every accepted request as the JSON its job holds, by index: what pass 2 stages (on disk)
    spilled: RequestSpill = field(default_factory=RequestSpill, compare=False)
    #: every accepted request's custom_id, in input order, as JSON arrays of IDS_CHUNK: progressive staging
    #: writes them before any job is visible, so a batch whose submit dies part-way still answers each request
    #: (issue 44). On disk (:class:`lmdq.submission.spill.IdChunks`), pushed to Redis in bounded batches
    id_chunks: IdChunks = field(default_factory=lambda: IdChunks(IDS_CHUNK), compare=False)


class Prevalidated:
    """Pass 1's per-request state, built by a caller that wrote and validated the file itself: the client's
    spool of an Arrow source, column by column (:mod:`lmdq.client.sources`; issue 49: parsing the spool
    again, line by line, was most of a Parquet submit's CPU). :func:`submit_file` then stages from it without
    parsing the file; everything else (the checks that the file did not change, prefix grouping, progressive
    staging, resume) is as for any file. The caller adds every request through :meth:`add_many` in file
    order, having ruled out duplicate ids; ``ok`` False (some rows needed the row parser) means it is not
    used: pass 1 reads the file as always. :meth:`close` deletes its temporary files."""

    def __init__(self, opts: SubmitOptions, directory: str | None) -> None:
        self.ok = opts.model is not None
        self.requests = 0
        self.line_crcs = SpillArray("I", directory)
        self.spilled = RequestSpill(directory)
        self.id_chunks = IdChunks(IDS_CHUNK, directory)
        self.prefixes = (PrefixKeys(opts.prefix_group_bytes, group=True, directory=directory)
                         if opts.prefix_groups else None)
        #: the rows whose sampling the row parser implied (warned about once per kind, as a file's lines)
        self.sampling = _SamplingTally()

    def close(self) -> None:
        self.line_crcs.close()
        self.spilled.close()
        self.id_chunks.close()
        if self.prefixes is not None:
            self.prefixes.close()

    def __enter__(self) -> Prevalidated:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _prevalidated(path: Path, opts: SubmitOptions, pre: Prevalidated
                  ) -> tuple[_Fingerprint, str, PrefixKeys | None, int, _Models | None]:
    """:func:`_validate`'s answer for a file whose caller validated it and built pass 1's state itself."""
    assert opts.model is not None and pre.ok
    try:
        size, mtime_ns = _stat(path)
        whole = _file_crc(path)
    except OSError as e:
        raise SubmitRejected(f"{path}: cannot read the file: {e.strerror or e}") from e
    if pre.requests == 0 or len(pre.spilled) != pre.requests or len(pre.line_crcs) != pre.requests:
        raise SubmitRejected(f"{path}: pass 1's state holds {len(pre.spilled)} requests, expected {pre.requests}")
    seen = _Fingerprint(size=size, mtime_ns=mtime_ns, requests=pre.requests, file_crc=whole,
                        line_crcs=pre.line_crcs, spilled=pre.spilled, id_chunks=pre.id_chunks)
    if opts.on_warning is not None:
        for w in pre.sampling.warnings(path, batch_samples=bool(opts.params.do_sample)):
            opts.on_warning(w)
    return seen, opts.model, pre.prefixes, 0, None


_PARAMS_DUMPS: dict[int, tuple[GenerationParams, dict[str, Any]]] = {}
"""id(params) -> (params, its dump): lines with the same params share one validated object
(:mod:`lmdq.submission.formats.jsonl`), dumped once; the object is kept here so its id is never reused.
The dump is only ever serialized, never changed."""


def _params_dump(params: GenerationParams) -> dict[str, Any]:
    got = _PARAMS_DUMPS.get(id(params))
    if got is not None and got[0] is params:
        return got[1]
    data = params.model_dump(exclude_none=True)
    if len(_PARAMS_DUMPS) >= 1024:
        _PARAMS_DUMPS.clear()
    _PARAMS_DUMPS[id(params)] = (params, data)
    return data


def _request_json(index: int, item: ParsedLine, *, with_model: bool, images: ImageChecker | None = None) -> bytes:
    """The request as its job holds it (index, custom_id, endpoint, prompt or messages, params, continuations), as
    JSON; ``with_model``: with the line's model (pass 2 drops it unless the batch runs on several models)."""
    d: dict[str, Any] = {"index": index, "custom_id": item.custom_id, "endpoint": item.endpoint.value}
    if with_model and item.model is not None:
        d["model"] = item.model
    if item.messages is not None:  # image references as the job carries them (relative paths made absolute)
        d["messages"] = item.messages if images is None else _with_image_refs(item.messages, images)
    else:
        d["prompt"] = item.prompt
    if item.params is not None:
        p = _params_dump(item.params)
        if p:
            d["params"] = p
    if item.continuations is not None:
        d["continuations"] = list(item.continuations)
    try:
        return orjson.dumps(d)
    except orjson.JSONEncodeError:  # a lone surrogate or an int over 64 bits (the stdlib parser's, on a doubt)
        return json.dumps(d, ensure_ascii=True, separators=(",", ":")).encode()


def _staged_request(raw: bytes, *, with_model: bool, as_raw: bool) -> dict[str, Any] | bytes:
    """A spilled request as pass 2 hands it to the ledger: its JSON as it is (spliced into its job unparsed:
    issue 49) when the job holds it whole, else the dict (:func:`_spilled_request`)."""
    if as_raw and not with_model and raw.startswith(b'{"index":'):
        return raw
    return _spilled_request(raw, with_model=with_model)


def _spilled_request(raw: bytes, *, with_model: bool) -> dict[str, Any]:
    """A spilled request back as the dict its job holds (:func:`_request_json`)."""
    try:
        d: dict[str, Any] = orjson.loads(raw)
    except orjson.JSONDecodeError:  # the ASCII-escaped form above
        d = json.loads(raw)
    if not with_model:
        d.pop("model", None)
    return d


def _stat(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _changed(path: Path, detail: str) -> SubmitRejected:
    return SubmitRejected(
        f"{path}: the file changed during submit ({detail}); nothing was enqueued. "
        "Submit it again once nothing is writing to it"
    )


@dataclass
class _Models:
    """The models a file's lines name, seen in pass 1 (without ``--model``): one batch may run on several.

    ``counts`` in the order the file first names each; ``ids[i]`` is request i's model, its position in
    ``counts`` (4 bytes a request, on disk; a line naming none gets 0)."""

    where: str  #: the field lines name it in: ``model`` (lmdq JSONL) or ``body.model`` (OpenAI)
    ids: SpillArray
    counts: dict[str, int] = field(default_factory=dict)
    first_line: dict[str, int] = field(default_factory=dict)
    index: dict[str, int] = field(default_factory=dict)
    unnamed: int = 0
    first_unnamed: int = 0

    def add(self, path: Path, item: ParsedLine, errors: list[str]) -> bool:
        """Count ``item``'s model; False (and an error naming the line) when its name breaks the rule."""
        name = item.model
        if name is None:
            self.unnamed += 1
            self.first_unnamed = self.first_unnamed or item.line_no
            self.ids.append(0)
            return True
        if name not in self.counts:
            try:
                check_model_name(name)
            except InvalidModelName as e:
                errors.append(f"{path}:{item.line_no}: field '{self.where}': {e}")
                return False
            self.counts[name] = 0
            self.first_line[name] = item.line_no
            self.index[name] = len(self.index)
        self.counts[name] += 1
        self.ids.append(self.index[name])
        return True

    def several(self) -> bool:
        return len(self.counts) > 1


def _validate(
    path: Path, opts: SubmitOptions, progress: Progress | None, spills: ExitStack, spill_dir: str | None = None,
) -> tuple[_Fingerprint, str, PrefixKeys | None, int, _Models | None]:
    """Pass 1: returns (the file's fingerprint, model, what prefix grouping needs when it is on, the
    line the model came from: 0 when --model named it, the models the lines name when they name
    several) or raises SubmitRejected listing file:line errors. What it keeps per request goes to
    temporary files in ``spill_dir`` (None: TMPDIR), closed by ``spills``."""
    errors: list[str] = []
    hashes = spills.enter_context(IdHashes(spill_dir))
    id_chunks = spills.enter_context(IdChunks(IDS_CHUNK, spill_dir))
    n = 0
    # --model wins for every line (an OpenAI file written for gpt-4o-mini runs on the served model);
    # without it, each line's model (lmdq `model`, OpenAI `body.model`) routes it: a batch may run on
    # several models, and lines naming none take the file's one model.
    lines = (None if opts.model is not None else
             _Models("body.model" if opts.fmt is InputFormat.openai else "model",
                     ids=spills.enter_context(SpillArray("I", spill_dir))))
    # a file naming its models keeps every request's offset, so a batch over several can be read model by model
    prefixes = (PrefixKeys(opts.prefix_group_bytes, group=opts.prefix_groups, directory=spill_dir)
                if opts.prefix_groups or lines is not None else None)
    if prefixes is not None:
        spills.callback(prefixes.close)
    line_crcs = spills.enter_context(SpillArray("I", spill_dir))
    spilled = spills.enter_context(RequestSpill(spill_dir))
    named = lines is not None
    sampling = _SamplingTally()
    images = opts.image_checker()
    fields = "body.messages" if opts.fmt is InputFormat.openai else "messages"
    block = _Block(hashes, line_crcs, spilled, id_chunks, prefixes)
    try:
        size, mtime_ns = _stat(path)
        for offset, data, item in iter_records_data(path, fmt=opts.fmt, limits=opts.limits, endpoint=opts.endpoint):
            if isinstance(item, InputError):
                errors.append(str(item))
                if len(errors) >= opts.max_errors:
                    errors.append(f"{path}: stopping after {opts.max_errors} errors")
                    break
                continue
            if progress:
                progress(item.line_no)
            if item.messages is not None and not _images_ok(path, item, images, fields, errors):
                if len(errors) >= opts.max_errors:
                    errors.append(f"{path}: stopping after {opts.max_errors} errors")
                    break
                continue
            if lines is not None:
                if not lines.add(path, item, errors):
                    if len(errors) >= opts.max_errors:
                        errors.append(f"{path}: stopping after {opts.max_errors} errors")
                        break
                    continue
            block.hashes.append(id_hash(item.custom_id))
            block.crcs.append(crc32(data))  # type: ignore[arg-type]  # an accepted line has its bytes
            block.requests.append(_request_json(n, item, with_model=named, images=images))
            if prefixes is not None:
                if prefixes.needs_key(item):  # in order: the requests before it first
                    block.flush_prefixes()
                    prefixes.add(offset, item, model=item.model if lines is not None else None)
                else:
                    block.offsets.append(offset)
                    block.line_nos.append(item.line_no)
            if item.sampling is not None:
                sampling.note(item.sampling, item.line_no)
            block.ids.append(item.custom_id)
            n += 1
            if len(block.ids) >= block.SIZE:
                block.flush()
        block.flush()
    except OSError as e:
        raise SubmitRejected(f"{path}: cannot read the file: {e.strerror or e}") from e
    if not errors:
        errors.extend(_duplicates(path, opts, hashes))
    model = opts.model
    model_line = 0
    several = None
    if lines is not None and lines.counts:
        model = next(iter(lines.counts))
        model_line = lines.first_line[model]
        if lines.several():
            several = lines
            if lines.unnamed and not errors:
                names = ", ".join(repr(m) for m in list(lines.counts)[:5])
                errors.append(
                    f"{path}:{lines.first_unnamed}: field '{lines.where}': expected a model name: the file "
                    f"names several models ({names}{', ...' if len(lines.counts) > 5 else ''}) and "
                    f"{_lines(lines.unnamed)} name none; name one on each line, or pass --model NAME to run "
                    "every line on NAME"
                )
    if model is None and not errors:
        errors.append(f"{path}: no model given: pass --model NAME")
    if errors:
        raise SubmitRejected("\n".join(errors))
    if opts.on_warning is not None:
        for w in sampling.warnings(path, batch_samples=bool(opts.params.do_sample)):
            opts.on_warning(w)
    if model is None:  # unreachable: a missing model is one of the errors above
        raise SubmitRejected(f"{path}: no model given: pass --model NAME")
    try:
        whole = _file_crc(path)
    except OSError as e:
        raise SubmitRejected(f"{path}: cannot read the file: {e.strerror or e}") from e
    seen = _Fingerprint(size=size, mtime_ns=mtime_ns, requests=n, file_crc=whole, line_crcs=line_crcs,
                        spilled=spilled, id_chunks=id_chunks)
    return seen, model, prefixes, model_line, several


class _Block:
    """What pass 1 keeps per accepted request, gathered for :attr:`SIZE` requests and written to its spill
    files a block at a time (issue 49: five method calls per request were ~8 % of pass 1's CPU)."""

    SIZE = 4096

    def __init__(self, hashes: IdHashes, line_crcs: SpillArray, spilled: RequestSpill, id_chunks: IdChunks,
                 prefixes: PrefixKeys | None) -> None:
        self.into = (hashes, line_crcs, spilled, id_chunks, prefixes)
        self.hashes = array("Q")
        self.crcs = array("I")
        self.requests: list[bytes] = []
        self.ids: list[str] = []
        self.offsets = array("Q")  # the prefix keys' offsets and line numbers of requests given no key
        self.line_nos = array("I")

    def flush_prefixes(self) -> None:
        prefixes = self.into[4]
        if prefixes is not None and self.offsets:
            prefixes.add_unkeyed(self.offsets, self.line_nos)
            self.offsets = array("Q")
            self.line_nos = array("I")

    def flush(self) -> None:
        hashes, line_crcs, spilled, id_chunks, _ = self.into
        self.flush_prefixes()
        hashes.extend(self.hashes)
        line_crcs.extend(self.crcs)
        spilled.add_many(b"".join(self.requests), array("Q", accumulate(map(len, self.requests))))
        id_chunks.extend(self.ids)
        self.hashes = array("Q")
        self.crcs = array("I")
        self.requests = []
        self.ids = []


def _images_ok(path: Path, item: ParsedLine, images: ImageChecker, fields: str, errors: list[str]) -> bool:
    """Check every image reference of ``item`` (exists, readable, an image, within the size limit) WITHOUT
    keeping its bytes; False, with one error naming the line and the part's field, for the first bad one."""
    assert item.messages is not None
    for i, j, url in image_urls(item.messages):
        try:
            images.check(url)
        except ImageRefError as e:
            errors.append(f"{path}:{item.line_no}: field '{fields}[{i}].content[{j}].image_url.url': {e}")
            return False
    return True


def _with_image_refs(messages: list[dict[str, Any]], images: ImageChecker) -> list[dict[str, Any]]:
    """``messages`` with each image reference as its job carries it (a relative path made absolute); the
    same list when it has no image part (the common case: no copy)."""
    if not any(True for _ in image_urls(messages)):
        return messages
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if (isinstance(part, dict) and part.get("type") == "image_url"
                        and isinstance(part.get("image_url"), dict)):
                    img = dict(part["image_url"])
                    img["url"] = images.normalize(img["url"])
                    part = {**part, "image_url": img}
                parts.append(part)
            m = {**m, "content": parts}
        out.append(m)
    return out


class _SamplingTally:
    """Lines whose sampling knobs came without ``do_sample`` (formats.validation.imply_sampling),
    counted so the file gets one warning per kind, not one per line."""

    def __init__(self) -> None:
        self.count = {Sampling.implied: 0, Sampling.inert: 0}
        self.first: dict[Sampling, int] = {}

    def note(self, sampling: Sampling, line_no: int) -> None:
        self.count[sampling] += 1
        self.first.setdefault(sampling, line_no)

    def warnings(self, path: Path, *, batch_samples: bool) -> list[str]:
        out = []
        n = self.count[Sampling.implied]
        if n:
            out.append(f"{path}: {_lines(n)} set temperature without do_sample (first: line "
                       f"{self.first[Sampling.implied]}): temperature > 0 samples, 0 is greedy; "
                       "set do_sample to choose explicitly")
        n = self.count[Sampling.inert]
        if n and not batch_samples:  # with --do-sample the batch samples, and the knobs apply
            out.append(f"{path}: {_lines(n)} set top_p/top_k/min_p without temperature or do_sample (first: "
                       f"line {self.first[Sampling.inert]}): greedy, so they have no effect; set "
                       "do_sample: true (or --do-sample) to sample")
        return out


def _lines(n: int) -> str:
    return f"{n:,} line{'s' if n != 1 else ''}"


def _duplicates(path: Path, opts: SubmitOptions, hashes: IdHashes) -> list[str]:
    """Find duplicate custom_ids from their hashes; re-scan only to name the lines."""
    dup = hashes.duplicates()
    if not dup:
        return []
    first: dict[str, int] = {}
    out: list[str] = []
    for item in iter_lines(path, fmt=opts.fmt, limits=opts.limits, endpoint=opts.endpoint):
        if isinstance(item, ParsedLine) and id_hash(item.custom_id) in dup:
            if item.custom_id in first:
                out.append(
                    f"{path}:{item.line_no}: field 'custom_id': expected a unique id, "
                    f"{item.custom_id!r} already used on line {first[item.custom_id]}"
                )
                if len(out) >= opts.max_errors:
                    break
            else:
                first[item.custom_id] = item.line_no
    return out


def _file_crc(path: Path) -> int:
    """A CRC-32 of the file's bytes, 1 MiB at a time (C speed: ~1 GB/s)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1 << 20):
            crc = crc32(chunk, crc)
    return crc


def _check_unchanged(path: Path, opts: SubmitOptions, seen: _Fingerprint) -> None:
    """Raise SubmitRejected unless ``path`` is the file pass 1 validated: the same size, mtime and CRC-32 of
    its bytes (an edit that keeps the size and the mtime is found too). On a difference the file is read again
    line by line against the CRC-32 pass 1 kept of each request line, to name the first line that differs.
    Parses nothing."""
    try:
        before = _stat(path)
        if before == (seen.size, seen.mtime_ns) and _file_crc(path) == seen.file_crc and _stat(path) == before:
            return  # the fast path: the same bytes, read in large blocks, nothing split into lines
        crcs = iter(seen.line_crcs)
        n = 0
        for line_no, data in request_lines(path, limits=opts.limits):
            if n >= seen.requests:
                raise _changed(path, f"it now has more than the {seen.requests} requests validated")
            if data is None or crc32(data) != next(crcs):
                raise _changed(path, f"line {line_no} is not what was validated")
            n += 1
        if n != seen.requests:
            raise _changed(path, f"it now has {n} requests, {seen.requests} were validated")
        # the lines first, so an edit is named by its line; then what an edit of no request line changes
        if before != (seen.size, seen.mtime_ns):
            raise _changed(path, "its size or modification time is not what was validated")
        if _stat(path) != before:
            raise _changed(path, "its size or modification time changed while it was read")
        raise _changed(path, "its bytes are not the ones validated")  # the same requests, other blank lines
    except OSError as e:
        raise _changed(path, f"it can no longer be read: {e.strerror or e}") from e


def _file_requests(path: Path, opts: SubmitOptions, seen: _Fingerprint, *, as_raw: bool = False
                   ) -> Generator[dict[str, Any] | bytes, None, None]:
    """Pass 2: the request dicts pass 1 validated and spilled, in input order.

    The file is checked (:func:`_check_unchanged`) before the first request and after the last: an edit
    before any job is visible refuses the submit with nothing enqueued; one during staging is found before
    the last commit, and the caller ends the part-visible batch cancelled. What is staged is the validated
    spill either way, never the edited bytes."""
    _check_unchanged(path, opts, seen)
    try:
        for raw in seen.spilled:
            yield _staged_request(raw, with_model=False, as_raw=as_raw)
    except OSError as e:
        raise SubmitRejected(f"{path}: cannot read the submit's temporary files: {e.strerror or e}") from e
    _check_unchanged(path, opts, seen)


def _planned_requests(
    path: Path, opts: SubmitOptions, seen: _Fingerprint, prefixes: PrefixKeys, plan: JobPlan, *,
    with_model: bool = False, as_raw: bool = False,
) -> Generator[dict[str, Any] | bytes, None, None]:
    """Pass 2 with prefix groups: the spilled requests in ``plan``'s job order, each keeping its input index,
    with the same checks of the file as :func:`_file_requests`."""
    _check_unchanged(path, opts, seen)
    try:
        seen.spilled.map()  # read in the plan's order: jumps between groups all the time
        for index in plan.order:
            yield _staged_request(seen.spilled[index], with_model=with_model, as_raw=as_raw)
    except OSError as e:
        raise SubmitRejected(f"{path}: cannot read the submit's temporary files: {e.strerror or e}") from e
    _check_unchanged(path, opts, seen)


def submit_fingerprint(path: Path, opts: SubmitOptions) -> str:
    """What an idempotency key is bound to besides its batch: the file's bytes and every option that
    shapes what is enqueued (model, params, priority, job size and grouping, metadata, completion window,
    output URLs). A second submit with the same key must match it, or it is refused: its file would
    otherwise be silently dropped. The bytes, not the parsed requests, so the check costs one read
    at disk speed; the retention TTL is not part of it (it says how long, not what)."""
    h = hashlib.blake2b(digest_size=16)
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError as e:
        raise SubmitRejected(f"{path}: cannot read the file: {e.strerror or e}") from e
    options = {
        "model": opts.model, "params": opts.params.model_dump(mode="json", exclude_none=True),
        "priority": Priority(opts.priority).value, "batch_size": opts.batch_size, "metadata": opts.metadata,
        "completion_window_s": opts.completion_window_s, "results_url": opts.results_url,
        "blob_url": opts.blob_url, "prefix_groups": opts.prefix_groups,
        "prefix_group_bytes": opts.prefix_group_bytes if opts.prefix_groups else None,
    }
    if opts.endpoint is not None:  # only when given: the fingerprints of submits without it stay what they were
        options["endpoint"] = opts.endpoint.value
    if opts.image_dir is not None:  # only when given: keys bound before image inputs keep their fingerprint
        options["image_dir"] = opts.image_dir
    if opts.reuse_ttl_s is not None:  # only when set: a key bound before issue 47 still matches its re-run
        options["reuse_ttl_s"] = opts.reuse_ttl_s
    h.update(b"\x00" + json.dumps(options, sort_keys=True).encode())
    return f"file:{h.hexdigest()}"


def submit_file(
    path: Path,
    opts: SubmitOptions,
    *,
    client: redis.Redis,
    keys: Keys,
    ttl_s: int,
    validate_progress: Progress | None = None,
    enqueue_progress: Progress | None = None,
    chunk_jobs: int = 256,
    max_job_bytes: int = DEFAULT_MAX_JOB_BYTES,
    prevalidated: Prevalidated | None = None,
) -> tuple[Batch, bool]:
    """Validate and enqueue ``path``. Returns (batch, created); created is False when an
    idempotency key matched an existing batch. ``max_job_bytes`` is LMDQ_MAX_JOB_BYTES: a job the
    workers would refuse unread is refused here, before anything is visible."""
    if not path.is_file():
        raise SubmitRejected(f"{path}: no such file")
    if opts.batch_size < 1:
        raise SubmitRejected(f"--batch-size: expected >= 1, got {opts.batch_size}")
    check_submit_urls(opts.results_url, opts.blob_url)
    if opts.webhook:  # the secret exists before any event can: a deliverer never finds an event it cannot sign
        WebhookStore(client, keys=keys).ensure_secret(opts.webhook_tenant or "default", new_secret())
    ledger = BatchLedger(client, keys=keys, ttl_s=ttl_s, max_job_bytes=max_job_bytes,
                         staging_lease_s=opts.staging_lease_s)
    fingerprint = None
    resume: Batch | None = None
    if opts.idempotency_key:
        fingerprint = submit_fingerprint(path, opts)
        bound = ledger.bound_batch(opts.idempotency_key, fingerprint=fingerprint)
        if bound is not None:
            # issue 44: a batch whose submit died while staging it is resumed by this re-run (same key, same
            # file and options), never returned as if it were whole; any other bound batch is the answer
            if not ledger.resumable(bound):
                return bound, False
            resume = bound

    try:
        foreign = foreign_format(path) if opts.fmt is None else None
        if foreign is not None:
            raise SubmitRejected(foreign_format_message(path, foreign))
        fmt = opts.fmt or detect_format(path)
    except OSError as e:
        raise SubmitRejected(f"{path}: cannot read the file: {e.strerror or e}") from e
    opts.fmt = fmt
    if fmt is InputFormat.text and opts.endpoint is not None and opts.endpoint not in TEXT_ENDPOINTS:
        raise SubmitRejected(f"{opts.endpoint_option}: a text file's lines are plain prompts: expected one of "
                             f"{', '.join(e.value for e in TEXT_ENDPOINTS)}, got {opts.endpoint.value!r} (it needs "
                             "JSONL lines)")
    # what pass 1 keeps per request waits in temporary files until the submit returns or fails: beside the
    # input when it is a copy of one (the client's spool, stdin's temporary file), else in TMPDIR
    spill_dir = str(path.parent) if opts.input_name is not None else None
    with ExitStack() as spills:
        if prevalidated is not None and prevalidated.ok and opts.model is not None and fmt is InputFormat.jsonl:
            seen, model, prefixes, model_line, several = _prevalidated(path, opts, prevalidated)
        else:
            seen, model, prefixes, model_line, several = _validate(path, opts, validate_progress, spills, spill_dir)
        field_name = "body.model" if fmt is InputFormat.openai else "model"
        try:
            check_model_name(model)
        except InvalidModelName as e:
            where = opts.model_option if opts.model is not None else f"{path}:{model_line}: field '{field_name}'"
            raise SubmitRejected(f"{where}: {e}") from e
        total = seen.requests
        if total > opts.limits.max_requests:
            raise SubmitRejected(f"{path}: {total} requests, limit is {opts.limits.max_requests}")
        if not opts.allow_unknown_model:
            known = ledger.known_models(opts.known_models)
            named = list(several.counts) if several is not None else [model]
            unknown = [m for m in named if m not in known]
            if unknown:
                # blamed where each name came from: the --model flag (or LMDQ_MODEL), else the first line
                # whose model / body.model named it; one line per unknown model
                lines_of = several.first_line if several is not None else {model: model_line}
                known_list = ', '.join(sorted(known)) or '(none: nothing registered, no worker started yet)'
                msgs = []
                for m in unknown[: opts.max_errors]:
                    where = f"{path}:{lines_of[m]}: field '{field_name}'" if lines_of.get(m) else opts.model_option
                    way = f", or pass {opts.allow_unknown_hint} to queue anyway" if opts.allow_unknown_hint else ""
                    msgs.append(
                        f"{where}: unknown model {m!r}; known: {known_list}. Register it with "
                        f"`lmdq-producer models add {shlex.quote(m)}` (or start a worker serving it){way}."
                    )
                raise UnknownModel("\n".join(msgs))

        batch_id = new_batch_id()
        now = time.time()
        plan = (plan_jobs(prefixes, opts.batch_size, models=several.ids if several is not None else None)
                if prefixes is not None else None)
        num_jobs = len(plan.sizes) if plan is not None else (total + opts.batch_size - 1) // opts.batch_size
        if resume is not None:
            return _resume(resume, path, opts, ledger, seen, prefixes, plan, several is not None, num_jobs,
                           enqueue_progress, chunk_jobs, fingerprint)
        check_batch_fits(client, requests=total, jobs=num_jobs, input_bytes=seen.size, params=opts.params,
                         results_url=opts.results_url, fraction=opts.memory_fraction)
        try:
            batch = Batch(
                id=batch_id,
                model=model,
                status=BatchStatus.validating,
                input_file=opts.input_name or str(path),
                priority=opts.priority,
                batch_size=opts.batch_size,
                num_jobs=num_jobs,
                prefix_groups=plan is not None,
                params=opts.params,
                request_counts=RequestCounts(total=total),
                model_counts=({m: RequestCounts(total=c) for m, c in several.counts.items()}
                              if several is not None else None),
                metadata=opts.metadata,
                idempotency_key=opts.idempotency_key,
                completion_window_s=opts.completion_window_s,
                deadline=opts.deadline,
                results_url=opts.results_url,
                blob_url=opts.blob_url,
                reuse_ttl_s=opts.reuse_ttl_s,
                webhook=opts.webhook,
                webhook_tenant=opts.webhook_tenant if opts.webhook else None,
                webhook_as=opts.webhook_as if opts.webhook else None,
                created_at=now,
                expires_at=(now + opts.completion_window_s) if opts.completion_window_s else None,
            )
        except ValidationError as e:  # e.g. --metadata over its limits: checked before anything is written
            first = e.errors()[0]
            field_ = ".".join(str(x) for x in first["loc"]) or "batch"
            raise SubmitRejected(f"--{field_}: {first['msg'].removeprefix('Value error, ')}") from e
        if opts.idempotency_key:
            existing_id = ledger.bind_key(opts.idempotency_key, batch_id)
            if existing_id is not None:
                bound = ledger.bound_batch(opts.idempotency_key, fingerprint=fingerprint)
                return bound or ledger.get(existing_id), False
        counter = (_ReuseCount(client, keys, model, opts.params)
                   if opts.reuse_ttl_s is not None and several is None else None)
        # the spill as it is, unless a line's model is in it (no --model: pass 2 drops it) or reuse counting
        # looks at each request's dict
        as_raw = opts.model is not None and (counter is None or counter.found is None)
        if plan is not None and prefixes is not None:
            requests = _planned_requests(path, opts, seen, prefixes, plan, with_model=several is not None,
                                         as_raw=as_raw)
        else:
            requests = _file_requests(path, opts, seen, as_raw=as_raw)
        try:
            if opts.after_validation is not None:
                opts.after_validation()
            batch = ledger.enqueue(batch, counter.counting(requests) if counter is not None else requests,
                                   progress=enqueue_progress, chunk_jobs=chunk_jobs,
                                   job_sizes=plan.sizes if plan is not None else None, fingerprint=fingerprint,
                                   first_jobs=opts.first_jobs, after_first_commit=opts.after_first_commit,
                                   id_chunks=seen.id_chunks.chunks(), gates=opts.gates)
            if counter is not None and counter.found is not None:
                ledger.records.note_reusable(batch.id, counter.found)
                batch = batch.model_copy(update={"reusable": counter.found})
        except BaseException:
            if opts.idempotency_key:  # enqueue's rollback releases it too; this covers a failure before it
                ledger.release_key(opts.idempotency_key, batch_id)
            raise
        finally:
            requests.close()
        return batch, True


class _ReuseCount:
    """Counts, as pass 2 streams the requests to the ledger, how many the reuse index answers now (issue 47:
    ``status`` shows it before anything runs); a chunk of requests is looked up at a time."""

    CHUNK = 1000

    def __init__(self, client: redis.Redis, keys: Keys, model: str, params: GenerationParams) -> None:
        from lmdq.reuse.index import ReuseIndex
        from lmdq.reuse.store import ReuseStore

        self.index = ReuseIndex(ReuseStore(client, keys=keys))
        self.model = model
        self.params = params
        self.found: int | None = 0 if self.index.store.published(model) is not None else None

    def _add(self, chunk: list[Request]) -> None:
        if self.found is not None and chunk:
            self.found += self.index.known(self.model, chunk, self.params) or 0
        chunk.clear()

    def counting(self, requests: Iterator[dict[str, Any] | bytes]) -> Iterator[dict[str, Any] | bytes]:
        chunk: list[Request] = []
        for d in requests:
            yield d
            if self.found is None or type(d) is not dict:
                continue
            try:
                chunk.append(Request.model_validate({k: v for k, v in d.items() if k != "model"}))
            except ValidationError:
                continue  # not one this build can key: counted as not reusable
            if len(chunk) >= self.CHUNK:
                self._add(chunk)
        self._add(chunk)


def _resume(
    batch: Batch, path: Path, opts: SubmitOptions, ledger: BatchLedger, seen: _Fingerprint,
    prefixes: PrefixKeys | None, plan: JobPlan | None, with_model: bool, num_jobs: int,
    enqueue_progress: Progress | None, chunk_jobs: int, fingerprint: str | None,
) -> tuple[Batch, bool]:
    """Finish staging ``batch``, which the same submit (same key, same file and options: its fingerprint)
    left part-staged when it died: once its staging lease lapsed, take it over and stage the jobs that are
    not visible yet, from the file validated again. Returns (batch, False): it was not created here. A batch
    another submit still stages, or that was ended meanwhile, is returned as it is."""
    if seen.requests != batch.request_counts.total or num_jobs != batch.num_jobs:
        raise SubmitRejected(f"{path}: batch {batch.id} (its idempotency key's) counts {batch.request_counts.total} "
                             f"requests in {batch.num_jobs} jobs, this submit {seen.requests} in {num_jobs}; "
                             "nothing was enqueued")
    as_raw = opts.model is not None
    if plan is not None and prefixes is not None:
        requests = _planned_requests(path, opts, seen, prefixes, plan, with_model=with_model, as_raw=as_raw)
    else:
        requests = _file_requests(path, opts, seen, as_raw=as_raw)
    try:
        done = ledger.enqueue(batch, requests, progress=enqueue_progress, chunk_jobs=chunk_jobs,
                              job_sizes=plan.sizes if plan is not None else None, fingerprint=fingerprint,
                              first_jobs=opts.first_jobs, resume=True)
    except StagingLeaseLost:
        return ledger.get(batch.id), False
    finally:
        requests.close()
    return done, False
