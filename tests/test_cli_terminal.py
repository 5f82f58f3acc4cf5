"""``lmdq-producer`` at an 80-column terminal and with stdout/stderr captured (issue #19): ids and option
names are never cut, and ``status --watch`` writes a plain line per poll where no live bar can be drawn.

Every test runs the real CLI in a subprocess (stdout and stderr are pipes, not terminals)."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import IO

import pytest
import redis
import typer
from conftest import ROOT, run_cli

from lmdq.contract import Batch, BatchStatus, RequestCounts, Result, ResultStatus
from lmdq.redis.keys import Keys
from lmdq.results.store import ResultStore

CONTROL = re.compile(r"\x1b|\r")  # escape sequences or carriage returns: a live display, unreadable in a log


def _cols(env: dict[str, str], n: int) -> dict[str, str]:
    return {**env, "COLUMNS": str(n), "LINES": "25", "TERM": "xterm-256color"}


def _option_names(command: str) -> list[str]:
    from lmdq.producer.cli import app

    group = typer.main.get_command(app)
    assert isinstance(group, typer.core.TyperGroup)
    cmd = group.commands[command]
    params = cmd.get_params(typer.Context(cmd))  # with --help
    return [name for p in params for name in (*p.opts, *p.secondary_opts) if name.startswith("-")]


@pytest.mark.parametrize("command", ["submit", "status", "results", "list", "retry"])
def test_help_names_every_option_whole_at_80_columns(env: dict[str, str], command: str) -> None:
    names = _option_names(command)
    assert "--help" in names and len(names) > (30 if command == "submit" else 2)  # submit: generation flags too
    p = run_cli("lmdq.producer", command, "--help", env=_cols(env, 80))
    assert p.returncode == 0, p.stderr.decode()
    text = p.stdout.decode()
    missing = [n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)]
    assert not missing, f"cut or missing at 80 columns: {missing}\n{text}"
    assert "…" not in text and not CONTROL.search(text), text
    assert max(len(line) for line in text.splitlines()) <= 80, text


def _batch(store: ResultStore, status: BatchStatus, model: str, counts: RequestCounts) -> str:
    bid = f"batch_{uuid.uuid4().hex[:24]}"  # the shape lmdq's ids have (lmdq.contract.BATCH_ID_PATTERN)
    store.batches.create(Batch(id=bid, model=model, status=status, batch_size=8, request_counts=counts,
                             created_at=time.time()))
    return bid


@pytest.mark.parametrize("columns", [40, 80, 160])
def test_list_prints_batch_ids_whole(client: redis.Redis, prefix: str, env: dict[str, str], columns: int) -> None:
    """Wide: a table (only model and created wrap). 80 columns cannot hold it with 30-character ids: each id
    on its own line, the details wrapped between fields below it. Never an id cut or folded."""
    store = ResultStore(client, keys=Keys(prefix))
    long_model = "Qwen/Qwen2.5-72B-Instruct-AWQ-with-a-long-name"
    ids = [
        _batch(store, BatchStatus.in_progress, long_model, RequestCounts(total=1_000_000)),
        _batch(store, BatchStatus.queued, "sim", RequestCounts(total=3)),
        _batch(store, BatchStatus.cancelled, "meta-llama/Llama-3.1-8B-Instruct", RequestCounts(total=10)),
    ]
    p = run_cli("lmdq.producer", "list", env=_cols(env, columns))
    assert p.returncode == 0, p.stderr.decode()
    text = p.stdout.decode()
    lines = text.splitlines()
    for bid in ids:
        assert re.search(rf"(?<!\w){bid}(?!\w)", text), f"{bid} not whole in:\n{text}"
    assert "…" not in text and not CONTROL.search(text), text
    assert max(len(line) for line in lines) <= max(columns, len(long_model) + 10), text
    assert re.search(r"(?<!\d)1000000(?!\d)", text) and "in_progress" in text and "cancelled" in text, text
    if columns == 160:
        assert lines[0].split() == ["batch", "status", "model", "total", "completed", "failed", "created"], text
    else:
        assert [ln.split()[0] for ln in lines if ln.startswith("batch_")] == ids[::-1], text  # newest first
        assert f"model={long_model}" in text, text


@pytest.mark.parametrize("columns", [80, 160])
def test_list_counts_each_outcome_under_its_name_and_never_wraps_created(
        client: redis.Redis, prefix: str, env: dict[str, str], columns: int) -> None:
    """A cancelled batch of 40 is ``cancelled=40 failed=0``, as ``status`` says (bd9ca4b printed
    ``failed=40``: failed, cancelled and expired summed); each batch's created date and time stay on
    the line of its id (bd9ca4b's 10-character column folded the time under the date)."""
    store = ResultStore(client, keys=Keys(prefix))
    bid = _batch(store, BatchStatus.cancelled, "sim", RequestCounts(total=40))
    other = _batch(store, BatchStatus.completed, "HuggingFaceTB/SmolLM2-135M-Instruct", RequestCounts(total=7))
    client.hset(Keys(prefix).batch(bid), mapping={"completed": 3, "failed": 2, "cancelled": 30, "expired": 5})
    client.hset(Keys(prefix).batch(other), mapping={"completed": 7})
    p = run_cli("lmdq.producer", "list", env=_cols(env, columns))
    assert p.returncode == 0, p.stderr.decode()
    text = p.stdout.decode()
    assert max(len(line) for line in text.splitlines()) <= columns, text
    day = time.strftime("%Y-%m-%d", time.localtime())
    rows = {ln.split()[0]: ln for ln in text.splitlines() if ln.startswith("batch_")}
    for b in (bid, other):
        assert re.search(rf"{day} \d\d:\d\d", rows[b]), text  # date and time whole, beside the id
    if columns == 160:
        head = text.splitlines()[0].split()
        assert head == ["batch", "status", "model", "total", "completed", "failed", "cancelled", "expired",
                        "created"], text
        assert rows[bid].split()[1:8] == ["cancelled", "sim", "40", "3", "2", "30", "5"], text
        assert rows[other].split()[3:8] == ["7", "7", "0", "0", "0"], text
    else:
        block = text.split(bid, 1)[1].split("batch_", 1)[0]
        assert "total=40 completed=3 failed=2 cancelled=30 expired=5" in block, text


class _Lines:
    """A pipe's lines through a reader thread, so a test waits for the next one with a deadline (a watcher
    that writes nothing fails the test instead of hanging it)."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self._q: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(pipe,), daemon=True).start()

    def _pump(self, pipe: IO[bytes]) -> None:
        for raw in iter(pipe.readline, b""):
            self._q.put(raw.decode())
        self._q.put("")  # end of stream

    def next(self, timeout: float = 60) -> str:
        try:
            line = self._q.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no line in {timeout}s; so far: {self.seen}")
        self.seen.append(line)
        return line


def test_status_watch_prints_plain_progress_lines_when_not_a_terminal(
        client: redis.Redis, prefix: str, env: dict[str, str]) -> None:
    """The first line comes while the batch runs (not at the end), a later one shows the new counts, and stdout
    holds only the final status line. Each step waits on a line the watcher wrote, never on the clock
    (``--interval 0.05``: a line per poll; the default 30 s throttle is tests/test_progress.py's)."""
    store = ResultStore(client, keys=Keys(prefix))
    bid = _batch(store, BatchStatus.in_progress, "sim", RequestCounts(total=4))
    w = subprocess.Popen([sys.executable, "-m", "lmdq.producer", "status", bid, "--watch", "--interval", "0.05"],
                         env=_cols(env, 80), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert w.stderr is not None and w.stdout is not None
        err = _Lines(w.stderr)
        first = err.next()
        assert re.search(rf" {bid} in_progress 0/4 done \(0\.0%\) - req/s  - tok/s  ETA - ", first), first
        assert err.next().startswith("hint: no live worker serves model 'sim'"), err.seen
        store.write_result(Result(batch_id=bid, custom_id="r0", index=0, status=ResultStatus.completed, model="sim",
                                  generate_token_len=9))
        line = first
        while " 1/4 done" not in line:  # polls go on with no change until the write is seen
            assert line, "the watcher ended before the batch did"
            assert f" {bid} in_progress 0/4 done " in line, line
            line = err.next()
        assert re.search(r"\(25\.0%\) \d+\.\d req/s  \d[\d.,]* tok/s  ETA \S+ elapsed=", line), line
        store.batches.transition(bid, [BatchStatus.in_progress], BatchStatus.cancelled)
        out = w.stdout.read().decode()
        assert w.wait(timeout=120) == 0, err.seen
        while err.next():
            pass
    finally:
        if w.poll() is None:
            w.kill()
    assert out.splitlines() == [f"{bid}  cancelled  model=sim  total=4 completed=1 failed=0 cancelled=0 expired=0"]
    assert err.seen[-2].split(" ", 3)[1:3] == [bid, "cancelled"], err.seen
    assert " 1/4 done (25.0%) " in err.seen[-2] and " done elapsed=" in err.seen[-2], err.seen
    assert not CONTROL.search("".join(err.seen))


@pytest.mark.parametrize(("module", "args"), [("lmdq.worker", ()), ("lmdq_bench", ("efficiency",))])
def test_worker_and_bench_help_name_every_option_whole_at_80_columns(env: dict[str, str], module: str,
                                                                    args: tuple[str, ...]) -> None:
    """The worker's and the bench's --help too (their flags are generated from the engine configs)."""
    import importlib

    app = importlib.import_module(f"{module}.cli").app  # lmdq.worker's CLI: lmdq.worker.cli; the lab's: lmdq_bench.cli
    cmd = typer.main.get_command(app)
    if args:
        assert isinstance(cmd, typer.core.TyperGroup)
        cmd = cmd.commands[args[0]]
    names = [n for p in cmd.get_params(typer.Context(cmd)) for n in (*p.opts, *p.secondary_opts) if n.startswith("-")]
    assert "--help" in names and len(names) > 10
    p = run_cli(module, *args, "--help", env=_cols(env, 80))
    assert p.returncode == 0, p.stderr.decode()
    text = p.stdout.decode()
    missing = [n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)]
    assert not missing, f"cut or missing at 80 columns: {missing}\n{text}"
    assert "…" not in text and not CONTROL.search(text), text


def test_status_on_an_80_column_terminal_wraps_and_on_a_pipe_stays_one_line(env: dict[str, str],
                                                                             tmp_path: Path) -> None:
    """Issue 45: ``status BATCH`` printed a 122-column line on an 80-column terminal. On a terminal it wraps
    at spaces (every field kept); through a pipe it stays one record a line, for scripts."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"custom_id": "a", "prompt": "x"}\n')
    sub = run_cli("lmdq.producer", "submit", str(f), "--model", "a-rather-long-served-model-name-for-this-test",
                  "--allow-unknown-model", env=env)
    bid = sub.stdout.decode().strip().splitlines()[-1]
    piped = run_cli("lmdq.producer", "status", bid, env=_cols(env, 80)).stdout.decode().splitlines()
    assert len(piped) == 1 and len(piped[0]) > 80, piped
    rc, out = _on_a_terminal(["status", bid], _cols(env, 80))
    assert rc == 0, out.decode(errors="replace")
    shown = [ln.rstrip("\r") for ln in out.decode().split("\n") if ln.strip()]
    assert len(shown) > 1 and all(len(ln) <= 80 for ln in shown), shown
    assert " ".join(ln.strip() for ln in shown).split() == piped[0].split()


def _on_a_terminal(args: list[str], env: dict[str, str]) -> tuple[int, bytes]:
    """Run the CLI with stdin, stdout and stderr on one pseudo-terminal; its exit code and all it wrote."""
    import os
    import pty
    import select

    leader, follower = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "lmdq.producer", *args], env=env, cwd=ROOT,
                         stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    out = b""
    try:
        while p.poll() is None or select.select([leader], [], [], 0.2)[0]:
            if select.select([leader], [], [], 0.2)[0]:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
    finally:
        os.close(leader)
    return p.wait(60), out


def test_submit_on_a_terminal_draws_its_bars_and_a_pipe_gets_none(env: dict[str, str], tmp_path: Path) -> None:
    """submit draws its validating/staging bars only on a terminal (rich is imported only then: a piped
    submit starts sooner, tests/test_cli_startup.py); through pipes stderr stays free of control codes."""
    f = tmp_path / "p.jsonl"
    f.write_text("".join(f'{{"custom_id": "r{i}", "prompt": "x{i}"}}\n' for i in range(50)))
    args = ["submit", str(f), "--model", "sim", "--allow-unknown-model"]
    rc, out = _on_a_terminal(args, _cols(env, 80))
    assert rc == 0, out.decode(errors="replace")
    shown = out.decode(errors="replace")
    assert "validating lines" in shown and CONTROL.search(shown), shown
    assert re.search(r"batch_[0-9a-f]{24}", shown), shown
    piped = run_cli("lmdq.producer", *args, env=env)
    assert piped.returncode == 0, piped.stderr.decode()
    assert "validating" not in piped.stderr.decode() and not CONTROL.search(piped.stderr.decode())
