"""Any registered engine in a process of its own: the worker's Python and the engine's never share a GIL.

Why: TurboMind runs inside the process that loads it (LMDeploy's PyTorch backend has its own engine
process, TurboMind has none). On the H200, SmolLM2 chat through TurboMind ran at 0.70-0.74 of a raw
``pipe()`` with the GPU 10-15 points less busy (docs/gpu-validation.md, "Session 14"): the worker's own
Python per result (claiming, decoding jobs, result scripts, releasing; ~0.4 ms, ``scripts/worker_cpu.py``)
took the GIL that TurboMind's per-step callbacks and LMDeploy's event loop need. With
``LMDQ_ENGINE_PROCESS=1`` the engine is built in a ``spawn`` child and this class is the engine the worker
holds: each ``stream`` call goes to the child, which runs it on the real engine in a thread and sends the
events back. The child's GIL then serves the engine and its one event loop, as in a raw ``pipe()`` script.

The wire is a ``multiprocessing`` pipe carrying JSON frames (no pickle), one message per frame; an event's
tensors (logits, hidden states) follow it as one safetensors frame. Faults keep their meaning: the child
exiting (OOM kill, a crash) ends every call in flight with :class:`EngineDead` and :meth:`alive` turns
False, so the worker re-queues held work without charging attempts and exits 70, as with the engine in
process; the child is a ``multiprocessing`` process, so lmdq.worker.engines.orphan_guard kills it (and
anything it started) when the worker dies, SIGKILL included.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from types import SimpleNamespace
from typing import Any

from lmdq.contract import Endpoint, GenerationParams
from lmdq.worker.engines.base import EngineDead, EngineError, EngineEvent, EngineRequest, error_code
from lmdq.worker.heap import freeze_heap

__all__ = ["EngineProcess", "child_main"]

START_TIMEOUT_S = 3600.0
"""How long the child may take to build its engine (a model load of minutes, a download)."""

_ABORT_POLL_S = 0.1


@dataclass(frozen=True)
class ChildSpec:
    """What the child needs to build the same engine the worker would have built in process."""

    engine: str
    config: str  # the engine's own settings, as JSON (its EngineSpec.settings model)
    model: str | None
    served_model_name: str
    adapters: dict[str, str]
    log_format: str
    log_level: str


def _request_to_wire(r: EngineRequest) -> dict[str, Any]:
    return {"index": r.index, "prompt": r.prompt, "messages": r.messages, "endpoint": r.endpoint.value,
            "params": r.params.model_dump(mode="json", exclude_unset=True), "adapter": r.adapter,
            "continuations": list(r.continuations) if r.continuations is not None else None}


def _request_from_wire(d: dict[str, Any]) -> EngineRequest:
    cont = d.get("continuations")
    return EngineRequest(index=int(d["index"]), prompt=d.get("prompt"), messages=d.get("messages"),
                         endpoint=Endpoint(d["endpoint"]), params=GenerationParams.model_validate(d["params"]),
                         continuations=tuple(cont) if cont is not None else None, adapter=d.get("adapter"))


def _event_to_wire(ev: EngineEvent) -> dict[str, Any]:
    # the fields as they are (asdict would deep-copy the tensors, which travel as their own frame)
    d = {f.name: getattr(ev, f.name) for f in fields(ev) if f.name != "tensors"}
    d["finish_reason"] = ev.finish_reason.value if ev.finish_reason is not None else None
    d["error_code"] = getattr(ev.error_code, "value", ev.error_code)
    return d


def _event_from_wire(d: dict[str, Any], tensors: dict[str, Any] | None) -> EngineEvent:
    lp = d.get("logprobs")
    scores = d.get("scores")
    return EngineEvent(
        index=int(d["index"]), text=d.get("text") or "", input_token_len=int(d.get("input_token_len") or 0),
        generate_token_len=int(d.get("generate_token_len") or 0), finish_reason=d.get("finish_reason"),
        error_code=error_code(d.get("error_code")), error_message=d.get("error_message"),
        logprobs=[(int(t), float(p), [(int(a), float(b)) for a, b in top]) for t, p, top in lp] if lp else lp,
        tensors=tensors, scores=[(float(s), int(n), g) for s, n, g in scores] if scores else scores,
        reward=d.get("reward"), whole=bool(d.get("whole")), prefill_token_len=d.get("prefill_token_len"),
        embedding=d.get("embedding"))


def _pack_tensors(tensors: dict[str, Any]) -> bytes:
    """An event's tensors as one safetensors frame (numpy arrays: the worker's TensorStore takes them as the
    sim's are; LMDeploy's come as float32 CPU torch tensors, whose ``.numpy()`` shares their memory)."""
    import numpy as np
    from safetensors.numpy import save

    return bytes(save({k: np.ascontiguousarray(v.numpy() if hasattr(v, "numpy") else np.asarray(v))
                       for k, v in tensors.items()}))


def _unpack_tensors(blob: bytes) -> dict[str, Any]:
    from safetensors.numpy import load

    return dict(load(blob))


# ---- the child ---------------------------------------------------------------------------------------
def child_main(conn: Any, spec_json: str) -> None:
    """The engine process: build the engine, say ``ready``, then serve calls until ``close`` or EOF."""
    spec = ChildSpec(**json.loads(spec_json))
    from lmdq.logs.config import configure_logging, get_logger
    from lmdq.logs.tqdm_events import install as install_tqdm_events

    configure_logging(spec.log_format, spec.log_level)
    install_tqdm_events()
    log = get_logger("lmdq.engine_process")
    send_lock = threading.Lock()

    def send(msg: dict[str, Any], blob: bytes | None = None) -> None:
        with send_lock:  # a message and its tensor frame stay together
            conn.send_bytes(json.dumps(msg).encode())
            if blob is not None:
                conn.send_bytes(blob)

    try:
        from lmdq.worker.engines.base import engine_capacity
        from lmdq.worker.engines.registry import EngineTarget, engine_spec

        es = engine_spec(spec.engine)
        engine = es.factory(es.settings.model_validate_json(spec.config),
                            EngineTarget(model=spec.model, served_model_name=spec.served_model_name,
                                         adapters=spec.adapters))
        device = getattr(engine, "device", None)
        send({"op": "ready", "name": engine.name, "backend": engine.backend, "model_name": engine.model_name,
              "capacity": engine_capacity(engine), "device_type": getattr(device, "type", None)})
    except BaseException as e:  # noqa: BLE001 - the parent raises it as the start-up error it is
        send({"op": "failed", "error": f"{type(e).__name__}: {e}"})
        return
    aborts: dict[int, threading.Event] = {}

    def run_stream(call: int, reqs: list[EngineRequest]) -> None:
        try:
            for ev in engine.stream(reqs, aborts[call]):
                blob = _pack_tensors(ev.tensors) if ev.tensors else None
                send({"op": "ev", "id": call, "ev": _event_to_wire(ev), "tensors": blob is not None}, blob)
            send({"op": "end", "id": call})
        except EngineDead as e:
            send({"op": "err", "id": call, "kind": "dead", "error": str(e)})
        except Exception as e:  # noqa: BLE001 - the call's error, raised in the worker's thread
            send({"op": "err", "id": call, "kind": "engine", "error": f"{type(e).__name__}: {e}"})
        finally:
            aborts.pop(call, None)

    while True:
        try:
            msg = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the worker is gone
        op, call = msg.get("op"), msg.get("id")
        if op == "stream":
            aborts[call] = threading.Event()
            reqs = [_request_from_wire(r) for r in msg["requests"]]
            threading.Thread(target=run_stream, args=(call, reqs), name=f"lmdq-engine-call-{call}",
                             daemon=True).start()
        elif op == "abort":
            ev = aborts.get(call)
            if ev is not None:
                ev.set()
        elif op == "count":
            send({"op": "reply", "id": call, "value": engine.count_tokens(msg["text"])})
        elif op == "warm_up":
            warm = getattr(engine, "warm_up", None)
            value = warm() if warm is not None else {}
            log.debug("heap frozen", objects=freeze_heap())  # built and warm: what exists now lives as long as we do
            send({"op": "reply", "id": call, "value": value})
        elif op == "close":
            break
    log.info("engine process closing", engine=engine.name)
    engine.close()


# ---- the worker's side -------------------------------------------------------------------------------
class EngineProcess:
    """The engine the worker holds when ``LMDQ_ENGINE_PROCESS`` is set: a proxy to the real engine in a
    ``spawn`` child. Safe for concurrent ``stream`` calls from the job threads (one reader thread routes
    the child's frames to each call's queue)."""

    def __init__(self, spec: ChildSpec, *, start_timeout_s: float = START_TIMEOUT_S) -> None:
        from lmdq.worker.engines import orphan_guard

        orphan_guard.install()  # the child, and all it starts, die with the worker (SIGKILL included)
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=child_main, args=(child_conn, json.dumps(asdict(spec))),
                                 name="lmdq-engine", daemon=False)
        self._proc.start()
        child_conn.close()
        self._send_lock = threading.Lock()  # one frame at a time on the pipe
        self._state_lock = threading.Lock()  # the death reason is decided once
        self._calls: dict[int, queue.SimpleQueue[Any]] = {}
        self._ids = itertools.count(1)
        self._dead: str | None = None
        self._closed = False
        self.adapters = dict(spec.adapters)
        ready = self._wait_ready(start_timeout_s)
        self.name: str = ready["name"]
        self.backend: str = ready["backend"]
        self.model_name: str = ready["model_name"]
        self.capacity: int = int(ready["capacity"])
        self.device = SimpleNamespace(type=ready["device_type"]) if ready.get("device_type") else None
        self._reader = threading.Thread(target=self._read_loop, name="lmdq-engine-reader", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, s: Any, log_format: str, served_model_name: str) -> EngineProcess:
        """The engine ``s`` (WorkerSettings) names, built in a child process that logs as the worker does
        (``log_format``: the worker's resolved ``json`` or ``console``), serving ``served_model_name``
        (:func:`lmdq.worker.engine_factory.served_model_name`, which the caller has already computed)."""
        spec = ChildSpec(engine=s.engine_name, config=s.engine_config.model_dump_json(), model=s.model,
                         served_model_name=served_model_name, adapters=dict(s.adapters),
                         log_format=log_format, log_level=s.log_level)
        return cls(spec)

    def _wait_ready(self, timeout_s: float) -> dict[str, Any]:
        end = time.monotonic() + timeout_s
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                raise EngineError(f"the engine process exited with code {self._proc.exitcode} while it loaded")
            if time.monotonic() > end:
                self._proc.kill()
                raise EngineError(f"the engine process was not ready after {timeout_s:.0f} s")
        msg = json.loads(self._conn.recv_bytes())
        if msg.get("op") != "ready":
            self._proc.join(30)
            raise EngineError(f"the engine process could not build the engine: {msg.get('error')}")
        return dict(msg)

    def _write(self, msg: dict[str, Any]) -> None:
        with self._send_lock:
            self._conn.send_bytes(json.dumps(msg).encode())

    def _send(self, msg: dict[str, Any]) -> None:
        if self._dead is not None:
            raise EngineDead(self._dead)
        try:
            self._write(msg)
        except (OSError, EOFError, ValueError) as e:
            # A broken pipe means the child is gone or going: name how it died (its signal or exit code),
            # as the reader does on EOF. Dying here on the pipe's own error first raced the reader, and
            # then the log said "Broken pipe" where an OOM kill should read "killed by signal 9".
            if self._closed:
                self._die("engine process closed")
            else:
                self._child_exited(unknown=f"the engine process is gone ({e})")
            raise EngineDead(self._dead or "engine process gone") from e

    def _read_loop(self) -> None:
        try:
            while True:
                msg = json.loads(self._conn.recv_bytes())
                blob = self._conn.recv_bytes() if msg.get("tensors") else None
                q = self._calls.get(msg.get("id", -1))
                if q is not None:
                    q.put((msg, blob))
        except (EOFError, OSError):
            pass
        self._proc.join(5)
        if self._closed:
            self._die("engine process closed")
        else:
            self._child_exited()

    def _child_exited(self, unknown: str | None = None) -> None:
        """The child is gone: the reason (signal or exit code) once, logged, every call ended with it. From
        the reader (EOF), :meth:`alive` or a failed send, whichever sees it first: the worker may stop on
        ``alive()`` before the reader has woken, and its log must still say how the engine died. ``unknown``
        is the reason when no exit code comes within the bound (a pipe that broke under a live child)."""
        # Two threads may wait on the child at once (the reader's join, alive()'s poll): the one that loses the
        # waitpid race reads exitcode None until the winner has stored it (CI, session 16: "died (exit code
        # None)"); a join alone can lose the same race, so wait for the stored code itself, bounded.
        deadline = time.monotonic() + 5.0
        while self._proc.exitcode is None and time.monotonic() < deadline:
            self._proc.join(0.01)
            time.sleep(0.001)
        with self._state_lock:
            if self._dead is not None:
                return
            code = self._proc.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            reason = self._dead = (unknown if code is None and unknown else f"the engine process died ({how})")
        from lmdq.logs.config import get_logger

        get_logger("lmdq.engine_process").error(reason, pid=self._proc.pid, exit_code=code)
        self._die(reason)

    def _die(self, reason: str) -> None:
        with self._state_lock:
            if self._dead is None:
                self._dead = reason
        for q in list(self._calls.values()):
            q.put(({"op": "err", "kind": "dead", "error": self._dead}, None))

    def _call(self, op: str, **kw: Any) -> Any:
        """One request/reply to the child (count_tokens, warm_up)."""
        call = next(self._ids)
        q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._calls[call] = q
        try:
            self._send({"op": op, "id": call, **kw})
            msg, _ = q.get()
        finally:
            self._calls.pop(call, None)
        if msg.get("op") == "err":
            raise EngineDead(str(msg.get("error")))
        return msg["value"]

    # ---- the Engine contract ---------------------------------------------------------------------
    def stream(self, requests: Sequence[EngineRequest], abort: threading.Event) -> Iterator[EngineEvent]:
        call = next(self._ids)
        q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._calls[call] = q
        ended = aborted = False
        try:
            self._send({"op": "stream", "id": call, "requests": [_request_to_wire(r) for r in requests]})
            while True:
                if abort.is_set() and not aborted:
                    aborted = True
                    self._send({"op": "abort", "id": call})
                try:
                    msg, blob = q.get(timeout=_ABORT_POLL_S)
                except queue.Empty:
                    continue
                op = msg.get("op")
                if op == "ev":
                    yield _event_from_wire(msg["ev"], _unpack_tensors(blob) if blob is not None else None)
                elif op == "end":
                    ended = True
                    return
                elif op == "err":
                    ended = True
                    if msg.get("kind") == "dead":
                        self._die(str(msg.get("error")))
                        raise EngineDead(str(msg.get("error")))
                    raise EngineError(str(msg.get("error")))
        finally:
            if not ended and self._dead is None:  # the worker stopped reading early: end the call there too
                try:
                    self._send({"op": "abort", "id": call})
                except EngineDead:
                    pass
            self._calls.pop(call, None)

    def count_tokens(self, text: str) -> int:
        return int(self._call("count", text=text))

    def warm_up(self) -> dict[str, Any]:
        """The child engine's own warm-up (what it would have cost in process), before /readyz."""
        return dict(self._call("warm_up"))

    def alive(self) -> bool:
        if self._closed or self._dead is not None:
            return False
        if not self._proc.is_alive():
            self._child_exited()
            return False
        return True

    def close(self) -> None:
        """Ask the child to close its engine; kill it if it has not exited 60 s later. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._dead is None:
            try:
                self._write({"op": "close"})
            except (OSError, EOFError, ValueError):
                pass
        self._proc.join(60)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._conn.close()
