"""The raw side of ``lmdq-bench e2e``: one process, one LMDeploy pipeline, ``pipe(prompts)`` per batch.

Run by :mod:`lmdq_bench.e2e` as ``python -m lmdq_bench.raw_pipe SPEC.json`` so it owns the GPU alone, as a
user's own script would: the pipeline is built exactly as the worker builds it (the same settings and
flags, through :func:`lmdq.worker.engine_factory.build_engine`), then each batch is ONE plain
``pipe(prompts, gen_config=[...])`` call on the same JSONL lmdq submits. The spec's ``warmup`` runs the
worker's own warm-up (:meth:`LMDeployEngine.warm_up`) first, so both sides start their first batch warm.

With a ``gate_dir`` in the spec (``lmdq-bench e2e --interleave``) the process is loaded beside an lmdq
worker and runs each batch only when the driver says so, so raw and lmdq batches alternate and meet the
same GPU drift: once ready it writes ``ready.json`` there, then before batch ``b`` it waits for the file
``go_<b>``, runs the batch and writes the batch's record to ``done_<b>.json`` (tmp + rename: the driver
never reads half a file). It gives up, exit 3, if its parent (the driver, ``parent_pid``) is gone or a
gate stays shut ``gate_timeout_s``: a killed driver must not leave an engine holding the GPU.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["GateError", "load_workload", "main", "wait_for_file", "write_atomic"]


class GateError(RuntimeError):
    """The driver of an interleaved run went away, or never opened a gate in time."""


def write_atomic(path: Path, data: Any) -> None:
    """``data`` as JSON at ``path`` through a tmp file and a rename, so a reader polling for ``path``
    sees nothing or all of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)


def wait_for_file(path: Path, timeout_s: float, gone: Callable[[], str | None]) -> None:
    """Block until ``path`` exists (10 ms polls): the one wait of the gate protocol, on both ends (this
    process waits for ``go_<b>``, the driver for ``ready.json`` and ``done_<b>.json``). ``gone`` says why the
    other end can no longer write it (``None`` while it lives), raised at once instead of at the timeout."""
    end = time.monotonic() + timeout_s
    while not path.exists():
        why = gone()
        if why:
            raise GateError(why)
        if time.monotonic() > end:
            raise GateError(f"no {path.name} in {path.parent} after {timeout_s:.0f} s")
        time.sleep(0.01)


def _driver_gone(parent_pid: int | None) -> Callable[[], str | None]:
    """Once the driver dies this process is re-parented, so ``getppid`` changes."""
    def gone() -> str | None:
        if parent_pid is not None and os.getppid() != parent_pid:
            return f"raw_pipe: the e2e driver (pid {parent_pid}) is gone"
        return None
    return gone


def load_workload(path: Path) -> tuple[list[Any], list[dict[str, Any]], bool]:
    """(prompts, per-request params, chat) from a bench JSONL: every line a ``messages`` line (chat) or
    every line a ``prompt`` completion line."""
    prompts: list[Any] = []
    params: list[dict[str, Any]] = []
    kinds = set()
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        d = json.loads(line)
        kinds.add("messages" in d)
        prompts.append(d["messages"] if "messages" in d else d["prompt"])
        params.append(d.get("params", {}))
    if len(kinds) != 1:
        raise ValueError(f"{path}: mixes chat and completion lines")
    return prompts, params, kinds.pop()


def _one_call(eng: Any, prompts: list[Any], params: list[dict[str, Any]], chat: bool) -> list[Any]:
    """LMDeploy: ONE ``pipe(prompts, gen_config=[...])`` call. Other engines (the sim, in CPU tests of this
    bench): all prompts in one ``engine.stream`` call, the final events kept."""
    from lmdq.contract import Endpoint, GenerationParams

    if hasattr(eng, "pipe"):
        from lmdq.worker.engines.lmdeploy_engine import build_gen_config

        gens = [build_gen_config(GenerationParams(**p).resolved()) for p in params]
        return list(eng.pipe(prompts, gen_config=gens, do_preprocess=chat))
    import threading

    from lmdq.worker.engines.base import EngineRequest

    reqs = [EngineRequest(index=i, messages=p if chat else None, prompt=None if chat else p,
                          endpoint=Endpoint.chat if chat else Endpoint.completion, params=GenerationParams(**kw))
            for i, (p, kw) in enumerate(zip(prompts, params))]
    return [ev for ev in eng.stream(reqs, threading.Event()) if ev.finish_reason is not None]


def main(argv: list[str] | None = None) -> int:
    spec = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    from lmdq.logs.config import configure_logging
    from lmdq.worker.engine_factory import build_engine
    from lmdq.worker.settings import load_worker_settings
    from lmdq_bench.proc_cpu import cpu_delta, tree_cpu

    # JSON lines, as the worker's: the engine's own events (``engine occupancy``) are read back from this log
    configure_logging("json", "INFO")
    t0 = time.monotonic()
    engine = spec.get("engine", "lmdeploy")
    s = load_worker_settings(engine=engine, model=spec["model"] if engine != "sim" else None,
                             served_model_name="bench", **spec.get("engine_settings", {}))
    eng: Any = build_engine(s)
    out: dict[str, Any] = {"load_s": round(time.monotonic() - t0, 2), "backend": eng.backend}
    if spec.get("warmup", True) and hasattr(eng, "warm_up"):
        out["warmup"] = eng.warm_up()
    out["ready_s"] = round(time.monotonic() - t0, 2)
    prompts, params, chat = load_workload(Path(spec["workload"]))
    gate = Path(spec["gate_dir"]) if spec.get("gate_dir") else None
    parent_pid = spec.get("parent_pid")
    if gate is not None:
        out["ready_at"] = time.time()
        write_atomic(gate / "ready.json", out)
    batches = []
    for b in range(int(spec["batches"])):
        if gate is not None:
            try:
                wait_for_file(gate / f"go_{b}", float(spec.get("gate_timeout_s", 3600)), _driver_gone(parent_pid))
            except GateError as e:
                print(e, file=sys.stderr, flush=True)
                eng.close()
                return 3
        cpu0 = tree_cpu(os.getpid())
        start = time.time()
        t = time.perf_counter()
        res = _one_call(eng, prompts, params, chat)
        secs = time.perf_counter() - t
        end = time.time()
        cpu = cpu_delta(cpu0, tree_cpu(os.getpid()))
        toks = sum(int(r.generate_token_len) for r in res)
        bad = sum(1 for r in res if r.finish_reason not in ("stop", "length"))
        # wall-clock start/end: an interleaved run's order, and the GPU monitor's window (bench/gpu_monitor.py)
        batches.append({"batch": b, "s": round(secs, 3), "tokens": toks, "tok_s": round(toks / secs, 1),
                        "not_finished": bad, "cpu_s": cpu["main"], "engine_cpu_s": cpu["children"],
                        "start": start, "end": end})
        if gate is not None:
            write_atomic(gate / f"done_{b}.json", batches[-1])
        print(f"raw batch {b}: {toks:,} tokens in {secs:.2f} s = {toks / secs:,.0f} tok/s (CPU s: this process "
              f"{cpu['main']}, engine processes {cpu['children']})", file=sys.stderr, flush=True)
    out["batches"] = batches
    eng.close()
    Path(spec["output"]).write_text(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
