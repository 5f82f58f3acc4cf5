"""Aborting a stream call on the LMDeploy engine, and which sessions it closes (issue 27), on CPU.

LMDeploy needs a GPU, so its Pipeline is stood in for by one whose ``stream_infer`` finishes request 0 at once
and holds the others until their session is aborted, as LMDeploy's does (an aborted session ends with
``finish_reason='abort'``). What is tested is lmdq's side: one watcher thread for the whole engine aborts the
open sessions of a call whose abort event is set, and ends when no call is left; at the end of a call only the
sessions still open are closed (LMDeploy's generate() removes a finished one itself, and each close is a
blocking round trip to its event loop).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("lmdeploy")
from lmdeploy.messages import PytorchEngineConfig, Response  # noqa: E402

from lmdq.contract import Endpoint  # noqa: E402
from lmdq.worker.engine_config import LMDeployConfig  # noqa: E402
from lmdq.worker.engines.base import EngineRequest  # noqa: E402
from lmdq.worker.engines.lmdeploy_engine import LMDeployEngine  # noqa: E402

WAIT_S = 30.0  # a bound on a wait for an event, never a measured duration


class _Session:
    def __init__(self, pipe: _Pipe) -> None:
        self.pipe = pipe
        self.aborted = threading.Event()
        self.closed = False

    def abort(self) -> None:
        self.aborted.set()
        self.pipe.wake.put(None)

    def close(self) -> None:
        self.closed = True


class _Pipe:
    def __init__(self) -> None:
        self.backend_config = PytorchEngineConfig(max_batch_size=8)
        self.sessions: list[_Session] = []
        self.wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self.first_sent = threading.Event()

    def session(self) -> _Session:
        s = _Session(self)
        self.sessions.append(s)
        return s

    def stream_infer(self, prompts: list[Any], sessions: list[_Session], **_: Any) -> Iterator[Response]:
        yield Response(text="done", generate_token_len=1, input_token_len=2, finish_reason="stop", index=0)
        self.first_sent.set()
        left = set(range(1, len(prompts)))
        while left:
            for i in sorted(left):
                if sessions[i].aborted.is_set():
                    left.discard(i)
                    yield Response(text="", generate_token_len=0, input_token_len=2, finish_reason="abort", index=i)
            if left:
                self.wake.get(timeout=WAIT_S)


def _until(cond: Any) -> bool:
    """Wait (bounded by WAIT_S) until ``cond()`` holds: the calls register from their own threads."""
    done = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):
        if cond():
            return True
        done.wait(0.01)
    return bool(cond())


def _requests(n: int) -> list[EngineRequest]:
    return [EngineRequest(index=i, prompt=f"p{i}", endpoint=Endpoint.completion) for i in range(n)]


def test_an_aborted_call_aborts_its_open_sessions_and_closes_only_those() -> None:
    pipe = _Pipe()
    eng = LMDeployEngine(pipe, LMDeployConfig(backend="pytorch"), model_name="m", emit_interval_s=0.0)
    abort = threading.Event()
    events: list[Any] = []
    t = threading.Thread(target=lambda: events.extend(eng.stream(_requests(4), abort)))
    t.start()
    assert pipe.first_sent.wait(WAIT_S)
    assert eng._aborts.watching() == 1
    abort.set()
    t.join(WAIT_S)
    assert not t.is_alive()
    assert [(e.index, e.finish_reason.value) for e in events] == [(0, "stop"), (1, "abort"), (2, "abort"),
                                                                   (3, "abort")]
    first, *rest = pipe.sessions
    assert not first.aborted.is_set() and not first.closed  # finished: LMDeploy removed it, nothing to send
    assert all(s.aborted.is_set() for s in rest)
    assert eng._aborts.watching() == 0


def test_one_watcher_thread_serves_every_call_and_ends_with_the_last() -> None:
    pipe = _Pipe()
    eng = LMDeployEngine(pipe, LMDeployConfig(backend="pytorch"), model_name="m", emit_interval_s=0.0)
    before = {t for t in threading.enumerate() if t.name == "lmdq-abort-watch"}  # another engine's, winding down
    aborts = [threading.Event() for _ in range(3)]
    threads = [threading.Thread(target=lambda a=a: list(eng.stream(_requests(2), a))) for a in aborts]
    for t in threads:
        t.start()
    assert _until(lambda: eng._aborts.watching() == 3)
    mine = [t for t in threading.enumerate() if t.name == "lmdq-abort-watch" and t not in before]
    assert len(mine) == 1
    for a in aborts:
        a.set()
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive()
    mine[0].join(WAIT_S)  # it sees no call left on its next poll and returns
    assert not mine[0].is_alive()
    assert eng._aborts.watching() == 0
