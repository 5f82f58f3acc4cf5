"""Prefix-aware job formation: requests that share a long prompt prefix go into the same jobs.

Why: an engine with prefix caching (LMDeploy's ``--enable-prefix-caching``) prefills a shared
prefix once and reuses its KV blocks while they stay in its cache. A file of questions about
documents, shuffled, makes a FIFO queue visit every document many times, far apart: with a KV
cache smaller than the documents, each visit prefills the document again. Grouped, a document's
questions run back to back in one job (one worker), and its prefix is prefilled about once.

How (no tokenizer: the producer must not need torch or transformers). The chat template renders
messages in order, so text common to the start of two requests' messages (roles and contents in
order) is a common start of their rendered prompts; for a plain prompt the text itself. Pass 1 hashes that
text's first ``L`` bytes (UTF-8) at six lengths ``L`` = 1, 2, 4, ... 32 × ``LMDQ_PREFIX_GROUP_BYTES``
(default 512: 512 B to 16 KiB, ~128 to ~4k tokens), one running blake2b over the bytes, 40 bits a
key, 0 when the text is shorter. A request's group is the DEEPEST length whose key it shares with
at least one other request: a long system prompt common to the whole file is then not mistaken for
the group, the document after it is. Requests that share nothing stay singletons. A key collision
only merges two groups (a performance hint gone slightly wrong); it never changes a request.

Then (:func:`plan_jobs`): groups in the order of their first request, each group's requests in
input order, packed next-fit into jobs of at most ``batch_size``: a group that fits in a job never
straddles two (it starts a new job instead); a group bigger than a job fills consecutive jobs.
Without any shared prefix the plan is ``None`` and jobs are cut in input order exactly as before.

Several models in one batch (each line's ``model``): jobs never mix models. The model's name is hashed
ahead of the prompt, so a group never spans two models; each model's requests are packed as above on
their own, and the models' jobs are then interleaved (job 1 of each model, job 2 of each, ...) so
every model's workers start as soon as the first jobs are visible.

Cost: hashing at most 16 KiB a line in pass 1; 12 bytes a request (offset, line number) on disk
(:class:`lmdq.submission.spill.SpillArray`: memory flat in the rows, issue 44), and in memory 8 bytes a key
per length reached (only prompts of at least ``LMDQ_PREFIX_GROUP_BYTES`` have any) and, once a plan is
made, 4 to 8 bytes a request for its order; sorts of 64-bit integers after pass 1: O(n log n). Each
request keeps its input index and custom_id, so results and exports keep input order.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from lmdq.contract import Endpoint
from lmdq.submission.formats import ParsedLine
from lmdq.submission.spill import SpillArray

__all__ = ["IMAGE_PREFIX_BYTES", "LEVELS", "JobPlan", "PrefixKeys", "plan_jobs", "prefix_text"]

#: the prefix lengths hashed, in bytes, as multiples of the shortest (``LMDQ_PREFIX_GROUP_BYTES``)
LEVELS = (1, 2, 4, 8, 16, 32)
_INDEX_BITS = 24  # request index bits in a sort key: grouping plans files of fewer than 2**24 requests
_MAX_REQUESTS = (1 << _INDEX_BITS) - 1
_MEMBER = 0xFFFFFFFF  # run_at mark: a group member that is not its group's first request


def prefix_text(item: ParsedLine, limit: int) -> str:
    """The start (at most ``limit`` characters) of what the engine renders for ``item``, minus the
    template's own tokens: endpoint, then each message's role and text in order. A chat ``prompt``
    is rendered as one user message, so it is written as one."""
    if item.messages is None:
        prompt: str = item.prompt or ""
        if item.endpoint in (Endpoint.completion, Endpoint.score, Endpoint.embedding):  # raw text too
            return "P\x1d" + prompt[:limit]
        return ("C\x1duser\x1f" + prompt[:limit])[:limit]
    parts = ["C\x1d"]
    size = 2
    for m in item.messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(_image_stand_in(p) if p.get("type") == "image_url" else str(p.get("text", ""))
                              for p in content if isinstance(p, dict))
        piece = f"{m.get('role')}\x1f{content}\x1e"
        parts.append(piece)
        size += len(piece)
        if size >= limit:
            break
    return "".join(parts)[:limit]


IMAGE_PREFIX_BYTES = 1024
"""What one image part weighs in a prompt's prefix text (issue 48): a vision-language model puts hundreds of
tokens per image in the prompt (576 for LLaVA-1.5), so an image is a long prefix: two requests over the same
image first (several questions about one picture) share at least 1 KiB (two levels at the default
``LMDQ_PREFIX_GROUP_BYTES``) and are grouped into the same jobs; different images diverge at once. Where an
engine caches prefixes, that keeps one image's vision tokens hot; everywhere, the worker reads an image named
twice in a job once (worker/images.py). (LMDeploy 0.18 turns prefix caching off for VL models itself.)"""


def _image_stand_in(part: dict[str, Any]) -> str:
    """An image part in the prefix text: its reference's hash, repeated to IMAGE_PREFIX_BYTES (never its bytes)."""
    img = part.get("image_url")
    url = img.get("url") if isinstance(img, dict) else None
    tag = "\x1c" + hashlib.blake2b(str(url).encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return (tag * (IMAGE_PREFIX_BYTES // len(tag) + 1))[:IMAGE_PREFIX_BYTES]


class PrefixKeys:
    """What pass 1 keeps per request for grouping: its file offset and line number (12 bytes, on disk
    in ``directory``: :class:`SpillArray`), and a key per length its prompt reaches (8 bytes each, in
    memory; ``keys[j][i]`` absent or 0: request i's prompt is shorter than ``lengths[j]``, so a file of
    short prompts keeps nothing per request in memory). :meth:`close` deletes the files."""

    def __init__(self, min_bytes: int, *, group: bool = True, directory: str | None = None) -> None:
        #: hash prefixes (prefix grouping on); off: only offsets and line numbers are kept (what a batch
        #: over several models needs to read its requests back model by model)
        self.group = group
        self.lengths = tuple(min_bytes * m for m in LEVELS)
        self.keys = [array("Q") for _ in self.lengths]
        self.offsets = SpillArray("Q", directory)
        self.line_nos = SpillArray("I", directory)

    def close(self) -> None:
        self.offsets.close()
        self.line_nos.close()

    def add(self, offset: int, item: ParsedLine, model: str | None = None) -> None:
        """Record request ``item``; ``model``: the model it runs on when the batch has several (None:
        the batch's one model), hashed first so requests of two models never share a key."""
        index = len(self.offsets)
        self.offsets.append(offset)
        self.line_nos.append(item.line_no)
        if not self.needs_key(item):
            return
        text = prefix_text(item, self.lengths[-1])
        if len(text) * 4 < self.lengths[0]:  # shorter than the shortest length even at 4 bytes a character
            return
        data = memoryview(text.encode("utf-8", "surrogatepass"))
        n = len(data)
        h = hashlib.blake2b(digest_size=5)
        if model is not None:
            h.update(f"{model}\x00".encode())
        pos = 0
        for length, keys in zip(self.lengths, self.keys):
            if n < length:
                return
            h.update(data[pos:length])  # one pass over the bytes: each length's hash extends the last
            pos = length
            if len(keys) < index:  # a level's array grows only once some prompt reaches it: zeros before
                keys.frombytes(bytes(keys.itemsize * (index - len(keys))))
            keys.append(int.from_bytes(h.copy().digest(), "little") or 1)

    def add_unkeyed(self, offsets: array[int], line_nos: array[int]) -> None:
        """Record requests too short for any key (or with grouping off) at once: their offsets and line
        numbers only, as :meth:`add` keeps for them."""
        self.offsets.extend(offsets)
        self.line_nos.extend(line_nos)

    def needs_key(self, item: ParsedLine) -> bool:
        """Whether :meth:`add` may key ``item`` (else :meth:`add_unkeyed` records it as :meth:`add` would): a
        raw prompt's prefix text is at most 7 characters more than the prompt, so a short one gets no key."""
        return self.group if item.messages is not None else not self.unkeyed(len(item.prompt or "") + 7)

    def unkeyed(self, chars: int) -> bool:
        """Whether a request whose prefix text is at most ``chars`` characters gets no key (:meth:`add`)."""
        return not self.group or chars * 4 < self.lengths[0]

    def __len__(self) -> int:
        return len(self.offsets)


@dataclass(frozen=True)
class JobPlan:
    """Request indices in job order, and how many of them each job takes."""

    order: array[int]
    sizes: array[int]
    groups: int  # groups of two or more requests found


def _sorted(values: array[int], run: int = 1 << 16) -> Iterator[int]:
    """``values`` in ascending order in flat memory: sort runs in place, then merge them lazily
    (``sorted(values)`` would build a Python int per request)."""
    for s in range(0, len(values), run):
        values[s : s + run] = array("Q", sorted(values[s : s + run]))
    view = memoryview(values)
    return heapq.merge(*(iter(view[s : s + run]) for s in range(0, len(values), run)))


def plan_jobs(prefixes: PrefixKeys, batch_size: int, models: Iterable[int] | None = None) -> JobPlan | None:
    """The job layout for the requests ``prefixes`` saw (see the module docstring), or ``None`` when
    no two requests share a prefix (or the file is too big to plan): jobs in input order then.

    ``models``: the batch runs on several models, ``models[i]`` being request i's (0, 1, ...): a plan
    is always made then, and no job mixes two models."""
    n = len(prefixes)
    if models is not None:
        return _plan_by_model(prefixes, batch_size, models)
    if n > _MAX_REQUESTS or n < 2 or not any(prefixes.keys):  # no prompt long enough: nothing to group
        return None
    marks = _group_marks(prefixes, n)
    if not marks.starts:
        return None
    packer = _Packer(batch_size, marks)
    packer.pack(range(n))
    return JobPlan(order=packer.order, sizes=packer.close(), groups=len(marks.starts) - 1)


@dataclass(frozen=True)
class _Marks:
    """Each request's group mark (``run_at``: 0 singleton, r+1 first request of group r, _MEMBER other
    member) and the groups' members (group r is ``members[starts[r]:starts[r+1]]``)."""

    run_at: array[int]
    members: array[int]
    starts: array[int]


def _group_marks(prefixes: PrefixKeys, n: int) -> _Marks:
    if not any(prefixes.keys):  # no prompt reaches the shortest length: no groups, and no 4 bytes a request
        return _Marks(run_at=array("I"), members=array("I"), starts=array("I"))
    run_at = array("I", bytes(4 * n))  # 0: singleton; r+1: first request of group r; _MEMBER: other member
    members = array("I")
    starts = array("I")
    mask = (1 << _INDEX_BITS) - 1
    for keys in reversed(prefixes.keys if n <= _MAX_REQUESTS else []):  # deepest length first
        tagged = array("Q", ((k << _INDEX_BITS) | i for i, k in enumerate(keys) if k and not run_at[i]))
        prev_key = -1
        run: list[int] = []

        def close(run: list[int]) -> None:
            if len(run) < 2:
                return
            run_at[run[0]] = len(starts) + 1
            for i in run[1:]:
                run_at[i] = _MEMBER
            starts.append(len(members))
            members.extend(run)

        for v in _sorted(tagged):
            k = v >> _INDEX_BITS
            if k != prev_key:
                close(run)
                run = []
                prev_key = k
            run.append(v & mask)
        close(run)
    if starts:
        starts.append(len(members))
    return _Marks(run_at=run_at, members=members, starts=starts)


class _Packer:
    """Next-fit packing of requests (in the order given, each group whole at its first request) into jobs
    of at most ``batch_size``; a group that fits in a job never straddles two."""

    def __init__(self, batch_size: int, marks: _Marks) -> None:
        self.batch_size = batch_size
        self.marks = marks
        self.order = array("I")
        self.sizes = array("I")
        self.fill = 0

    def _take(self, indices: Any) -> None:
        for i in indices:
            if self.fill == self.batch_size:
                self.sizes.append(self.fill)
                self.fill = 0
            self.order.append(i)
            self.fill += 1

    def pack(self, indices: Any) -> None:
        m = self.marks
        for i in indices:
            mark = m.run_at[i] if m.starts else 0
            if mark == _MEMBER:
                continue
            if mark == 0:
                self._take((i,))
                continue
            group = memoryview(m.members)[m.starts[mark - 1] : m.starts[mark]]
            if len(group) <= self.batch_size and self.fill + len(group) > self.batch_size and self.fill:
                self.sizes.append(self.fill)  # it fits in a job of its own: don't split it across two
                self.fill = 0
            self._take(group)

    def close(self) -> array[int]:
        if self.fill:
            self.sizes.append(self.fill)
            self.fill = 0
        return self.sizes


def _plan_by_model(prefixes: PrefixKeys, batch_size: int, models: Iterable[int]) -> JobPlan:
    """:func:`plan_jobs` for a batch over several models: each model's requests packed on their own (its
    groups are its own: the model is hashed into every key), then the models' jobs interleaved."""
    n = len(prefixes)
    marks = _group_marks(prefixes, n)
    per_model: list[array[int]] = []
    for i, m in enumerate(models):
        while len(per_model) <= m:
            per_model.append(array("I"))
        per_model[m].append(i)
    jobs: list[list[memoryview]] = []  # per model: its jobs' request indices
    for indices in per_model:
        packer = _Packer(batch_size, marks)
        packer.pack(indices)
        sizes = packer.close()
        view = memoryview(packer.order)
        out, pos = [], 0
        for size in sizes:
            out.append(view[pos : pos + size])
            pos += size
        jobs.append(out)
    order = array("I")
    sizes = array("I")
    for k in range(max((len(j) for j in jobs), default=0)):
        for model_jobs in jobs:
            if k < len(model_jobs):
                order.extend(model_jobs[k])
                sizes.append(len(model_jobs[k]))
    return JobPlan(order=order, sizes=sizes, groups=max(0, len(marks.starts) - 1))
