"""A new user's first hour (issue #26): every CLI error is ONE line starting ``error:`` with the documented
exit code (usage errors included), blamed on the flag or line that caused it; stdin and foreign files
are handled by name. Each test runs the real CLI in a subprocess against a real Redis."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from lmdq.contract import Batch, BatchStatus, RequestCounts
from lmdq.errors import ExitCode
from lmdq.redis.keys import Keys
from lmdq.results.store import ResultStore
from lmdq.submission.ledger import BatchLedger
from tests.conftest import ROOT, run_cli
from tests.helpers import write_jsonl


def _one_error(p: subprocess.CompletedProcess[bytes], code: int) -> str:
    """The single stderr line of a failed command (no usage block, no traceback)."""
    lines = p.stderr.decode().splitlines()
    assert p.returncode == code, (p.returncode, lines)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert not p.stdout, p.stdout
    return lines[0]


@pytest.fixture()
def prompts(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])


@pytest.mark.parametrize(("args", "expected"), [
    (("submit", "{f}", "--model", "sim", "--metadata", "foo"), "error: --metadata: expected k=v, got 'foo'"),
    (("results", "b", "--format", "xml"), "error: --format: expected lmdq or openai, got 'xml'"),
    (("submit", "{f}", "--max-new-tokens", "lots"), "error: --max-new-tokens: "),
    (("submit", "{f}", "--priority", "urgent"), "error: --priority: "),
    (("submit",), "error: Missing argument 'file'. (see '"),
    (("submit", "{f}", "--no-such-flag"), "error: No such option: --no-such-flag"),
    (("frobnicate",), "error: No such command 'frobnicate'."),
    (("submit", "{f}", "--model", "sim", "--allow-unknown-model", "--completion-window", "2"),
     "error: --completion-window: expected a duration with its unit (e.g. 24h, 90m, 2d, 3600s), got '2'"),
])
def test_usage_errors_are_one_line_exit_2(env: dict[str, str], prompts: Path, args: tuple[str, ...],
                                          expected: str) -> None:
    """bd9ca4b: click's three lines (Usage:, Try ..., Error: ...), and a bare --completion-window 2 was 2 s."""
    p = run_cli("lmdq.producer", *(a.format(f=prompts) for a in args), env=env)
    assert _one_error(p, ExitCode.bad_input).startswith(expected)


def test_worker_usage_error_is_one_line(env: dict[str, str]) -> None:
    p = run_cli("lmdq.worker", "--sim-step-ms", "fast", "--engine", "sim", env=env)
    assert _one_error(p, ExitCode.bad_input).startswith("error: --sim-step-ms: ")


def test_format_names_are_not_case_sensitive(env: dict[str, str], client: redis.Redis, prefix: str) -> None:
    store = ResultStore(client, keys=Keys(prefix))
    bid = "batch_" + "a" * 24
    store.batches.create(Batch(id=bid, model="sim", status=BatchStatus.completed, batch_size=1,
                             request_counts=RequestCounts(total=0), created_at=time.time()))
    p = run_cli("lmdq.producer", "results", bid, "--format", "OpenAI", env=env)
    assert p.returncode == 0, p.stderr


def test_results_to_an_unwritable_path_is_one_line(env: dict[str, str], client: redis.Redis, prefix: str) -> None:
    """bd9ca4b: a FileNotFoundError traceback."""
    store = ResultStore(client, keys=Keys(prefix))
    bid = "batch_" + "b" * 24
    store.batches.create(Batch(id=bid, model="sim", status=BatchStatus.completed, batch_size=1,
                             request_counts=RequestCounts(total=1), created_at=time.time()))
    p = run_cli("lmdq.producer", "results", bid, "-o", "/nonexistent/x.jsonl", env=env)
    assert _one_error(p, ExitCode.bad_input) == (
        "error: --output: cannot write '/nonexistent/x.jsonl': No such file or directory")


@pytest.mark.parametrize("name", ["x.jsonl", "x.parquet"])
def test_an_unwritable_output_fails_before_the_wait(env: dict[str, str], client: redis.Redis, prefix: str,
                                                    name: str) -> None:
    """-o is tried before waiting: exit 2 at once, not exit 1 once the wait timed out (a Parquet -o is
    written at the end, so its path is tried separately)."""
    store = ResultStore(client, keys=Keys(prefix))
    bid = "batch_" + ("c" if name.endswith("jsonl") else "d") * 24
    store.batches.create(Batch(id=bid, model="sim", status=BatchStatus.in_progress, batch_size=1,
                             request_counts=RequestCounts(total=1), created_at=time.time()))
    p = run_cli("lmdq.producer", "results", bid, "--wait", "--timeout", "600", "-o", f"/nonexistent/{name}",
                env=env)
    assert _one_error(p, ExitCode.bad_input) == (
        f"error: --output: cannot write '/nonexistent/{name}': No such file or directory")


def test_unknown_model_is_blamed_on_the_flag_or_the_line_that_named_it(env: dict[str, str], tmp_path: Path) -> None:
    """bd9ca4b: ``mixed.jsonl:0: field 'model'`` for a --model flag (there is no line 0, nor a field)."""
    f = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "a"}])
    line = _one_error(run_cli("lmdq.producer", "submit", str(f), "--model", "no-such-model", env=env),
                      ExitCode.bad_input)
    assert line.startswith("error: --model: unknown model 'no-such-model'; known: "), line
    body = {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}
    openai = write_jsonl(tmp_path / "o.jsonl", [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body} for i in range(3)])
    line = _one_error(run_cli("lmdq.producer", "submit", str(openai), env=env), ExitCode.bad_input)
    assert line.startswith(f"error: {openai}:1: field 'body.model': unknown model 'gpt-9'; "), line


def test_submit_dash_reads_stdin(env: dict[str, str], client: redis.Redis, prefix: str) -> None:
    """bd9ca4b: ``-:0: no such file``. JSONL or plain text (a first line that is not a JSON object)."""
    store = ResultStore(client, keys=Keys(prefix))
    for data, prompts in ((b'{"custom_id": "a", "prompt": "one"}\n{"prompt": "two"}\n', ["one", "two"]),
                          (b"first prompt\nsecond prompt\n", ["first prompt", "second prompt"])):
        p = run_cli("lmdq.producer", "submit", "-", "--model", "sim", "--allow-unknown-model", "--json", env=env,
                    input_=data)
        assert p.returncode == 0, p.stderr.decode()
        b = json.loads(p.stdout)
        assert b["request_counts"]["total"] == 2 and b["input_file"] == "-"
        batch = store.batches.get(b["id"])
        got = BatchLedger(client, keys=Keys(prefix), ttl_s=3600).source_requests(batch, [0, 1])
        assert [r.prompt for r in got] == prompts
    bad = run_cli("lmdq.producer", "submit", "-", "--model", "sim", "--allow-unknown-model", env=env,
                  input_=b'{"prompt": "ok"}\n{"prompt": 7}\n')
    line = _one_error(bad, ExitCode.bad_input)
    assert line.startswith("error: <stdin>:2: field 'prompt': "), line


@pytest.mark.parametrize(("name", "data", "what"), [
    # .parquet and .csv are read as tables (lmdq.client.sources, the client merge): only a Parquet file
    # under another name, and formats lmdq does not read, get the message
    ("prompts.bin", b"PAR1\x15\x04\x15\x10", "Parquet"),  # by its magic bytes, whatever its name
    ("prompts.tsv", b"prompt\tcustom_id\nhello\t1\n", "TSV"),
    ("prompts.arrow", b"ARROW1\x00\x00", "Arrow IPC"),
    ("prompts.jsonl.gz", b"\x1f\x8b\x08\x00", "gzip-compressed"),
])
def test_a_foreign_file_is_named_by_its_format(env: dict[str, str], tmp_path: Path, name: str, data: bytes,
                                               what: str) -> None:
    """bd9ca4b: "invalid JSON at column 1" on every line (20 of them)."""
    f = tmp_path / name
    f.write_bytes(data)
    line = _one_error(run_cli("lmdq.producer", "submit", str(f), "--model", "sim", "--allow-unknown-model",
                              env=env), ExitCode.bad_input)
    assert line.startswith(f"error: {f}: looks like {what}; expected a .txt file"), line


def test_parquet_and_csv_are_read_as_tables_not_refused_as_foreign(env: dict[str, str], tmp_path: Path) -> None:
    """The client's tabular support comes before the foreign-format check: a CSV with a ``prompt``
    column is submitted, a broken .parquet is one line naming the file as Parquet (not "looks like")."""
    f = tmp_path / "prompts.csv"
    f.write_bytes(b"prompt,custom_id\nhello,1\n")
    p = run_cli("lmdq.producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--json", env=env)
    assert p.returncode == 0, p.stderr.decode()
    assert json.loads(p.stdout)["request_counts"]["total"] == 1
    bad = tmp_path / "prompts.parquet"
    bad.write_bytes(b"PAR1\x15\x04\x15\x10")
    line = _one_error(run_cli("lmdq.producer", "submit", str(bad), "--model", "sim", "--allow-unknown-model",
                              env=env), ExitCode.bad_input)
    assert line.startswith(f"error: {bad}: cannot read the parquet file: "), line  # no line 0 (issue 45)


# ---- the worker's health port ---------------------------------------------------------------------


def _held_port() -> socket.socket:
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen()
    return s


def test_a_taken_health_port_is_one_line_naming_the_flag(env: dict[str, str]) -> None:
    """bd9ca4b: ``OSError: [Errno 98] Address already in use`` with a traceback (a second worker on the
    host, as the README's "one per GPU" has it). Refused before the engine loads."""
    with _held_port() as held:
        port = held.getsockname()[1]
        p = run_cli("lmdq.worker", "--engine", "sim", "--burst", "--health-port", str(port), env=env)
    assert p.returncode == ExitCode.bad_input
    lines = p.stderr.decode().splitlines()
    # the worker's stderr is JSON lines once logging is set up (worker/cli.py): the error is the last one,
    # as a plain line or as the event of a JSON line, and the only error
    said = [json.loads(ln).get("event", "") if ln.startswith("{") else ln for ln in lines]
    errors = [x for x in said if str(x).startswith("error: ")]
    assert len(errors) == 1 and said[-1] == errors[0] and "Traceback" not in p.stderr.decode(), lines
    line = errors[0]
    assert line.startswith(f"error: --health-port {port} (LMDQ_HEALTH_PORT): cannot listen on 0.0.0.0:{port}: "
                           "Address already in use"), line
    assert "--health-port auto" in line


def test_health_port_auto_takes_the_next_free_port_and_says_which(env: dict[str, str], tmp_path: Path,
                                                                  client: redis.Redis) -> None:
    """Port 8000 held (if this machine has it free): ``auto`` takes a later one, logs it, serves /readyz on it
    labelled with the real model name (bd9ca4b: ``model="default"``)."""
    import urllib.request

    held = None
    try:
        held = socket.socket()
        held.bind(("0.0.0.0", 8000))
        held.listen()
    except OSError:  # someone else holds 8000: auto must skip it just the same
        held = None
    log = tmp_path / "w.log"
    e = {**env, "LMDQ_HEALTH_PORT": "auto", "LMDQ_IDLE_WAIT_S": "1"}
    w = subprocess.Popen([sys.executable, "-m", "lmdq.worker", "--engine", "sim", "--served-model-name", "m-7b"],
                         env=e, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        port = None
        deadline = time.monotonic() + 60
        while port is None and time.monotonic() < deadline and w.poll() is None:
            for line in log.read_text().splitlines():
                ev = json.loads(line)
                if ev.get("event") == "health endpoint":
                    port, asked = ev["port"], ev["asked"]
            time.sleep(0.1)
        assert port is not None and 8000 < port < 8100 and asked == "auto", log.read_text()
        ready = None
        while ready is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
                    ready = json.loads(r.read())
            except OSError:
                time.sleep(0.1)
        assert ready is not None and ready["model"] == "m-7b", ready
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            metrics = r.read().decode()
        assert 'lmdq_worker_ready{model="m-7b",' in metrics and 'model="default"' not in metrics
    finally:
        w.terminate()
        w.wait(60)
        if held is not None:
            held.close()


@pytest.mark.parametrize("value", ["abc", "99999", "-1"])
def test_a_bad_health_port_is_one_sentence(env: dict[str, str], value: str) -> None:
    p = run_cli("lmdq.worker", "--engine", "sim", "--health-port", value, env=env)
    assert p.returncode == ExitCode.bad_input
    assert p.stderr.decode().splitlines()[-1] == (
        f"error: --health-port / LMDQ_HEALTH_PORT: expected a port 0-65535, 0 for no endpoint, or auto; got {value!r}")


def test_a_file_level_error_names_no_line_0(tmp_path: Path, env: dict[str, str]) -> None:
    """Issue 45: ``nope.csv:0: no such file``: a file-level error has no line; it names the file alone."""
    for name in ("nope.csv", "nope.jsonl"):
        p = run_cli("lmdq.producer", "submit", str(tmp_path / name), "--model", "m", env=env)
        assert p.returncode == 2, p.stderr.decode()
        err = p.stderr.decode().strip().splitlines()
        assert err == [f"error: {tmp_path / name}: no such file"], err


def test_column_errors_name_the_cli_flags_not_python_keywords(tmp_path: Path, env: dict[str, str],
                                                              client: redis.Redis, prefix: str) -> None:
    """Issue 45: the CLI said ``pass prompt_column=, messages_column= or template=`` (Python's words) for a CSV
    with no prompt column, and ``--params-column mnt`` repeated a 286-column error once per row."""
    q = tmp_path / "q.csv"
    q.write_text("question,mnt\nhi,3\nyo,4\nho,5\n")
    line = _one_error(run_cli("lmdq.producer", "submit", str(q), "--model", "sim", "--allow-unknown-model",
                              env=env), 2)
    assert line == (f"error: {q}: no 'prompt' or 'messages' column; pass --prompt-column, --messages-column or "
                    "--template (the source has: question, mnt)"), line
    line = _one_error(run_cli("lmdq.producer", "submit", str(q), "--model", "sim", "--allow-unknown-model",
                              "--prompt-column", "question", "--params-column", "mnt", env=env), 2)
    assert line.startswith("error: --params-column: 'mnt' is not a generation parameter (max_new_tokens, "), line
    assert len(line) <= 130 and "row" not in line, line
    txt = tmp_path / "p.txt"
    txt.write_text("hi\n")
    line = _one_error(run_cli("lmdq.producer", "submit", str(txt), "--model", "sim", "--allow-unknown-model",
                              "--prompt-column", "x", env=env), 2)
    assert "(--prompt-column, --id-column, --template ...)" in line and "=" not in line.split(":", 2)[2], line
    assert not client.keys(f"{prefix}:*batch*"), "nothing enqueued"
