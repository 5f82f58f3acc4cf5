"""lmdq-api's timeouts and caps (issue #44): a real ``lmdq-api`` process with a 1,024-fd limit on
127.0.0.1, a real redis-server, raw sockets for misbehaving clients and the ``openai`` SDK for the rest.

Timeouts are set small through the env so each test runs in seconds; assertions wait (bounded) for
the server to close a socket, never race the wall clock tightly.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.conftest import run_cli

KEY = f"limits-key-{uuid.uuid4().hex}"
FD_LIMIT = 1024


class Server:
    def __init__(self, url: str, port: int, log: Path, files_dir: Path, proc: subprocess.Popen[bytes]) -> None:
        self.url, self.port, self.log, self.files_dir, self.proc = url, port, log, files_dir, proc

    def log_lines(self) -> list[str]:
        return self.log.read_text().splitlines()


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


@pytest.fixture(scope="module")
def srv(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("limits")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    env = dict(os.environ)
    env.update({"LMDQ_REDIS_URL": redis_url, "LMDQ_KEY_PREFIX": f"lim{uuid.uuid4().hex[:8]}",
                "LMDQ_LOG_FORMAT": "json", "LMDQ_API_KEYS": f"t:{KEY}", "LMDQ_API_FILES_DIR": str(work / "files"),
                "LMDQ_API_POLL_INTERVAL_S": "0.1", "LMDQ_KNOWN_MODELS": '["sim"]', "PYTHONUNBUFFERED": "1",
                "LMDQ_API_HEADER_TIMEOUT_S": "2", "LMDQ_API_BODY_TIMEOUT_S": "1", "LMDQ_API_IDLE_TIMEOUT_S": "2",
                "LMDQ_API_MAX_UPLOADS": "2"})
    log = work / "api.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lmdq.api", "--port", str(port)], env=env, stdout=out,
                                stderr=subprocess.STDOUT, preexec_fn=_limit_fds)
    server = Server(f"http://127.0.0.1:{port}", port, log, work / "files", proc)
    try:
        for _ in range(600):
            assert proc.poll() is None, log.read_text()[-2000:]
            if _get(server.url + "/readyz")[0] == 200:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("lmdq-api not ready: " + log.read_text()[-2000:])
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    for line in text.splitlines():
        json.loads(line)  # JSON lines only: no bare tracebacks
    assert "Traceback" not in text and "internal error" not in text


def _get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """True once the server closed ``sock`` (EOF or reset), waiting at most ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))  # not select(): these fds may be over 1024
        try:
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            return False
        except (ConnectionResetError, BrokenPipeError):
            return True
    return False


def _upload_head(port: int, body_len: int) -> tuple[socket.socket, bytes]:
    """A socket with a POST /v1/files head and the form's first bytes sent; the rest of the form."""
    boundary = "lmdqlimits"
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}}) + "\n"
    form = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x.jsonl\"\r\n"
            "Content-Type: application/jsonl\r\n\r\n").encode() + (line * (body_len // len(line) + 1)).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    head = (f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {len(form) + len(tail)}\r\n"
            "\r\n").encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(head + form[:4096])
    return s, form[4096:] + tail


def _parts(srv: Server) -> list[str]:
    return [p.name for p in srv.files_dir.iterdir() if p.name.endswith(".part")] if srv.files_dir.is_dir() else []


def _wait_log(srv: Server, pred: Any, polls: int = 100) -> dict[str, Any]:
    for _ in range(polls):
        for line in srv.log_lines():
            rec = json.loads(line)
            if pred(rec):
                return dict(rec)
        time.sleep(0.1)
    raise AssertionError("no such log line: " + "\n".join(srv.log_lines()[-20:]))


def _sdk(srv: Server) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)


# ------------------------------------------------------------------------------------------------


def test_idle_connection_flood_under_a_1024_fd_limit(srv: Server) -> None:
    pid = srv.proc.pid
    assert f"{FD_LIMIT}" in Path(f"/proc/{pid}/limits").read_text().split("Max open files")[1].split("\n")[0]
    start_line = len(srv.log_lines())
    socks: list[socket.socket] = []
    try:
        for i in range(1100):  # connect and send nothing, or only part of a request head
            s = socket.socket()
            s.settimeout(5)
            s.connect(("127.0.0.1", srv.port))
            if i % 2:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            socks.append(s)
        # legitimate requests are answered during the flood (the oldest idle sockets give way) and after it
        answered = 0
        for _ in range(5):
            for _attempt in range(20):
                if _get(srv.url + "/healthz", timeout=3)[0] == 200:
                    answered += 1
                    break
        assert answered == 5
        c = _sdk(srv)
        assert c.files.list().object == "list"
        # every idle socket is closed by the server (header timeout 2 s, or given way to newer ones)
        deadline = time.monotonic() + 30
        for s in socks:
            assert _closed_by_server(s, max(0.1, deadline - time.monotonic()))
    finally:
        for s in socks:
            s.close()
    assert _get(srv.url + "/healthz")[0] == 200
    episode = srv.log_lines()[start_line:]
    assert len(episode) < 100, episode[:20]
    assert not any("Too many open files" in line and "accept_failing" not in line for line in episode)


def test_trickling_upload_is_closed_by_the_body_timeout(srv: Server) -> None:
    s, rest = _upload_head(srv.port, 8192)
    try:
        closed = False
        for i in range(10):  # a byte every 3 s: three times the 1 s body timeout
            try:
                s.sendall(rest[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if _closed_by_server(s, 3):
                closed = True
                break
        assert closed, "the server kept a trickling upload open"
    finally:
        s.close()
    rec = _wait_log(srv, lambda r: r.get("event") == "client_disconnected" and r.get("closed_by") == "body_timeout")
    assert rec["level"] == "info"
    for _ in range(50):
        if not _parts(srv):
            break
        time.sleep(0.1)
    assert _parts(srv) == []


def test_dropped_upload_leaves_no_part_file_and_no_500(srv: Server) -> None:
    before = len(srv.log_lines())
    s, _rest = _upload_head(srv.port, 1 << 20)
    time.sleep(0.3)  # the upload is under way
    s.close()
    _wait_log(srv, lambda r: r.get("event") == "client_disconnected" and r.get("closed_by") == "client")
    for _ in range(50):
        if not _parts(srv):
            break
        time.sleep(0.1)
    assert _parts(srv) == []
    new = srv.log_lines()[before:]
    assert not any('"status": 500' in line or "internal error" in line for line in new), new


def test_uploads_over_the_cap_get_503_with_retry_after(srv: Server) -> None:
    stop = threading.Event()
    held = [_upload_head(srv.port, 1 << 20) for _ in range(2)]

    def keep_alive() -> None:  # a byte every 0.3 s: under the 1 s body timeout, so both stay in progress
        i = 0
        while not stop.is_set():
            for s, rest in held:
                s.sendall(rest[i:i + 1])
            i += 1
            stop.wait(0.3)

    t = threading.Thread(target=keep_alive, daemon=True)
    t.start()
    try:
        c = _sdk(srv)
        got: openai.APIStatusError | None = None
        for _ in range(30):
            try:
                c.files.create(file=("x.jsonl", b'{"custom_id": "a"}\n'), purpose="batch")
            except openai.APIStatusError as e:
                got = e
                break
            time.sleep(0.1)
        assert got is not None and got.status_code == 503
        assert got.response.headers.get("retry-after")
        assert "LMDQ_API_MAX_UPLOADS" in got.message
    finally:
        stop.set()
        t.join(5)
        for s, _ in held:
            s.close()
    # once they are gone, uploads are taken again
    for _ in range(50):
        try:
            _sdk(srv).files.create(file=("x.jsonl", b'{"custom_id": "a"}\n'), purpose="batch")
            break
        except openai.APIStatusError:
            time.sleep(0.1)
    else:
        raise AssertionError("uploads still refused after the held ones closed")


@pytest.mark.parametrize("window", ["1e400d", "9" * 400 + "d", "inf h", "nan", "-1h", "0h", "400d", "24"])
def test_bad_completion_window_is_a_400_naming_it(srv: Server, window: str) -> None:
    c = _sdk(srv)
    f = c.files.create(file=("x.jsonl", b'{"custom_id": "a"}\n'), purpose="batch")
    with pytest.raises(openai.BadRequestError) as ei:
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window=window)  # type: ignore[arg-type]
    assert ei.value.param == "completion_window" and "completion_window" in ei.value.message


@pytest.mark.parametrize("params", [{"limit": "0"}, {"limit": "abc"}, {"limit": "1" + "0" * 400}])
def test_bad_list_limit_is_a_400_naming_it(srv: Server, params: dict[str, str]) -> None:
    req = urllib.request.Request(f"{srv.url}/v1/batches?limit={params['limit']}",
                                 headers={"Authorization": f"Bearer {KEY}"})
    try:
        urllib.request.urlopen(req, timeout=10)
        raise AssertionError("accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400
        assert json.loads(e.read())["error"]["param"] == "limit"


def test_missing_custom_id_has_its_own_code(srv: Server) -> None:
    c = _sdk(srv)
    line = {"method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}}
    f = c.files.create(file=("x.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for _ in range(300):
        b = c.batches.retrieve(b.id)
        if b.status in ("failed", "completed", "in_progress"):
            break
        time.sleep(0.05)
    assert b.status == "failed" and b.errors is not None and b.errors.data
    err = b.errors.data[0]
    assert err.code == "missing_required_parameter" and err.param == "custom_id" and err.line == 1


def test_output_expires_after_overflow_is_a_400_naming_it(srv: Server) -> None:
    c = _sdk(srv)
    f = c.files.create(file=("x.jsonl", b'{"custom_id": "a"}\n'), purpose="batch")
    body = json.dumps({"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
                       "output_expires_after": {"anchor": "created_at", "seconds": "SECONDS"}})
    body_bytes = body.replace('"SECONDS"', "1e999").encode()  # a number that parses as inf
    req = urllib.request.Request(f"{srv.url}/v1/batches", data=body_bytes, method="POST",
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=10)
        raise AssertionError("accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400
        assert json.loads(e.read())["error"]["param"] == "output_expires_after.seconds"


def test_dropped_json_body_is_not_a_500(srv: Server) -> None:
    before = len(srv.log_lines())
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    s.sendall((f"POST /v1/batches HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
               "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"input").encode())
    time.sleep(0.2)
    s.close()
    # FastAPI reads a JSON body before the handler runs and answers a cut-off one 400 itself
    _wait_log(srv, lambda r: r.get("event") in ("client_disconnected", "request") and r.get("tenant") is None
              and r.get("route") == "/v1/batches" and r.get("status") in (400, None))
    new = srv.log_lines()[before:]
    assert not any("internal error" in line or '"status": 500' in line for line in new), new


def test_the_default_ports_are_distinct_and_a_port_in_use_is_exit_2_in_one_line(env: dict[str, str]) -> None:
    """Issue 45: the README's ``lmdq-api --port 8000`` collided with the worker's health port 8000: lmdq-api
    logged "ready", then uvicorn's ``[Errno 98]``, exit 3 (the code kept for Redis). The defaults differ
    now, and a port in use is one line naming it and the flag, exit 2."""
    from lmdq.api.settings import ApiSettings
    from lmdq.metrics.exporter import ExporterSettings
    from lmdq.worker.settings import WorkerSettings

    ports = {ApiSettings.model_fields["api_port"].default, ExporterSettings.model_fields["exporter_port"].default,
             WorkerSettings.model_fields["health_port"].default}
    assert len(ports) == 3, ports
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        p = run_cli("lmdq.api", "--host", "127.0.0.1", "--port", str(port),
                    env={**env, "LMDQ_API_KEYS": "t:" + "k" * 32}, timeout=60)
    err = [ln for ln in p.stderr.decode().splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr.decode()[-2000:]
    assert f"127.0.0.1:{port} is already in use" in err[-1] and "--port" in err[-1], err
    assert "Traceback" not in p.stderr.decode()
