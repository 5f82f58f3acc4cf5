"""Will a batch fit in Redis? ``submit`` asks before it writes anything.

A Redis under ``maxmemory`` with ``noeviction`` (what lmdq needs: an evicted job or result is lost
work) refuses writes once full. A producer that enqueues a batch too big for it fills it: workers
then hold answers they cannot store, and every other batch stops too. So ``submit`` reads INFO memory
and refuses (exit 2, nothing enqueued) a batch whose estimated footprint would take Redis past a
safety fraction of ``maxmemory``, naming the ways out: a results sink (``LMDQ_RESULTS_URL`` /
``--results-url``), a shorter ``--result-ttl``, or a bigger Redis.

The estimate is deliberately simple and on the safe side (docs/deploy.md, "Sizing Redis", has the
measurements behind the constants):

- prompts: the input file's size (a job hash stores the requests zlib-compressed, so usually less),
  plus an RQ job hash's own overhead per job, for as long as the batch is kept;
- results without a sink: per request, a final record's fixed part plus ``max_new_tokens`` x 4 bytes
  of text (the batch's own ``max_new_tokens``, or the engines' default), kept until the TTL;
- results with a sink: per request, what the shard index and the unflushed jobs cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmdq.contract import GenerationParams
from lmdq.errors import SubmitRejected

if TYPE_CHECKING:  # redis is imported where Redis is talked to: ProducerSettings reads DEFAULT_FRACTION
    import redis  # at CLI start-up, and `lmdq-producer --help` imports no Redis client (issue 49)

__all__ = ["Footprint", "RedisMemory", "check_batch_fits", "check_headroom", "estimate", "redis_memory"]

RESULT_RECORD_BYTES = 900
"""Redis bytes of one final result record without its text (ids, counts, timings, hash overhead); the
sim engine's measured records run ~1,050 bytes with ~150 bytes of text (issue 17)."""

TEXT_BYTES_PER_TOKEN = 4
"""Bytes of generated text per token (English BPE tokens average ~4 characters)."""

SINK_BYTES_PER_REQUEST = 100
"""What a request costs Redis with a results sink once its job is flushed (measured bound, see
tests/test_results_retention.py and ``lmdq-bench sink``)."""

JOB_HASH_BYTES = 700
"""An RQ job hash's own fields (status, origin, timestamps, ...) beside the compressed requests."""

DEFAULT_FRACTION = 0.9
"""The share of ``maxmemory`` a submit may take Redis to (LMDQ_MEMORY_HEADROOM_FRACTION)."""


@dataclass(frozen=True)
class Footprint:
    """A batch's estimated Redis bytes."""

    prompts: int
    results: int

    @property
    def total(self) -> int:
        return self.prompts + self.results


@dataclass(frozen=True)
class RedisMemory:
    used: int
    maxmemory: int


def estimate(*, requests: int, jobs: int, input_bytes: int, max_new_tokens: int, sink: bool) -> Footprint:
    """The footprint of a batch of ``requests`` in ``jobs`` read from ``input_bytes`` of file."""
    per_result = SINK_BYTES_PER_REQUEST if sink else RESULT_RECORD_BYTES + TEXT_BYTES_PER_TOKEN * max_new_tokens
    return Footprint(prompts=input_bytes + JOB_HASH_BYTES * jobs, results=requests * per_result)


def redis_memory(client: redis.Redis) -> RedisMemory | None:
    """INFO memory's ``used_memory`` and ``maxmemory``, or None where INFO is not allowed (some
    managed services rename or restrict it: the check is then skipped, not the submit)."""
    import redis

    from lmdq.redis import server

    try:
        info = server.memory_info(client)
    except redis.ResponseError:
        return None
    try:
        return RedisMemory(used=int(info.get("used_memory", 0)), maxmemory=int(info.get("maxmemory", 0)))
    except (TypeError, ValueError):
        return None


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def check_headroom(client: redis.Redis, need: Footprint, *, fraction: float = DEFAULT_FRACTION,
                   sink: bool) -> None:
    """Raise :class:`SubmitRejected` (one line, exit 2) when ``need`` would take Redis past
    ``fraction`` of its ``maxmemory``; a Redis without ``maxmemory`` (0) is not checked, nor is any with
    ``fraction`` 0 (the operator's way to trust Redis' own refusal, exit 5, over this estimate)."""
    if fraction <= 0:
        return
    mem = redis_memory(client)
    if mem is None or mem.maxmemory <= 0:
        return
    limit = int(mem.maxmemory * fraction)
    if mem.used + need.total <= limit:
        return
    way_out = ("shorten its retention with --result-ttl (or lower LMDQ_RESULT_TTL_S) or split the file"
               if sink else
               "send its results to a sink with LMDQ_RESULTS_URL or --results-url, shorten their retention "
               "with --result-ttl")
    raise SubmitRejected(
        f"this batch would not fit in Redis: it needs about {_mb(need.total)} (prompts {_mb(need.prompts)}, "
        f"results {_mb(need.results)}) and Redis uses {_mb(mem.used)} of its {_mb(mem.maxmemory)} maxmemory "
        f"(submit stops at {fraction:.0%}); nothing was enqueued. To go ahead, {way_out}, or raise maxmemory"
    )


def check_batch_fits(client: redis.Redis, *, requests: int, jobs: int, input_bytes: int, params: GenerationParams,
                     results_url: str | None, fraction: float = DEFAULT_FRACTION) -> None:
    """``submit``'s one call: estimate the batch (:func:`estimate`) and :func:`check_headroom` it."""
    sink = bool(results_url)
    p = params.resolved()
    # a result holds n samples (params.n, the batch's own: per-line n is not known here)
    need = estimate(requests=requests, jobs=jobs, input_bytes=input_bytes,
                    max_new_tokens=int(p["max_new_tokens"]) * int(p["n"] or 1), sink=sink)
    check_headroom(client, need, fraction=fraction, sink=sink)
