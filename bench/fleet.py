"""A fleet on one Redis: N sim worker PROCESSES, what Redis spends per request, what idle workers cost.

Every number comes from the Redis server's own counters (INFO cpu, stats) around one phase; memory is
the sum of ``MEMORY USAGE key SAMPLES 0`` over every key, before and after the phase. ``used_memory``
was tried first: its deltas also hold allocator fragmentation, Lua caches and the clients' buffers,
and at a test's 16 requests they went negative (-1,208 B per running request on a loaded CI machine).

1. memory per queued request: a batch for a model no worker serves;
2. memory per running request: one worker holds an engine-full of never-ending requests (each has
   written its partial result), then the batch is cancelled;
3. one worker, then N workers (the first one plus N-1 more), each drains a batch sized for them:
   req/s from the batch's own ``queued_at`` to ``completed_at`` (workers are up and blocked on their
   wake list before the submit), efficiency = N-worker rate / (N x the one-worker rate of this run),
   Redis CPU (``used_cpu_sys + used_cpu_user``) and commands (``total_commands_processed``, a Lua
   script's own calls included) per request, and memory per completed request;
4. idle cost: M idle workers (threads of this process, each with its own client and sim engine)
   blocked on their wake list, then K workers polling (``LMDQ_IDLE_WAIT_S=0``, the old behaviour),
   commands/s and % of one Redis core over a window, beside Redis with no worker at all.

Speed is printed, never asserted (docs/performance.md holds the measured numbers).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import redis

from lmdq.contract import Batch, BatchStatus, GenerationParams, RequestCounts
from lmdq.jobs.reads import inflight_count
from lmdq.redis.connection import connect
from lmdq.redis.keys import Keys
from lmdq.redis.server import info as server_info
from lmdq.results.store import ResultStore
from lmdq.submission.ledger import BatchLedger, new_batch_id
from lmdq_bench.keyspace import keys_memory, scan
from lmdq_bench.sim_workers import SimWorkers

__all__ = ["FleetConfig", "run_fleet"]

PREFIX = "fleet"
MODEL = "fleet"


@dataclass
class FleetConfig:
    workers: int = 2
    capacity: int = 2048
    batch_size: int = 32
    rounds: int = 4  # engine-fulls of requests per worker in each throughput batch
    input_len: int = 64  # prompt words
    output_len: int = 64  # generated tokens per request
    decode_step_ms: float = 50.0  # the sim workers' --sim-step-ms (a bench default, not the engine's)
    idle_workers: int = 100
    poll_workers: int = 5
    idle_window_s: float = 20.0


@dataclass
class _Snap:
    cpu_s: float
    commands: int

    @classmethod
    def of(cls, client: redis.Redis) -> _Snap:
        info = server_info(client, "all")
        return cls(cpu_s=float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
                   commands=int(info["total_commands_processed"]))


def _key_memory(client: redis.Redis) -> int:
    """Bytes of every key on the bench's own server. Called outside any CPU/command window: its SCAN and
    MEMORY calls are the bench's, not lmdq's."""
    return keys_memory(client, scan(client))


def _enqueue(client: redis.Redis, keys: Keys, model: str, n: int, cfg: FleetConfig, *, tokens: int) -> Batch:
    """A batch of ``n`` requests enqueued as the producer does it (one commit)."""
    jobs = -(-n // cfg.batch_size)
    b = Batch(id=new_batch_id(), model=model, status=BatchStatus.validating, batch_size=cfg.batch_size,
              num_jobs=jobs, request_counts=RequestCounts(total=n), created_at=time.time(),
              params=GenerationParams(max_new_tokens=tokens, ignore_eos=True))
    words = " ".join(f"w{j}" for j in range(cfg.input_len))
    reqs = ({"index": i, "custom_id": f"r{i}", "prompt": f"{i} {words}"} for i in range(n))
    return BatchLedger(client, keys=keys, ttl_s=3600).enqueue(b, reqs)


def wait_until(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    """Poll ``cond`` until true; TimeoutError naming ``what`` after ``timeout`` s (the benches' waits)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench: timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def blocked_clients(client: redis.Redis) -> int:
    """Clients blocked in Redis: idle workers waiting on their wake list."""
    return int(server_info(client, "clients")["blocked_clients"])


def _procs(redis_url: str) -> SimWorkers:
    """Worker processes (``python -m lmdq.worker``, sim engine), logs in a temp folder."""
    env = {**os.environ, "LMDQ_REDIS_URL": redis_url, "LMDQ_KEY_PREFIX": PREFIX, "LMDQ_LOG_FORMAT": "json",
           "PYTHONUNBUFFERED": "1"}
    return SimWorkers("fleet", env, prefix="lmdq-fleet-")


def _start(procs: SimWorkers, n: int, cfg: FleetConfig) -> None:
    for _ in range(n):
        procs.start(["--served-model-name", MODEL, "--sim-max-batch", str(cfg.capacity), "--sim-step-ms",
                     str(cfg.decode_step_ms)], "fleet")


def _top_commands(before: dict[str, Any], after: dict[str, Any], n: int, k: int = 6) -> list[dict[str, Any]]:
    """Where Redis' time went, per request: the ``k`` commands with the most CPU (INFO commandstats;
    a Lua script counts as its EVALSHA, and the commands it runs count again under their own names)."""
    rows: list[dict[str, Any]] = []
    for name, v in after.items():
        b = before.get(name, {"calls": 0, "usec": 0})
        calls, usec = int(v["calls"]) - int(b["calls"]), int(v["usec"]) - int(b["usec"])
        if calls:
            rows.append({"command": name.removeprefix("cmdstat_"), "calls_per_req": round(calls / n, 3),
                         "us_per_req": round(usec / n, 2)})
    return sorted(rows, key=lambda r: -float(r["us_per_req"]))[:k]


def _drain(client: redis.Redis, store: ResultStore, procs: SimWorkers, n_workers: int, cfg: FleetConfig,
           log: Callable[[str], None]) -> dict[str, Any]:
    """One batch for ``n_workers`` blocked workers: rate and Redis costs per request."""
    n = n_workers * cfg.capacity * cfg.rounds
    wait_until(lambda: blocked_clients(client) >= n_workers, 120, f"{n_workers} workers to block on their wake list")
    mem0 = _key_memory(client)
    before, stats0 = _Snap.of(client), server_info(client, "commandstats")
    batch = _enqueue(client, Keys(PREFIX), MODEL, n, cfg, tokens=cfg.output_len)
    t_wall = time.monotonic()

    def done() -> bool:
        procs.check()
        return store.batches.get(batch.id).status.terminal

    wait_until(done, 600, f"batch of {n:,} requests", interval=0.25)
    after, stats1 = _Snap.of(client), server_info(client, "commandstats")
    mem1 = _key_memory(client)
    b = store.batches.get(batch.id)
    assert b.status is BatchStatus.completed and b.request_counts.completed == n, b.request_counts
    secs = (b.completed_at or 0) - (b.queued_at or 0)
    out = {"workers": n_workers, "requests": n, "seconds": round(secs, 3),
           "req_s": round(n / secs, 1), "redis_cpu_us_per_req": round((after.cpu_s - before.cpu_s) / n * 1e6, 2),
           "commands_per_req": round((after.commands - before.commands) / n, 2),
           "bytes_per_completed": round((mem1 - mem0) / n),
           "top_commands": _top_commands(stats0, stats1, n)}
    log(f"{n_workers} worker(s): {n:,} requests in {secs:.2f} s ({time.monotonic() - t_wall:.1f} s wall) "
        f"= {out['req_s']:,.0f} req/s")
    return out


def _running_memory(client: redis.Redis, store: ResultStore, cfg: FleetConfig, log: Callable[[str], None]) -> int:
    """Bytes per running request: one worker's engine full of requests that do not end in the phase."""
    keys = Keys(PREFIX)
    n = cfg.capacity
    before = _key_memory(client)
    batch = _enqueue(client, keys, MODEL, n, cfg, tokens=1_000_000)
    # Running = claimed, in the engine and reporting: every request has written its partial result.
    try:
        wait_until(lambda: store.partial_count(batch.id) >= n, 120, "every request's first partial")
    except TimeoutError as e:
        log(f"{e}; measured with {store.partial_count(batch.id)} of {n} partials")
    per = round((_key_memory(client) - before) / n)
    BatchLedger(client, keys=keys, ttl_s=3600).cancel(batch.id)
    wait_until(lambda: store.batches.get(batch.id).status.terminal and inflight_count(client, keys, MODEL) == 0, 120,
          "the cancelled batch to leave the worker")
    return per


def _idle_cost(client: redis.Redis, redis_url: str, n: int, window_s: float, *, idle_wait_s: float,
               prefix: str) -> dict[str, Any]:
    """``n`` idle workers (threads here, each with its own client and engine): Redis' cost over a window."""
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, health_port=0, idle_wait_s=idle_wait_s,
                       log_level="WARNING")
    workers = [Worker(engine=SimEngine(model_name=MODEL), client=connect(redis_url, check=False),
                      settings=s) for _ in range(n)]
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for t in threads:
        t.start()
    try:
        if idle_wait_s > 0:
            wait_until(lambda: blocked_clients(client) >= n, 120, f"{n} idle workers to block")
        else:
            time.sleep(1.0)
        a, t0 = _Snap.of(client), time.monotonic()
        time.sleep(window_s)
        b, dt = _Snap.of(client), time.monotonic() - t0
    finally:
        for w in workers:
            w.stop()
        for t in threads:
            t.join(30)
    return {"workers": n, "idle_wait_s": idle_wait_s, "window_s": round(dt, 1),
            "commands_per_s": round((b.commands - a.commands - 1) / dt, 2),
            "redis_core_pct": round((b.cpu_s - a.cpu_s) / dt * 100, 3)}


def run_fleet(cfg: FleetConfig, *, redis_url: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    client = connect(redis_url)
    store = ResultStore(client, keys=Keys(PREFIX))
    res: dict[str, Any] = {"config": asdict(cfg), "redis_version": server_info(client, "server")["redis_version"]}
    # 1. queued: nobody serves this model
    before = _key_memory(client)
    nq = cfg.capacity * cfg.rounds
    _enqueue(client, Keys(PREFIX), "fleet-unserved", nq, cfg, tokens=cfg.output_len)
    res["bytes_per_queued"] = round((_key_memory(client) - before) / nq)
    log(f"memory per queued request: {res['bytes_per_queued']:,} B")
    procs = _procs(redis_url)
    try:
        _start(procs, 1, cfg)
        def first_up() -> bool:
            procs.check()
            return blocked_clients(client) >= 1

        wait_until(first_up, 120, "the first worker to start")
        # 2. running
        res["bytes_per_running"] = _running_memory(client, store, cfg, log)
        log(f"memory per running request: {res['bytes_per_running']:,} B")
        # 3. one worker, then N
        one = _drain(client, store, procs, 1, cfg, log)
        runs = [one]
        if cfg.workers > 1:
            _start(procs, cfg.workers - 1, cfg)
            runs.append(_drain(client, store, procs, cfg.workers, cfg, log))
        fleet = runs[-1]
        fleet["efficiency"] = round(fleet["req_s"] / (cfg.workers * one["req_s"]), 4)
        res["runs"] = runs
        res["bytes_per_completed"] = fleet["bytes_per_completed"]
    finally:
        procs.stop()
    # 4. idle cost
    time.sleep(0.5)
    a, t0 = _Snap.of(client), time.monotonic()
    time.sleep(min(cfg.idle_window_s, 10.0))
    b, dt = _Snap.of(client), time.monotonic() - t0
    res["idle_none"] = {"workers": 0, "window_s": round(dt, 1), "commands_per_s": round((b.commands - a.commands - 1)
                        / dt, 2), "redis_core_pct": round((b.cpu_s - a.cpu_s) / dt * 100, 3)}
    res["idle_blocking"] = _idle_cost(client, redis_url, cfg.idle_workers, cfg.idle_window_s,
                                      idle_wait_s=10.0, prefix=f"{PREFIX}-idle")
    log(f"{cfg.idle_workers} idle workers: {res['idle_blocking']}")
    if cfg.poll_workers:
        res["idle_polling"] = _idle_cost(client, redis_url, cfg.poll_workers, min(cfg.idle_window_s, 10.0),
                                         idle_wait_s=0.0, prefix=f"{PREFIX}-poll")
        log(f"{cfg.poll_workers} polling workers: {res['idle_polling']}")
    return res


def table(res: dict[str, Any]) -> str:
    """The result as lines that fit 80 columns."""
    c = res["config"]
    lines = [f"fleet: sim workers of {c['capacity']:,} slots, jobs of {c['batch_size']}, "
             f"{c['output_len']} tokens at {c['decode_step_ms']:g} ms/step",
             f"{'run':10s} {'workers':>7s} {'requests':>9s} {'req/s':>9s} {'eff.':>6s} {'µs CPU/req':>10s} "
             f"{'cmds/req':>8s}"]
    for i, r in enumerate(res.get("runs", [])):
        eff = f"{r['efficiency']:.3f}" if "efficiency" in r else "-"
        lines.append(f"{'one' if i == 0 else 'fleet':10s} {r['workers']:>7d} {r['requests']:>9,d} {r['req_s']:>9,.1f} "
                     f"{eff:>6s} {r['redis_cpu_us_per_req']:>10.1f} {r['commands_per_req']:>8.2f}")
    lines.append(f"Redis memory per request: queued {res['bytes_per_queued']:,} B, running "
                 f"{res['bytes_per_running']:,} B, completed {res['bytes_per_completed']:,} B")
    for key, what in (("idle_none", "no workers"), ("idle_blocking", "idle, blocking"),
                      ("idle_polling", "idle, polling")):
        r = res.get(key)
        if r:
            lines.append(f"{what:15s} {r['workers']:>4d} workers: {r['commands_per_s']:>8,.1f} cmds/s, "
                         f"{r['redis_core_pct']:>6.3f} % of a Redis core")
    return "\n".join(lines)
