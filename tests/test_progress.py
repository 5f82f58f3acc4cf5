"""Batch progress (src/lmdq/submission/progress.py) on a real Redis: in a log, a line when something changed or
every --interval (never one per poll), with done/total, requests/s, tokens/s, ETA, and a hint when no
live worker serves the model. The clock is injected, so throttling is checked without waiting."""

from __future__ import annotations

import io
import time

import redis

from lmdq.contract import Batch, BatchStatus, RequestCounts, Result, ResultStatus
from lmdq.redis.keys import Keys
from lmdq.registry.store import ModelRegistry, WorkerRegistry
from lmdq.results.store import ResultStore
from lmdq.submission.progress import BatchProgress, RateWindow, format_duration, watch


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _batch(store: ResultStore, total: int, model: str = "sim") -> str:
    bid = f"batch_{time.time_ns():024x}"[:30]
    store.batches.create(Batch(id=bid, model=model, status=BatchStatus.in_progress, batch_size=8,
                             request_counts=RequestCounts(total=total), created_at=time.time()))
    return bid


def _done(store: ResultStore, bid: str, i: int, tokens: int = 5) -> None:
    assert store.write_result(Result(batch_id=bid, custom_id=str(i), index=i, status=ResultStatus.completed,
                                     model="sim", generate_token_len=tokens))


def _progress(client: redis.Redis, prefix: str, clock: Clock, interval: float = 30.0) -> tuple[BatchProgress,
                                                                                           io.StringIO]:
    out = io.StringIO()
    p = BatchProgress(store=ResultStore(client, keys=Keys(prefix)), models=ModelRegistry(client, keys=Keys(prefix)),
                      stream=out, terminal=False, interval_s=interval, clock=clock, wall=lambda: 0.0)
    return p, out


def test_a_log_gets_a_line_per_change_of_status_or_interval_not_per_poll(client: redis.Redis, prefix: str) -> None:
    store = ResultStore(client, keys=Keys(prefix))
    WorkerRegistry(client, keys=Keys(prefix), name="w1", model="sim", ttl_s=60).register(pid=1)  # a live worker
    bid = _batch(store, 20)
    clock = Clock()
    p, out = _progress(client, prefix, clock)
    p.update(store.batches.get(bid))
    assert p.lines == 1
    for i in range(10):  # ten polls a second apart, one result each: progress, but no status change
        clock.t += 1
        _done(store, bid, i)
        p.update(store.batches.get(bid))
    assert p.lines == 1, out.getvalue()
    for _ in range(19):  # nothing at all changes for 19 more polls
        clock.t += 1
        p.update(store.batches.get(bid))
    assert p.lines == 1, out.getvalue()
    clock.t += 1  # 30 s after the first line: the interval has passed
    p.update(store.batches.get(bid))
    assert p.lines == 2, out.getvalue()
    line = out.getvalue().splitlines()[-1]
    # 10 done over the 30 s window: 0.3 req/s, 50 tokens: 1.7 tok/s; 10 left at 1/3 a second: ETA 30 s
    assert f" {bid} in_progress 10/20 done (50.0%) 0.3 req/s  1.7 tok/s  ETA 30s elapsed=30s" in line, line
    for i in range(10, 20):
        _done(store, bid, i)
    clock.t += 1
    b = store.batches.get(bid)
    assert b.status is BatchStatus.completed
    p.update(b)
    p.update(b)  # the end is said once
    assert p.lines == 3
    assert " completed 20/20 done (100.0%) " in out.getvalue().splitlines()[-1]
    assert "  done elapsed=31s" in out.getvalue().splitlines()[-1]


def test_a_batch_no_live_worker_serves_says_so(client: redis.Redis, prefix: str) -> None:
    """Registered or seen before, but nobody serves it now: the line says what to do, once."""
    store = ResultStore(client, keys=Keys(prefix))
    ModelRegistry(client, keys=Keys(prefix)).add("llama-70b")
    bid = _batch(store, 8, model="llama-70b")
    clock = Clock()
    p, out = _progress(client, prefix, clock, interval=5)
    for _ in range(12):
        p.update(store.batches.get(bid))
        clock.t += 1
    lines = out.getvalue().splitlines()
    hints = [ln for ln in lines if ln.startswith("hint: ")]
    assert hints == ["hint: no live worker serves model 'llama-70b': its requests wait until one starts "
                     "(lmdq-worker --served-model-name llama-70b ...; see `lmdq-producer models list`)"], lines
    assert len(lines) == 1 + 3  # the first line and its hint, then one per 5 s interval (t=5, t=10)
    # a worker starts: the hint goes (a change: a line at once, without the hint)
    WorkerRegistry(client, keys=Keys(prefix), name="w1", model="llama-70b", ttl_s=60).register(pid=1)
    clock.t += 5  # the next worker check
    p.update(store.batches.get(bid))
    assert len(out.getvalue().splitlines()) == 5 and not out.getvalue().splitlines()[-1].startswith("hint")


def test_watch_returns_at_the_deadline_or_the_end(client: redis.Redis, prefix: str) -> None:
    store = ResultStore(client, keys=Keys(prefix))
    bid = _batch(store, 2)
    clock = Clock()
    p, _ = _progress(client, prefix, clock)
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        clock.t += s
        if len(sleeps) == 3:
            _done(store, bid, 0)
            _done(store, bid, 1)

    b = watch(lambda: store.batches.get(bid), p, store.batches.get(bid), clock=clock, sleep=sleep)
    assert b.status is BatchStatus.completed and len(sleeps) == 3
    other = _batch(store, 2)
    b = watch(lambda: store.batches.get(other), p, store.batches.get(other), deadline=clock.t + 2.5, clock=clock,
              sleep=lambda s: setattr(clock, "t", clock.t + s))
    assert b.status is BatchStatus.in_progress


def test_rates_follow_the_recent_window_not_the_whole_run() -> None:
    w = RateWindow(window_s=60)
    w.add(0, 0, 0)
    w.add(3600, 0, 0)  # an hour waiting for a worker
    for t in range(3601, 3661):
        w.add(t, (t - 3600) * 500, (t - 3600) * 50_000)
    r = w.rates()
    assert r.requests_s is not None and 490 < r.requests_s <= 500 and r.tokens_s is not None
    assert [format_duration(s) for s in (None, 4, 185, 7620, 273600)] == ["-", "4s", "3m05s", "2h07m", "3d04h"]


def test_redis_gone_between_a_poll_and_the_display_keeps_the_last_values() -> None:
    """The poll is patient (it says "lost Redis" and waits); the display's own reads (tokens, live workers)
    must not end the wait when Redis stops right after a poll (CI: ``status --watch`` exited there)."""
    from tests.conftest import RedisServer

    srv = RedisServer().start()
    try:
        client = redis.Redis.from_url(srv.url)
        store = ResultStore(client, keys=Keys("gone"))
        bid = _batch(store, 4)
        _done(store, bid, 0, tokens=7)
        clock = Clock()
        p, out = _progress(client, "gone", clock, interval=1.0)
        b = store.batches.get(bid)
        p.update(b)
        first = out.getvalue()
        assert "1/4" in first, first
        srv.stop()
        clock.t += 2
        p.update(b)  # Redis is down: no exception, the last token count is shown
        later = out.getvalue()[len(first):]
        assert "1/4" in later and p.lines == 2, later
        assert p._tokens == 7
    finally:
        srv.cleanup()


def test_the_hint_names_every_model_a_multi_model_batch_waits_on(redis_url: str, client: redis.Redis,
                                                                  prefix: str) -> None:
    """A batch over ma/mb/mc (issue 44): ma served, mb's worker killed (its record expired, as a killed
    worker's does), mc registered but never served. The hint names mb and mc, not ma; when mb's worker is
    back, only mc; once ma's requests are all done, ma's missing worker is no reason for a hint."""
    import lmdq
    from lmdq.submission.settings import ProducerSettings

    keys = Keys(prefix)
    WorkerRegistry(client, keys=keys, name="wa", model="ma", ttl_s=60).register(pid=1)
    WorkerRegistry(client, keys=keys, name="wb", model="mb", ttl_s=0).register(pid=2)  # record lives ~1 s
    api = lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix))
    api.register_models(["mc"], note="never served")
    rows = [{"q": f"question {i}", "m": ("ma", "mb", "mc")[i % 3]} for i in range(9)]
    batch = api.submit(rows, prompt_column="q", model_column="m", batch_size=2)
    assert batch.last_info.models == ["ma", "mb", "mc"]
    time.sleep(1.3)  # mb's worker was killed: no deregister, its record's TTL runs out
    assert {m.name: m.live_workers for m in api.models()[0]} == {"ma": 1, "mb": 0, "mc": 0}

    clock = Clock()
    p, out = _progress(client, prefix, clock, interval=5)
    p.update(batch.info())
    hints = [ln for ln in out.getvalue().splitlines() if ln.startswith("hint: ")]
    assert hints == ["hint: no live worker serves models 'mb' (3 waiting), 'mc' (3 waiting): their requests "
                     "wait until one starts for each (lmdq-worker --served-model-name mb ...; "
                     "lmdq-worker --served-model-name mc ...; see `lmdq-producer models list`)"], out.getvalue()

    WorkerRegistry(client, keys=keys, name="wb2", model="mb", ttl_s=60).register(pid=3)  # mb served again
    clock.t += 5
    p.update(batch.info())
    last = out.getvalue().splitlines()[-1]
    assert last == ("hint: no live worker serves model 'mc' (3 waiting): its requests wait until one starts "
                    "(lmdq-worker --served-model-name mc ...; see `lmdq-producer models list`)"), out.getvalue()

    # the terminal bar shows the same hint, once
    tty = io.StringIO()
    bar = BatchProgress(store=ResultStore(client, keys=keys), models=ModelRegistry(client, keys=keys), stream=tty,
                        terminal=True, interval_s=5, clock=clock, wall=lambda: 0.0)
    with bar:
        bar.update(batch.info())
        bar.update(batch.info())
    assert tty.getvalue().count("hint: no live worker serves model 'mc' (3 waiting)") == 1, tty.getvalue()


def test_a_model_whose_requests_are_done_needs_no_worker(client: redis.Redis, prefix: str) -> None:
    """The hint looks at the models the batch still waits on: one whose requests all ended is not named."""
    store = ResultStore(client, keys=Keys(prefix))
    bid = f"batch_{time.time_ns():024x}"[:30]
    store.batches.create(Batch(id=bid, model="ma", status=BatchStatus.in_progress, batch_size=8,
                               request_counts=RequestCounts(total=4),
                               model_counts={"ma": RequestCounts(total=2), "mb": RequestCounts(total=2)},
                               created_at=time.time()))
    for i in (0, 1):  # ma's two requests end (the results script counts them per model)
        assert store.write_result(Result(batch_id=bid, custom_id=str(i), index=i, status=ResultStatus.completed,
                                         model="ma", generate_token_len=1))
    assert store.batches.get(bid).model_counts["ma"].done == 2  # type: ignore[index]
    ModelRegistry(client, keys=Keys(prefix)).add("ma")
    ModelRegistry(client, keys=Keys(prefix)).add("mb")
    p, out = _progress(client, prefix, Clock())
    p.update(store.batches.get(bid))
    hints = [ln for ln in out.getvalue().splitlines() if ln.startswith("hint: ")]
    assert hints == ["hint: no live worker serves model 'mb' (2 waiting): its requests wait until one starts "
                     "(lmdq-worker --served-model-name mb ...; see `lmdq-producer models list`)"], out.getvalue()
