"""The real docker-compose.yml, run with the suite's override: ``docker compose --profile cpu up``.

The override (written by :func:`override`, from the real file, so the services keep their own
commands and settings) changes only what this machine needs:

* host networking for every service (the suite's engine runs with ``--bridge=none``), so each
  service gets a free port on 127.0.0.1 (Redis ``--port``, ``LMDQ_HEALTH_PORT``,
  ``LMDQ_EXPORTER_PORT``) and the Redis URL names 127.0.0.1 instead of the service name ``redis``;
  published ``ports:`` are dropped (``!reset``), as host networking has none;
* the locally made Redis image instead of Docker Hub's.

Everything else (images, profiles, healthchecks, restart policies, stop_grace_period, volumes,
register-model's one-shot) is the file users run.
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

import yaml

from tests.containers import harness as h

T = TypeVar("T")
COMPOSE_FILE = h.ROOT / "docker-compose.yml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Reset(str):
    """A YAML ``!reset`` node (compose: drop what the base file says)."""


def _reset_representer(dumper: yaml.SafeDumper, data: _Reset) -> yaml.Node:
    return dumper.represent_sequence("!reset", [])


yaml.SafeDumper.add_representer(_Reset, _reset_representer)


def override(redis_image: str, redis_port: int, health_port: int, exporter_port: int) -> dict[str, Any]:
    real = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    # interpolated by compose from the environment, as in the real file: the password is never written
    url = f"redis://:${{LMDQ_REDIS_PASSWORD:?set LMDQ_REDIS_PASSWORD}}@127.0.0.1:{redis_port}/0"
    services: dict[str, Any] = {}
    for name, svc in real.items():
        o: dict[str, Any] = {"network_mode": "host"}
        if "ports" in svc:
            o["ports"] = _Reset()
        env = svc.get("environment") or {}
        if "LMDQ_REDIS_URL" in env:
            o["environment"] = {"LMDQ_REDIS_URL": url}
        if "RQ_DASHBOARD_REDIS_URL" in env:
            o["environment"] = {"RQ_DASHBOARD_REDIS_URL": url}
        services[name] = o
    services["redis"]["image"] = redis_image
    # the real command, plus where to listen: host networking shares the machine's ports
    services["redis"]["command"] = [*real["redis"]["command"], "--port", str(redis_port), "--bind", "127.0.0.1"]
    services["redis"]["healthcheck"] = {
        **real["redis"]["healthcheck"], "test": ["CMD-SHELL", f"redis-cli -p {redis_port} ping | grep -q PONG"]}
    for worker in ("worker", "worker-cpu"):
        services[worker].setdefault("environment", {})["LMDQ_HEALTH_PORT"] = str(health_port)
    services["exporter"].setdefault("environment", {})["LMDQ_EXPORTER_PORT"] = str(exporter_port)
    return {"services": services}


class Stack:
    """One compose project of the real docker-compose.yml + the override, on the suite's engine."""

    def __init__(self, engine: h.Engine, workdir: Path, redis_image: str, log: IO[str]) -> None:
        self.engine = engine
        self.log = log
        self.project = f"lmdqtest{secrets.token_hex(3)}"
        self.password = secrets.token_hex(12)
        self.redis_port, self.health_port, self.exporter_port = free_port(), free_port(), free_port()
        self.override = workdir / "compose.test-override.yml"
        self.override.write_text(yaml.safe_dump(
            override(redis_image, self.redis_port, self.health_port, self.exporter_port),
            sort_keys=False))
        self.redis_url = f"redis://:{self.password}@127.0.0.1:{self.redis_port}/0"
        self.compose_exe = str(h.compose_binary())

    def compose(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        env = {**self.engine.env, "LMDQ_REDIS_PASSWORD": self.password}
        cmd = [self.compose_exe, "--project-name", self.project, "--project-directory", str(h.ROOT),
               "-f", str(h.ROOT / "docker-compose.yml"), "-f", str(self.override), *args]
        self.log.write(f"\n$ docker compose {' '.join(args)}\n")
        self.log.flush()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        self.log.write(proc.stdout + proc.stderr)
        self.log.flush()
        if check and proc.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} exited {proc.returncode}:\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def container(self, service: str) -> str:
        out = self.compose("ps", "--all", "-q", service).stdout.split()
        assert len(out) == 1, f"expected one {service} container, got {out}"
        return out[0]

    def state(self, service: str) -> dict[str, Any]:
        state: dict[str, Any] = self.engine.inspect(self.container(service))["State"]
        return state

    def health(self, service: str) -> str:
        st = self.state(service)
        return str((st.get("Health") or {}).get("Status") or st["Status"])

    def logs(self, service: str, tail: int = 60) -> str:
        return self.compose("logs", "--no-color", "--tail", str(tail), service, check=False).stdout

    def down(self) -> None:
        self.compose("--profile", "cpu", "--profile", "producer", "down", "--volumes", "--timeout", "130",
                     check=False, timeout=300)


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 0.5,
             on_timeout: Callable[[], str] | None = None) -> T:
    """Poll ``probe`` until it returns a value other than None/False (deadline only as a backstop)."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got is not None and got is not False:
            return got
        if time.monotonic() > deadline:
            extra = on_timeout() if on_timeout else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{extra}")
        time.sleep(interval)


def seconds(duration: str) -> float:
    """A compose duration ('120s', '1m30s') in seconds."""
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration):
        total += float(num) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[unit]
    return total


def http_get(url: str, timeout: float = 5) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return int(r.status), r.read().decode()


def parse_json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]
