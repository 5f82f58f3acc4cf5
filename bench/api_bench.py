"""lmdq-api under load: a large upload's peak server memory, and many clients polling one batch.

    lmdq-bench api [--upload-mb 200] [--clients 50] [--polls 40] [--redis-url URL] [--submit]

Starts a real redis-server (unless ``--redis-url``) and a real ``lmdq-api`` process on 127.0.0.1, and
drives it through the official ``openai`` SDK (only ``base_url`` and ``api_key`` set):

1. ``files.create`` of a generated OpenAI Batch file of ``--upload-mb`` MB; the server's peak RSS is
   the kernel's high-water mark (``VmHWM`` in ``/proc/<pid>/status``), read before and after, so a
   short spike between two samples cannot be missed.
2. ``--clients`` threads, each with its own SDK client, ``batches.retrieve`` the same running batch
   ``--polls`` times at once (no worker runs, so it stays ``in_progress``); errors, latency
   percentiles and requests/s are printed.

Prints a table, then one JSON line (the numbers). The pass/fail targets (peak < 300 MB, 0 errors)
are reported, not asserted: tests/test_api.py holds the deterministic checks.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lmdq_bench.local_redis import local_redis

__all__ = ["ApiProcess", "report", "run", "write_batch_file"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status_kb(pid: int, field: str) -> int:
    """A ``VmRSS``/``VmHWM`` line of /proc/<pid>/status, in kB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


class ApiProcess:
    """A real ``lmdq-api`` process (``python -m lmdq.api``) on 127.0.0.1, for tests and benches."""

    def __init__(self, *, redis_url: str, prefix: str, keys: dict[str, str], files_dir: Path,
                 log: Path, env: dict[str, str] | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.files_dir = files_dir
        e = dict(os.environ)
        e.update({"LMDQ_REDIS_URL": redis_url, "LMDQ_KEY_PREFIX": prefix, "LMDQ_LOG_FORMAT": "json",
                  "LMDQ_API_KEYS": ",".join(f"{t}:{k}" for t, k in keys.items()),
                  "LMDQ_API_FILES_DIR": str(files_dir), "LMDQ_API_POLL_INTERVAL_S": "0.1",
                  "PYTHONUNBUFFERED": "1"})
        e.update(env or {})
        self._env = e
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout_s: float = 60) -> ApiProcess:
        import urllib.error
        import urllib.request

        out = open(self.log, "ab")  # noqa: SIM115 - the child holds it; closed with the process
        self.proc = subprocess.Popen([sys.executable, "-m", "lmdq.api", "--port", str(self.port)], env=self._env,
                                     stdout=out, stderr=subprocess.STDOUT)
        out.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmdq-api exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"lmdq-api not ready after {timeout_s}s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def peak_rss_bytes(self) -> int:
        """The process's RSS high-water mark since it started (the kernel's, exact)."""
        return _status_kb(self.pid, "VmHWM") * 1024

    def rss_bytes(self) -> int:
        return _status_kb(self.pid, "VmRSS") * 1024


def write_batch_file(path: Path, target_bytes: int, *, model: str = "sim",
                     endpoint: str = "/v1/chat/completions") -> int:
    """An OpenAI Batch file of about ``target_bytes`` (~1 KB lines); returns its line count."""
    filler = "lorem ipsum dolor sit amet " * 32
    n = 0
    size = 0
    with open(path, "w") as f:
        while size < target_bytes:
            line = json.dumps({"custom_id": f"req-{n}", "method": "POST", "url": endpoint,
                               "body": {"model": model, "max_tokens": 4,
                                        "messages": [{"role": "user", "content": f"{n} {filler}"}]}}) + "\n"
            f.write(line)
            size += len(line)
            n += 1
    return n


@contextmanager
def _server(redis_url: str | None, keys: dict[str, str]) -> Iterator[tuple[ApiProcess, Path]]:
    work = Path(tempfile.mkdtemp(prefix="lmdq-api-bench-"))
    try:
        with local_redis(redis_url) as url:
            api = ApiProcess(redis_url=url, prefix=f"bench{os.getpid()}", keys=keys, files_dir=work / "files",
                             log=work / "api.log", env={"LMDQ_KNOWN_MODELS": '["sim"]'}).start()
            try:
                yield api, work
            finally:
                api.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def run(upload_mb: int, clients: int, polls: int, redis_url: str | None, submit: bool = False) -> dict[str, Any]:
    from openai import OpenAI

    key = "bench-" + "k" * 24
    res: dict[str, Any] = {"upload_mb": upload_mb, "clients": clients, "polls_per_client": polls}
    with _server(redis_url, {"bench": key}) as (api, work):
        sdk = OpenAI(base_url=api.url + "/v1", api_key=key)
        big = work / "big.jsonl"
        lines = write_batch_file(big, upload_mb * 1_000_000)
        res["upload_lines"] = lines
        before = api.peak_rss_bytes()
        t0 = time.perf_counter()
        with open(big, "rb") as fh:
            f = sdk.files.create(file=("big.jsonl", fh), purpose="batch")
        dt = time.perf_counter() - t0
        after = api.peak_rss_bytes()
        assert f.bytes == big.stat().st_size, (f.bytes, big.stat().st_size)
        res.update(upload_bytes=f.bytes, upload_s=round(dt, 2), upload_mb_per_s=round(f.bytes / 1e6 / dt, 1),
                   server_peak_rss_mb_before=round(before / 2**20, 1), server_peak_rss_mb=round(after / 2**20, 1),
                   server_peak_rss_growth_mb=round((after - before) / 2**20, 1))
        big.unlink()
        if submit:  # the uploaded file as a batch: lmdq validates and enqueues all of it in the server
            t0 = time.perf_counter()
            b = sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            for _ in range(36_000):  # bounded: an hour at most
                b = sdk.batches.retrieve(b.id)
                if b.status != "validating":
                    break
                time.sleep(0.1)
            res.update(submit_status=b.status, submit_s=round(time.perf_counter() - t0, 1),
                       submit_requests=b.request_counts.total if b.request_counts else 0,
                       server_peak_rss_mb_after_submit=round(api.peak_rss_bytes() / 2**20, 1))

        small = work / "small.jsonl"
        write_batch_file(small, 20_000)
        with open(small, "rb") as fh:
            sf = sdk.files.create(file=("small.jsonl", fh), purpose="batch")
        b = sdk.batches.create(input_file_id=sf.id, endpoint="/v1/chat/completions", completion_window="24h")
        for _ in range(600):  # validation of a small file: bounded wait
            b = sdk.batches.retrieve(b.id)
            if b.status != "validating":
                break
            time.sleep(0.05)
        res["polled_status"] = b.status
        latencies: list[float] = []
        errors: list[str] = []
        statuses: set[str] = set()
        lock = threading.Lock()
        barrier = threading.Barrier(clients)

        def poller() -> None:
            c = OpenAI(base_url=api.url + "/v1", api_key=key)
            barrier.wait()
            for _ in range(polls):
                t = time.perf_counter()
                try:
                    got = c.batches.retrieve(b.id)
                    with lock:
                        latencies.append(time.perf_counter() - t)
                        statuses.add(got.status)
                except Exception as e:  # counted, not raised: the bench reports errors
                    with lock:
                        errors.append(type(e).__name__)

        threads = [threading.Thread(target=poller) for _ in range(clients)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        res.update(poll_requests=len(latencies) + len(errors), poll_errors=len(errors),
                   poll_error_kinds=sorted(set(errors)), poll_statuses=sorted(statuses),
                   poll_req_per_s=round(len(latencies) / wall, 1), poll_p50_ms=round(_pct(latencies, 0.5) * 1000, 1),
                   poll_p99_ms=round(_pct(latencies, 0.99) * 1000, 1),
                   server_peak_rss_mb_end=round(api.peak_rss_bytes() / 2**20, 1))
    res["target_peak_rss_under_300mb"] = res["server_peak_rss_mb"] < 300
    res["target_no_poll_errors"] = res["poll_errors"] == 0
    return res


def report(res: dict[str, Any], *, clients: int, polls: int, submit: bool) -> None:
    """The table, then the JSON line (``lmdq-bench api`` prints what :func:`run` measured)."""
    rows = [
        ("upload", f"{res['upload_bytes'] / 1e6:,.0f} MB in {res['upload_s']} s ({res['upload_mb_per_s']} MB/s)"),
        ("peak RSS", f"{res['server_peak_rss_mb_before']} MB before -> {res['server_peak_rss_mb']} MB after "
                     f"(target < 300 MB: {'ok' if res['target_peak_rss_under_300mb'] else 'MISSED'})"),
        ("pollers", f"{clients} x {polls} retrieve = {res['poll_requests']} requests, "
                    f"{res['poll_errors']} errors, {','.join(res['poll_statuses'])}"),
        ("poll latency", f"p50 {res['poll_p50_ms']} ms, p99 {res['poll_p99_ms']} ms, {res['poll_req_per_s']} req/s"),
    ]
    if submit:
        peak = res["server_peak_rss_mb_after_submit"]
        rows.insert(2, ("submit", f"{res['submit_requests']:,} requests {res['submit_status']} in "
                                  f"{res['submit_s']} s, peak RSS {peak} MB"))
    for name, text in rows:
        print(f"{name:<13} {text}")
    print(json.dumps(res))
