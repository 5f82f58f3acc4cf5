"""Engine death detection in the LMDeploy engine (issue 13), on CPU.

LMDeploy needs a GPU, so its Pipeline is stood in for by a scripted one that replays what 0.18 does (read
from its source: pipeline.py ``_infer``, mp_engine/zmq_rpc.py; seen on the H200 in issue 13, 614 of 1,024
requests failed): when the engine process dies, every request in flight ends with ``finish_reason='error'``,
``error_code='internal_error'``. The engine process
here is a real child process, really SIGKILLed; the Responses are LMDeploy's own class. What is tested is
lmdq's side: such a request is never handed up as a failure, ``stream`` raises EngineDead, ``alive()``
turns False, and per-request errors stay per-request. The real engine: tests/gpu/test_faults_gpu.py.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("lmdeploy")
from lmdeploy.messages import PytorchEngineConfig, Response  # noqa: E402

from lmdq.contract import Endpoint  # noqa: E402
from lmdq.worker.engine_config import LMDeployConfig  # noqa: E402
from lmdq.worker.engines import lmdeploy_engine  # noqa: E402
from lmdq.worker.engines.base import EngineDead, EngineEvent, EngineRequest  # noqa: E402
from lmdq.worker.engines.engine_health import EngineHealth  # noqa: E402
from lmdq.worker.engines.lmdeploy_engine import LMDeployEngine  # noqa: E402

Script = Callable[[list[Any]], Iterator[Response]]


def ok(i: int, text: str = "fine") -> Response:
    return Response(text=text, generate_token_len=3, input_token_len=5, finish_reason="stop", index=i)


def err(i: int, code: str = "internal_error", message: str = "An internal server error occurred.") -> Response:
    return Response(text="", generate_token_len=0, input_token_len=0, finish_reason="error", index=i,
                    error_code=code, error_message=message)


class _Session:
    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


class StandInPipeline:
    """The part of ``lmdeploy.Pipeline`` the engine uses: ``stream_infer`` replays ``script``; the backend
    engine has a ``proc`` (the mp engine process) and ``get_health_status`` like LMDeploy's."""

    def __init__(self, script: Script, proc: Any = None, healthy: bool = True,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.script = script
        self.backend_config = PytorchEngineConfig(max_batch_size=64)
        self.health_calls = 0

        async def get_health_status() -> dict[str, Any]:
            self.health_calls += 1
            return {"alive": healthy, "message": "PyTorch engine is healthy." if healthy
                    else "PyTorch engine loop task has stopped: ['MainLoop']."}

        self.async_engine = SimpleNamespace(engine=SimpleNamespace(proc=proc, get_health_status=get_health_status))
        self.internal_thread = SimpleNamespace(loop=loop)
        self.closed = False
        self.close_may_return = threading.Event()
        self.close_may_return.set()

    def session(self) -> _Session:
        return _Session()

    def close(self) -> None:
        self.closed = True
        assert self.close_may_return.wait(120)

    def stream_infer(self, prompts: list[Any], **_: Any) -> Iterator[Response]:
        return self.script(prompts)


def make_engine(pipe: StandInPipeline) -> LMDeployEngine:
    # LMDeploy's pipeline() needs a GPU: the stand-in goes in through the constructor instead
    eng = LMDeployEngine(pipe, LMDeployConfig(backend="pytorch"), model_name="m", emit_interval_s=0.0)
    assert (eng.backend, eng.capacity) == ("pytorch", 64)
    return eng


def reqs(n: int) -> list[EngineRequest]:
    return [EngineRequest(index=i, prompt=f"p{i}", endpoint=Endpoint.completion) for i in range(n)]


def collect(eng: LMDeployEngine, n: int) -> tuple[list[EngineEvent], BaseException | None]:
    events: list[EngineEvent] = []
    try:
        for ev in eng.stream(reqs(n), threading.Event()):
            events.append(ev)
    except Exception as e:  # noqa: BLE001 - returned for the assertions
        return events, e
    return events, None


@pytest.fixture
def engine_proc() -> Iterator[Any]:
    """A real child process standing for LMDeploy's engine process."""
    p = mp.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=True)
    p.start()
    yield p
    if p.is_alive():
        p.kill()
    p.join(30)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """The pipeline's own event-loop thread (LMDeploy runs the health check there)."""
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    t.join(30)
    lp.close()


def test_killed_engine_process_raises_engine_dead_and_fails_no_request(engine_proc: Any) -> None:
    def script(prompts: list[Any]) -> Iterator[Response]:
        yield from (ok(i) for i in range(3))
        engine_proc.kill()  # what an OOM kill does; LMDeploy notices (sentinel) before failing requests
        engine_proc.join(30)
        yield from (err(i) for i in range(3, len(prompts)))

    eng = make_engine(StandInPipeline(script, proc=engine_proc))
    assert eng.alive() and eng.engine_pid == engine_proc.pid
    events, exc = collect(eng, 8)
    assert [(e.index, e.finish_reason) for e in events] == [(0, "stop"), (1, "stop"), (2, "stop")]
    assert isinstance(exc, EngineDead), exc
    assert f"process {engine_proc.pid} died (killed by SIGKILL)" in str(exc)
    assert eng.alive() is False
    with pytest.raises(EngineDead):  # and every later call, at once
        next(iter(eng.stream(reqs(1), threading.Event())))


def test_alive_turns_false_as_soon_as_the_engine_process_is_gone(engine_proc: Any) -> None:
    eng = make_engine(StandInPipeline(lambda prompts: iter(())))
    eng.pipe.async_engine.engine.proc = engine_proc
    assert eng.alive()
    engine_proc.kill()
    engine_proc.join(30)
    assert eng.alive() is False
    assert eng._dead is not None and "killed by SIGKILL" in eng._dead


def test_rpc_marked_dead_is_engine_death(engine_proc: Any) -> None:
    """LMDeploy's ZMQ client records the first death reason (``_RPCServerLiveness.dead_msg``)."""
    eng = make_engine(StandInPipeline(lambda prompts: iter(()), proc=engine_proc))
    assert eng.alive()
    eng.pipe.async_engine.engine.rpc_client = SimpleNamespace(
        _server_liveness=SimpleNamespace(dead_msg="PyTorch ZMQ engine process is not alive."))
    assert eng.alive() is False
    assert "engine RPC is dead: PyTorch ZMQ engine process is not alive." in (eng._dead or "")


def test_per_request_errors_stay_per_request(engine_proc: Any, loop: asyncio.AbstractEventLoop) -> None:
    def script(prompts: list[Any]) -> Iterator[Response]:
        yield err(0, "context_length_exceeded", "The request exceeds the model context length.")
        yield ok(1)

    eng = make_engine(StandInPipeline(script, proc=engine_proc, loop=loop))
    events, exc = collect(eng, 2)
    assert exc is None
    assert [(e.index, e.finish_reason, e.error_code) for e in events] == [
        (0, "error", "context_length_exceeded"), (1, "stop", None)]
    assert eng.alive()
    assert eng.pipe.health_calls == 0  # not an engine-level code: not even checked


def test_one_internal_error_among_good_requests_is_that_requests_own(
        engine_proc: Any, loop: asyncio.AbstractEventLoop) -> None:
    def script(prompts: list[Any]) -> Iterator[Response]:
        yield err(0)
        yield from (ok(i) for i in range(1, len(prompts)))

    eng = make_engine(StandInPipeline(script, proc=engine_proc, loop=loop))
    events, exc = collect(eng, 5)
    assert exc is None
    assert sorted((e.index, e.finish_reason, e.error_code) for e in events) == [
        (0, "error", "internal_error"), *((i, "stop", None) for i in range(1, 5))]
    assert eng.alive() and eng.pipe.health_calls == 1


def test_every_request_in_flight_failing_at_once_is_engine_death(loop: asyncio.AbstractEventLoop) -> None:
    """An in-process engine (no process to look at) whose health check still says alive, but whose every
    request fails: a broken CUDA context. No request is handed up as failed."""
    eng = make_engine(StandInPipeline(lambda prompts: (err(i) for i in range(len(prompts))), loop=loop))
    events, exc = collect(eng, 6)
    assert events == []
    assert isinstance(exc, EngineDead) and "every request in flight failed" in str(exc)
    assert eng.alive() is False


def test_few_requests_failing_together_stay_per_request(loop: asyncio.AbstractEventLoop) -> None:
    """Below EngineHealth.min_units (e.g. a suspected poison job run one request at a time)."""
    eng = make_engine(StandInPipeline(lambda prompts: (err(i) for i in range(len(prompts))), loop=loop))
    events, exc = collect(eng, 2)
    assert exc is None and [(e.index, e.error_code) for e in events] == [(0, "internal_error"),
                                                                         (1, "internal_error")]
    assert eng.alive()


def test_health_check_saying_dead_is_engine_death(loop: asyncio.AbstractEventLoop) -> None:
    def script(prompts: list[Any]) -> Iterator[Response]:
        yield ok(0)
        yield err(1)
        yield ok(2)  # never reached: the first engine-level error already found the engine dead

    eng = make_engine(StandInPipeline(script, healthy=False, loop=loop))
    events, exc = collect(eng, 3)
    assert [(e.index, e.finish_reason) for e in events] == [(0, "stop")]
    assert isinstance(exc, EngineDead) and "engine loop task has stopped" in str(exc)


def test_burst_across_concurrent_calls() -> None:
    """The streak counts requests of every stream call on the engine (one per job, each in its thread)."""
    b = EngineHealth(min_units=4)
    b.begin(3)  # job A
    b.begin(3)  # job B
    ep = b.end_engine_error()  # A's first: a streak over 6 requests in flight
    for _ in range(4):
        b.end_engine_error()
    assert not b.tripped and not b.settled(ep)
    b.end_engine_error()
    assert b.tripped and b.wait_verdict(ep, 0)


def test_a_good_finish_ends_the_streak() -> None:
    b = EngineHealth(min_units=2)
    b.begin(4)
    ep = b.end_engine_error()
    b.end_ok()
    assert b.settled(ep) and not b.wait_verdict(ep, 0)
    ep2 = b.end_engine_error()  # a new streak, over what is in flight now (2)
    assert ep2 != ep and not b.tripped
    b.end_engine_error()
    assert b.tripped


def test_held_errors_wait_for_the_other_thread(engine_proc: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Job A's request fails while job B's 4 are still running: A's error is held back (not handed up),
    then handed up as A's own once B's requests finish well."""
    b_running, b_may_finish = threading.Event(), threading.Event()
    a_events: list[EngineEvent] = []
    seen_when_a_resumed: list[int] = []

    def script(prompts: list[Any]) -> Iterator[Response]:
        if len(prompts) == 1:  # job A
            yield err(0)
            seen_when_a_resumed.append(len(a_events))  # the engine asked for more without handing it up
            b_may_finish.set()
        else:  # job B
            b_running.set()
            assert b_may_finish.wait(60)
            yield from (ok(i) for i in range(len(prompts)))

    eng = make_engine(StandInPipeline(script, proc=engine_proc, loop=loop))
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.setdefault("b", collect(eng, 4)))
    t.start()
    assert b_running.wait(60)  # B's requests are in flight
    for ev in eng.stream(reqs(1), threading.Event()):
        a_events.append(ev)
    t.join(60)
    b_events, b_exc = out["b"]
    assert seen_when_a_resumed == [0]
    assert [(e.index, e.error_code) for e in a_events] == [(0, "internal_error")]
    assert b_exc is None and [e.finish_reason for e in b_events] == ["stop"] * 4
    assert eng.alive()


def test_exit_description() -> None:
    assert lmdeploy_engine._exit_description(-signal.SIGKILL) == "killed by SIGKILL"
    assert lmdeploy_engine._exit_description(1) == "exit code 1"


def test_closing_a_dead_engine_is_bounded(engine_proc: Any, loop: asyncio.AbstractEventLoop,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """LMDeploy's shutdown talks to the dead process (ZMQ teardown): should it never return, close() still
    does, so the worker can exit and be restarted; LMDeploy's atexit hook for it would block the exit: it
    is dropped. The RPC sockets' linger goes to 0 first (a context term waits on it)."""
    import atexit

    monkeypatch.setattr(lmdeploy_engine, "DEAD_CLOSE_TIMEOUT_S", 0.5)
    pipe = StandInPipeline(lambda prompts: iter(()), proc=engine_proc, loop=loop)
    backend = pipe.async_engine.engine
    backend.rpc_client = SimpleNamespace(async_socket=SimpleNamespace(linger=-1),
                                         sync_socket=SimpleNamespace(linger=-1))
    backend.close = lambda: None
    atexit.register(backend.close)  # what ZMQMPEngine.__init__ does
    dropped: list[Any] = []
    real_unregister = atexit.unregister
    monkeypatch.setattr(atexit, "unregister", lambda f: (dropped.append(f), real_unregister(f)))
    pipe.close_may_return.clear()  # LMDeploy's close hangs
    eng = make_engine(pipe)
    engine_proc.kill()
    engine_proc.join(30)
    assert eng.alive() is False
    eng.close()  # returns (after DEAD_CLOSE_TIMEOUT_S), does not hang
    assert pipe.closed and eng.alive() is False
    assert backend.close in dropped
    assert backend.rpc_client.async_socket.linger == 0 and backend.rpc_client.sync_socket.linger == 0
    pipe.close_may_return.set()


def test_closing_a_live_engine_waits_for_lmdeploy(engine_proc: Any) -> None:
    pipe = StandInPipeline(lambda prompts: iter(()), proc=engine_proc)
    eng = make_engine(pipe)
    eng.close()
    assert pipe.closed and eng.alive() is False


def test_rpc_dead_error_raised_through_stream_infer_is_engine_death(loop: asyncio.AbstractEventLoop) -> None:
    """Should stream_infer itself raise (not answer per request), LMDeploy's RPCServerDeadError anywhere in
    the chain still means the engine is gone, not a retryable error."""
    class RPCServerDeadError(RuntimeError):  # the name LMDeploy 0.18's zmq_rpc.py uses
        pass

    def script(prompts: list[Any]) -> Iterator[Response]:
        yield ok(0)
        try:
            raise RPCServerDeadError("PyTorch ZMQ engine process is not alive.")
        except RPCServerDeadError as e:
            raise RuntimeError("An internal server error occurred.") from e

    eng = make_engine(StandInPipeline(script, loop=loop))
    events, exc = collect(eng, 2)
    assert [(e.index, e.finish_reason) for e in events] == [(0, "stop")]
    assert isinstance(exc, EngineDead) and "not alive" in str(exc)
    assert eng.alive() is False
