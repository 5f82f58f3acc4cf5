"""lmdq.batches.headroom: the footprint estimate and the maxmemory check against a real redis-server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from lmdq.batches import headroom
from lmdq.batches.headroom import Footprint, check_batch_fits, check_headroom, estimate, redis_memory
from lmdq.contract import GenerationParams
from lmdq.errors import ExitCode, SubmitRejected


def test_estimate_with_and_without_a_sink() -> None:
    no_sink = estimate(requests=10, jobs=2, input_bytes=1000, max_new_tokens=50, sink=False)
    assert no_sink.prompts == 1000 + 2 * headroom.JOB_HASH_BYTES
    assert no_sink.results == 10 * (headroom.RESULT_RECORD_BYTES + 50 * headroom.TEXT_BYTES_PER_TOKEN)
    sink = estimate(requests=10, jobs=2, input_bytes=1000, max_new_tokens=50, sink=True)
    assert sink.results == 10 * headroom.SINK_BYTES_PER_REQUEST
    assert sink.total == sink.prompts + sink.results < no_sink.total


@pytest.fixture()
def capped(own_redis: str) -> Iterator[tuple[redis.Redis, int]]:
    """This module's own server with a maxmemory a little above what it uses now (restored after). Not the
    shared one: what earlier tests left there (hundreds of MB under a 4-runner suite) put "used" above the
    90 % that submit stops at, so a batch of any size was refused."""
    client = redis.Redis.from_url(own_redis)
    old = client.config_get("maxmemory")["maxmemory"]
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used + 10_000_000)
    try:
        yield client, used
    finally:
        client.config_set("maxmemory", old)


def test_a_batch_that_fits_passes_and_one_that_does_not_is_refused(capped: tuple[redis.Redis, int]) -> None:
    client, _ = capped
    mem = redis_memory(client)
    assert mem is not None and mem.maxmemory > mem.used > 0
    check_headroom(client, Footprint(prompts=1000, results=1000), sink=False)
    with pytest.raises(SubmitRejected) as e:
        check_headroom(client, Footprint(prompts=5_000_000, results=6_000_000), sink=False)
    msg = str(e.value)
    assert "nothing was enqueued" in msg and "--results-url" in msg and "\n" not in msg
    assert e.value.exit_code == ExitCode.bad_input
    with pytest.raises(SubmitRejected, match="--result-ttl") as e2:
        check_headroom(client, Footprint(prompts=11_000_000, results=0), sink=True)
    assert "--results-url" not in str(e2.value)


def test_fraction_zero_or_no_maxmemory_skips_the_check(capped: tuple[redis.Redis, int]) -> None:
    client, _ = capped
    check_headroom(client, Footprint(prompts=10**12, results=0), fraction=0, sink=False)
    client.config_set("maxmemory", 0)
    check_headroom(client, Footprint(prompts=10**12, results=0), sink=False)


def test_check_batch_fits_counts_samples(capped: tuple[redis.Redis, int]) -> None:
    client, _ = capped
    # 1000 requests x 1000 tokens x 4 bytes: ~5 MB of text, fits; with n=4 samples each it does not
    check_batch_fits(client, requests=1000, jobs=1, input_bytes=0, params=GenerationParams(max_new_tokens=1000),
                     results_url=None)
    with pytest.raises(SubmitRejected):
        check_batch_fits(client, requests=1000, jobs=1, input_bytes=0,
                         params=GenerationParams(max_new_tokens=1000, n=4), results_url=None)
    check_batch_fits(client, requests=1000, jobs=1, input_bytes=0, params=GenerationParams(max_new_tokens=1000, n=4),
                     results_url="file:///tmp/x")
