"""Idle workers share a small batch (lmdq.jobs.idle_roster, worker.admission.fair_share): with two idle
workers a 4-job batch runs 2 + 2 and ends in about half the one-worker time. Time is counted in the
sim engines' decode steps (each engine steps only while it has sequences), never on the wall clock:
the batch's makespan is the busiest engine's step count."""

from __future__ import annotations

import uuid

import pytest
import redis

from lmdq.contract import BatchStatus
from lmdq.redis.keys import Keys
from lmdq.worker.admission import fair_share
from tests.faultkit import wait_for
from tests.helpers import ThreadWorker, wait_batch
from tests.test_idle import MODEL, _blocked, _enqueue

TOKENS = 40  # decode steps per request
SLOTS = 8  # engine slots: one worker's engine holds 2 of the 4 jobs at a time


def _worker(url: str, prefix: str) -> ThreadWorker:
    """A real worker (sim engine of SLOTS slots, 10 ms steps) in a thread of this process."""
    return ThreadWorker(url, prefix, model=MODEL, step_ms=10, max_batch=SLOTS, idle_wait_s=30.0)


def _run(redis_url: str, n_workers: int) -> list[tuple[int, int]]:
    """A 16-request batch in 4 jobs for ``n_workers`` idle workers: (jobs, decode steps) of each.

    The first worker first runs a one-job warm-up, so it knows the job size (4) and has room for all
    4 jobs in ONE claim (bd9ca4b then took them all, every time); it blocked on its wake list before
    the others, so it is the one the batch's token wakes."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    client = redis.Redis.from_url(redis_url)
    workers = [_worker(redis_url, prefix)]
    try:
        wait_for(lambda: _blocked(client) == 1, 60, "the first worker to block on its wake list")
        warm = _enqueue(client, prefix, 4, batch_size=4, tokens=1)
        assert wait_batch(client, prefix, warm, timeout=60).status is BatchStatus.completed
        wait_for(lambda: _blocked(client) == 1, 60, "the first worker to block again")
        workers += [_worker(redis_url, prefix) for _ in range(n_workers - 1)]
        # every worker idle: blocked on its wake list (so in the roster, entered just before) before the submit
        wait_for(lambda: _blocked(client) == n_workers, 60, "the workers to block on their wake list")
        before = [(w.jobs, w.engine.steps) for w in workers]
        bid = _enqueue(client, prefix, 16, batch_size=4, tokens=TOKENS)
        assert wait_batch(client, prefix, bid, timeout=120).status is BatchStatus.completed
    finally:
        for w in workers:
            w.stop()
    return [(w.jobs - j, w.engine.steps - st) for w, (j, st) in zip(workers, before)]


def test_two_idle_workers_split_a_four_job_batch_and_halve_its_time(own_redis: str) -> None:
    """bd9ca4b: the first worker woken claimed all 4 jobs, the second got none, and the batch took two
    waves of its 8-slot engine either way (one worker: 81 steps; two: [81, 0])."""
    ((jobs, one_steps),) = _run(own_redis, 1)
    assert jobs == 4 and one_steps >= 2 * TOKENS  # 16 requests through 8 slots: two waves
    pair = _run(own_redis, 2)
    assert sorted(j for j, _ in pair) == [2, 2], pair
    makespan = max(st for _, st in pair)
    print(f"one worker: {one_steps} steps; two workers: {[st for _, st in pair]} steps "
          f"(makespan ratio {makespan / one_steps:.2f})")
    assert makespan <= 0.6 * one_steps, (makespan, one_steps)


CASES = [
    (8, 0, 4, 1, 2),  # the small batch: half each
    (8, 2, 2, 1, 0),  # took its half: the rest waits for the idle peer
    (8, 0, 2, 0, 8),  # nobody idle: as before
    (8, 0, 1, 3, 1),  # holding nothing: at least one job
    (64, 0, 3125, 1, 64),  # a large batch: the share is larger than any claim
    (8, 0, 0, 1, 0),  # nothing visible
    (8, 1, 5, 2, 1),  # ceil((5 + 1) / 3) - 1
]


@pytest.mark.parametrize(("room", "held", "visible", "idle", "share"), CASES)
def test_fair_share(room: int, held: int, visible: int, idle: int, share: int) -> None:
    assert fair_share(room, held=held, visible=visible, idle_peers=idle) == share


@pytest.mark.parametrize(("room", "held", "visible", "idle", "share"), CASES)
def test_the_claim_script_takes_the_same_fair_share(redis_url: str, prefix: str, room: int, held: int,
                                                    visible: int, idle: int, share: int) -> None:
    """Issue 49: the share is judged inside the claim's own script (no round trip of its own before each
    claim); it must be fair_share's, over the same counts: idle peers in the roster (this worker's own entry
    and an expired one do not count) and the jobs visible on the model's queues."""
    from lmdq.jobs.idle_roster import IdleRoster
    from lmdq.jobs.queue import FairShare, JobQueue
    from lmdq.redis.keys import queue_names, rq_queue_key

    client = redis.Redis.from_url(redis_url)
    keys = Keys(prefix)
    me = IdleRoster(client, keys=keys, model=MODEL, name="me", ttl_s=60)
    me.enter(0.0)  # this worker is in the roster too (it was idle): never its own peer
    for i in range(idle):
        IdleRoster(client, keys=keys, model=MODEL, name=f"peer{i}", ttl_s=60).enter(0.0)
    client.zadd(me.key, {"gone": 1.0})  # an entry whose TTL ran out long ago
    queues = queue_names(MODEL, prefix)
    if visible:
        client.rpush(rq_queue_key(queues[1]), *[f"job{i}" for i in range(visible)])
    claims, got = JobQueue(client, keys=keys).claim_fair(queues, model=MODEL, worker="me", lease_s=30, n=room,
                                                         fair=FairShare(roster=me.key, member="me", held=held))
    assert got == share and len(claims) == min(share, visible)


def test_a_worker_leaves_the_roster_when_it_gets_work_and_when_it_stops(redis_url: str, prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    key = Keys(prefix).idle(MODEL)
    w = _worker(redis_url, prefix)
    try:
        wait_for(lambda: client.zscore(key, w.worker.name) is not None, 60, "the worker to go idle")
        assert 0 < client.ttl(key) <= 60  # the roster key expires by itself too
        bid = _enqueue(client, prefix, 4, batch_size=4, tokens=200)
        wait_for(lambda: w.jobs > 0 or client.zscore(key, w.worker.name) is None, 60, "the worker to claim")
        assert client.zscore(key, w.worker.name) is None  # busy: not idle for the others
        assert wait_batch(client, prefix, bid, timeout=60).status is BatchStatus.completed
        wait_for(lambda: client.zscore(key, w.worker.name) is not None, 60, "the worker to go idle again")
    finally:
        w.stop()
    assert client.zscore(key, w.worker.name) is None

