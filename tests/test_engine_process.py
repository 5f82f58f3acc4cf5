"""``LMDQ_ENGINE_PROCESS`` (issue 27): the engine in a ``spawn`` child of its own, the worker holding a proxy.

What must not change when the engine moves out of the worker's process: every event (text deltas, token
counts, finish reasons, logprobs, tensors) arrives as the engine made it; concurrent calls stay apart; an
abort ends a call's requests with ``abort``; the child dying (SIGKILL, as an OOM kill does) ends every call
in flight with :class:`EngineDead` and ``alive()`` turns False, which is what makes the worker re-queue held
work without charging it and exit 70. Real child processes (the sim engine in them), a real worker process
and a real redis-server; never a mocked pipe."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import redis

from lmdq.contract import Endpoint, FinishReason, GenerationParams, ResultStatus
from lmdq.redis.keys import Keys
from lmdq.results.store import ResultStore
from lmdq.worker.engine_config import SimConfig
from lmdq.worker.engines.base import EngineDead, EngineEvent, EngineRequest
from lmdq.worker.engines.engine_process import ChildSpec, EngineProcess
from lmdq.worker.engines.orphan_guard import descendants
from lmdq.worker.engines.sim import SimEngine
from lmdq.worker.outcomes import EXIT_ENGINE_DEAD
from tests.conftest import ROOT, run_cli
from tests.helpers import results_of, write_jsonl


def _spec(**sim: Any) -> ChildSpec:
    return ChildSpec(engine="sim", config=SimConfig(**sim).model_dump_json(), model=None, served_model_name="sim",
                     adapters={}, log_format="json", log_level="WARNING")


@pytest.fixture
def proc() -> Iterator[EngineProcess]:
    e = EngineProcess(_spec(step_ms=0.5, max_batch=64, emit_every=3))
    yield e
    e.close()


def _requests(n: int) -> list[EngineRequest]:
    reqs = []
    for i in range(n):
        rich: dict[str, Any] = {"logprobs": 3, "output_last_hidden_state": "generation"} if i % 3 == 0 else {}
        reqs.append(EngineRequest(index=i, prompt=f"tell me about item {i} " * (1 + i % 4),
                                  endpoint=Endpoint.completion,
                                  params=GenerationParams(max_new_tokens=4 + i % 9, ignore_eos=True, **rich)))
    return reqs


def _by_index(events: list[EngineEvent]) -> dict[int, list[EngineEvent]]:
    out: dict[int, list[EngineEvent]] = {}
    for ev in events:
        out.setdefault(ev.index, []).append(ev)
    return out


def test_every_event_arrives_as_the_engine_made_it(proc: EngineProcess) -> None:
    """The same requests through the sim in process and through the child: the same texts, counts, finish
    reasons, logprobs and tensors per request (the sim is deterministic from each prompt)."""
    reqs = _requests(24)
    here = SimEngine(model_name="sim", step_ms=0.5, max_batch=64, emit_every=3)
    try:
        want = _by_index(list(here.stream(reqs, threading.Event())))
    finally:
        here.close()
    got = _by_index(list(proc.stream(reqs, threading.Event())))
    assert proc.name == "sim" and proc.backend == "sim" and proc.model_name == "sim" and proc.capacity == 64
    assert sorted(got) == sorted(want) == list(range(24))
    for i, evs in got.items():
        final, ref = evs[-1], want[i][-1]
        assert [e.finish_reason for e in evs].count(None) == len(evs) - 1  # exactly one final event, last
        assert "".join(e.text for e in evs) == "".join(e.text for e in want[i])
        assert (final.finish_reason, final.generate_token_len, final.input_token_len) == (
            ref.finish_reason, ref.generate_token_len, ref.input_token_len)
        assert final.logprobs == ref.logprobs  # tuples again, ids and floats as sent
        if ref.tensors is None:
            assert final.tensors is None
        else:
            assert final.tensors is not None and set(final.tensors) == set(ref.tensors) == {"last_hidden_state"}
            assert np.array_equal(final.tensors["last_hidden_state"], ref.tensors["last_hidden_state"])
    assert proc.count_tokens("one two three") == 3


def test_concurrent_calls_stay_apart_and_an_abort_ends_only_its_own(proc: EngineProcess) -> None:
    long = [EngineRequest(index=i, prompt=f"long {i}", params=GenerationParams(max_new_tokens=100_000,
                                                                                ignore_eos=True)) for i in range(4)]
    abort = threading.Event()
    results: dict[str, list[EngineEvent]] = {}

    def run(name: str, reqs: list[EngineRequest], ab: threading.Event) -> None:
        results[name] = list(proc.stream(reqs, ab))

    t = threading.Thread(target=run, args=("long", long, abort))
    t.start()
    run("short", _requests(6), threading.Event())  # runs while the long call decodes
    abort.set()
    t.join(60)
    assert not t.is_alive()
    finals = {e.index: e for e in results["long"] if e.finish_reason is not None}
    assert sorted(finals) == [0, 1, 2, 3] and {e.finish_reason for e in finals.values()} == {FinishReason.abort}
    short = {e.index: e for e in results["short"] if e.finish_reason is not None}
    assert sorted(short) == list(range(6)) and {e.finish_reason for e in short.values()} == {FinishReason.length}
    assert proc.alive()


def test_the_child_dying_ends_every_call_with_engine_dead(proc: EngineProcess) -> None:
    reqs = [EngineRequest(index=0, prompt="forever", params=GenerationParams(max_new_tokens=100_000, ignore_eos=True))]
    it = proc.stream(reqs, threading.Event())
    first = next(it)  # the call is running in the child
    assert first.index == 0 and first.finish_reason is None
    pid = proc._proc.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineDead, match="killed by signal 9"):
        for _ in it:
            pass
    assert not proc.alive()
    with pytest.raises(EngineDead):  # later calls too, at once
        list(proc.stream(_requests(1), threading.Event()))


def test_a_worker_with_its_engine_in_a_child_completes_a_batch(tmp_path: Path, env: dict[str, str], prefix: str,
                                                               client: redis.Redis) -> None:
    """The real CLIs: submit, then ``lmdq-worker --engine sim --engine-process --burst``: every request ends
    completed with the sim's text, and the worker's log is JSON with the child's lines in it."""
    rows = [{"custom_id": f"r{i}", "prompt": f"question {i}", "params": {"max_new_tokens": 3 + i % 5}}
            for i in range(40)]
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    sub = run_cli("lmdq.producer", "submit", str(f), "--model", "sim", "--batch-size", "8",
                  "--allow-unknown-model", env=env)
    assert sub.returncode == 0, sub.stderr.decode()[-2000:]
    batch_id = sub.stdout.decode().strip().splitlines()[-1]
    w = run_cli("lmdq.worker", "--engine", "sim", "--sim-step-ms", "1", "--engine-process", "--burst", env=env,
                timeout=300)
    assert w.returncode == 0, w.stderr.decode()[-3000:]
    got = results_of(client, prefix, batch_id)
    assert sorted(r.custom_id for r in got) == sorted(r["custom_id"] for r in rows)
    assert all(r.status is ResultStatus.completed and r.text and r.backend == "sim" for r in got), got[:2]
    lines = w.stderr.decode().splitlines()
    assert all(ln.startswith("{") for ln in lines if ln.strip()), [ln for ln in lines if not ln.startswith("{")][:3]
    events = [json.loads(ln).get("event") for ln in lines if ln.strip()]
    assert "engine loaded" in events and "engine process closing" in events, events


def _start_worker(env: dict[str, str], *args: str) -> tuple[subprocess.Popen[bytes], list[str]]:
    """An ``lmdq-worker --engine-process`` process, returned once its log says ``worker started`` (its engine
    child built and answering); the log lines read so far."""
    p = subprocess.Popen([sys.executable, "-m", "lmdq.worker", "--engine", "sim", "--engine-process", *args],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    assert p.stderr is not None
    lines: list[str] = []
    for raw in p.stderr:  # ends at EOF if the worker exits first
        lines.append(raw.decode(errors="replace"))
        if '"worker started"' in lines[-1]:
            return p, lines
    p.wait(30)
    raise AssertionError(f"the worker exited {p.returncode} before it started: {''.join(lines)[-3000:]}")


def _engine_child(worker_pid: int) -> int:
    spawned = [pid for pid in descendants(worker_pid)
               if "multiprocessing.spawn" in " ".join(psutil.Process(pid).cmdline())]
    assert len(spawned) == 1, spawned
    return spawned[0]


def test_the_engine_process_killed_the_worker_exits_70_and_nothing_fails(tmp_path: Path, env: dict[str, str],
                                                                         prefix: str, client: redis.Redis) -> None:
    """What an OOM kill of the engine process does: the worker stops, exits 70, re-queues what it held
    without charging it; a fresh worker completes every request, each exactly once."""
    rows = [{"custom_id": f"r{i}", "prompt": f"question {i}", "params": {"max_new_tokens": 200, "ignore_eos": True}}
            for i in range(16)]
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    sub = run_cli("lmdq.producer", "submit", str(f), "--model", "sim", "--batch-size", "4", "--allow-unknown-model",
                  env=env)
    assert sub.returncode == 0, sub.stderr.decode()[-2000:]
    batch_id = sub.stdout.decode().strip().splitlines()[-1]
    p, lines = _start_worker(env, "--sim-step-ms", "20")
    try:
        os.kill(_engine_child(p.pid), signal.SIGKILL)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    log = "".join(lines) + err.decode(errors="replace")
    assert p.returncode == EXIT_ENGINE_DEAD, log[-3000:]
    assert "the engine process died (killed by signal 9)" in log, log[-3000:]
    assert ResultStore(client, keys=Keys(prefix)).batches.get(batch_id).request_counts.failed == 0
    again = run_cli("lmdq.worker", "--engine", "sim", "--sim-step-ms", "1", "--burst", env=env, timeout=300)
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    got = results_of(client, prefix, batch_id)
    assert sorted(r.custom_id for r in got) == sorted(r["custom_id"] for r in rows)  # each once
    assert all(r.status is ResultStatus.completed and r.generate_token_len == 200 for r in got)


def test_a_sigkilled_worker_takes_its_engine_process_with_it(env: dict[str, str]) -> None:
    p, _ = _start_worker(env)
    try:
        child = _engine_child(p.pid)
        below = descendants(p.pid)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
        deadline = time.monotonic() + 30  # the orphan guard's bound is 10 s (tests/test_orphan_guard.py)
        while time.monotonic() < deadline and any(psutil.pid_exists(pid) and psutil.Process(pid).status()
                                                  != psutil.STATUS_ZOMBIE for pid in below):
            time.sleep(0.1)
        left = [pid for pid in below if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        assert child in below and left == [], left
    finally:
        for pid in descendants(p.pid):
            with contextlib.suppress(Exception):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.model
def test_real_model_in_a_child_answers_as_it_does_in_process(tmp_path: Path, env: dict[str, str], prefix: str,
                                                             client: redis.Redis) -> None:
    """The transformers engine on the embedded SmolLM2 (CPU), greedy: the same texts and token counts with the
    engine in a child as in the worker's own process, and the child's loading bars come out as JSON
    ``progress`` events in the worker's log (the child logs as the worker does)."""
    rows = [{"custom_id": f"r{i}", "messages": [{"role": "user", "content": f"Name a colour number {i}."}]}
            for i in range(4)]
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    texts: dict[str, dict[str, tuple[str, int]]] = {}
    for side, extra in (("in process", ()), ("child", ("--engine-process",))):
        sub = run_cli("lmdq.producer", "submit", str(f), "--model", "smollm2-135m-instruct", "--allow-unknown-model",
                      "--max-new-tokens", "8", env=env)
        assert sub.returncode == 0, sub.stderr.decode()[-2000:]
        w = run_cli("lmdq.worker", "--engine", "transformers", "--burst", *extra, env=env, timeout=600)
        assert w.returncode == 0, w.stderr.decode()[-3000:]
        batch_id = sub.stdout.decode().strip().splitlines()[-1]
        got = results_of(client, prefix, batch_id)
        assert all(r.status is ResultStatus.completed for r in got), got
        texts[side] = {r.custom_id: (r.text or "", r.generate_token_len) for r in got}
        if extra:
            docs = [json.loads(ln) for ln in w.stderr.decode().splitlines() if ln.strip()]
            assert any(d.get("logger") == "tqdm" and d["event"] == "progress" for d in docs), docs[:5]
            assert "engine process closing" in [d["event"] for d in docs]
    assert texts["child"] == texts["in process"] and len(texts["child"]) == 4


def test_a_request_crosses_the_wire_unchanged() -> None:
    """What the child rebuilds is what the worker sent: endpoint, prompt or messages, continuations, adapter,
    and the params with what was set (a sample's seed from the fan-out's model_copy) and what was not."""
    from lmdq.worker.engines.engine_process import _request_from_wire, _request_to_wire

    base = GenerationParams(n=4, do_sample=True, temperature=0.7, stop_words=["\n\n"], logprobs=2,
                            response_format={"type": "json_object"})
    reqs = [EngineRequest(index=0, messages=[{"role": "user", "content": "hi"}], params=base),
            EngineRequest(index=1, prompt="raw text", endpoint=Endpoint.completion,
                          params=base.model_copy(update={"n": None, "random_seed": 2**63 - 1}), adapter="a1"),
            EngineRequest(index=2, prompt="Q: 2+2?", endpoint=Endpoint.score, continuations=(" 4", " 5"))]
    for r in reqs:
        back = _request_from_wire(json.loads(json.dumps(_request_to_wire(r))))
        assert back == r, (back, r)
        assert back.params.resolved() == r.params.resolved()
        assert back.params.model_fields_set == r.params.model_fields_set


def test_an_event_crosses_the_wire_unchanged() -> None:
    """Every field of an event the worker reads: a known error code and one lmdq does not know (kept
    verbatim), scores, reward, whole, the prefill count; tensors travel as their own frame."""
    from lmdq.contract import ErrorCode
    from lmdq.worker.engines.engine_process import _event_from_wire, _event_to_wire, _pack_tensors, _unpack_tensors

    evs = [EngineEvent(index=3, text="abc", input_token_len=5, generate_token_len=2, finish_reason=FinishReason.stop,
                       logprobs=[(7, -0.5, [(7, -0.5), (9, -1.25)])], whole=True, prefill_token_len=0),
           EngineEvent(index=1, finish_reason=FinishReason.error, error_code=ErrorCode.context_length_exceeded,
                       error_message="too long"),
           EngineEvent(index=2, finish_reason=FinishReason.error, error_code="some_new_engine_code"),
           EngineEvent(index=0, finish_reason=FinishReason.stop, scores=[(-1.5, 2, True), (-3.0, 1, None)],
                       reward=0.25),
           EngineEvent(index=4, text="par")]
    for ev in evs:
        back = _event_from_wire(json.loads(json.dumps(_event_to_wire(ev))), None)
        assert back == ev and type(back.error_code) is type(ev.error_code), (back, ev)  # the enum again
    t = {"logits": np.arange(12, dtype=np.float32).reshape(3, 4)}
    back = _unpack_tensors(_pack_tensors(t))
    assert set(back) == {"logits"} and np.array_equal(back["logits"], t["logits"])
    assert back["logits"].dtype == np.float32


def test_a_process_that_exits_without_close_ends_its_engine_child(tmp_path: Path) -> None:
    """An error between the engine's start and the worker's teardown: the interpreter exits without
    ``close()``. The child is not a daemon (it may start processes of its own) and multiprocessing joins
    it at exit: it must see the pipe close and end, not keep the exit waiting or outlive it."""
    script = tmp_path / "no_close.py"
    script.write_text("import sys\n"
                      f"sys.path.insert(0, {str(ROOT)!r})\n"
                      "from tests.test_engine_process import _spec\n"
                      "from lmdq.worker.engines.engine_process import EngineProcess\n"
                      "if __name__ == '__main__':\n"
                      "    e = EngineProcess(_spec(step_ms=1))\n"
                      "    print(e._proc.pid, flush=True)\n"
                      "    raise SystemExit(3)\n")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=120, cwd=ROOT)
    assert p.returncode == 3, p.stderr.decode()[-2000:]
    child = int(p.stdout.decode().split()[0])
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
