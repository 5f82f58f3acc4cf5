"""``lmdq-bench e2e``: the real CLIs as separate processes against a raw ``pipe()``, same prompts, one run.

What a user compares: their own script calling ``pipe(prompts)`` on a loaded pipeline, against lmdq as
deployed: an ``lmdq-worker`` process already up (``/readyz`` 200) and, per batch, an ``lmdq-producer
submit`` process started on the same JSONL. lmdq's time for a batch runs from the moment its submit
process is *started* (interpreter start, imports, validation and staging included: the GPU waits for
all of it) to the last result stored (the batch's ``completed_at``, stamped by the Lua that stores it).
The raw side's time is the ``pipe()`` call alone. Both sides run ``--batches`` batches one after the
other on one warm engine each (the raw side gets the worker's warm-up too, unless ``--no-raw-warmup``),
and the first batch is reported apart: with KEDA scaling from zero every worker's first batch is a
first batch. The two sides run one after the other (one GPU), the raw side first.

``--interleave`` (:func:`run_interleaved`) instead loads the raw process and every worker at the same
time and runs batch ``b`` of each side back to back, the others idle, raw first on even batches and last
on odd ones: GPU drift between batches (±17 % on the H200 between identical raw batches) then lands on
both sides of each per-batch ratio instead of between them. The engines share the GPU's memory, so each
needs the same KV cache as a block count (``--num-gpu-blocks`` on PyTorch, ``--cache-max-entry-count``
above 1 on TurboMind; the CLI refuses a fraction: each engine would take its share of what the others left).

Workloads (``--workload``): ``mixed`` — completion prompts of 32-512 tokens, 16-1,024 new tokens each,
``ignore_eos`` (for the random Llama-3-8B shape: every request decodes exactly its budget); ``chat`` —
varied chat questions, greedy, stopping at EOS (for the real SmolLM2 chat model), up to
``--chat-max-new-tokens`` each; ``image`` (issue 48) — one chat question about one image per request (a
vision-language model, e.g. ``python -m lmdq_bench.tiny_vlm OUT --width 1024 --depth 4 --image-size 336``),
the images written as JPEG files beside the workload and named by absolute path: the raw ``pipe()`` gets the
same messages (LMDeploy's VL path reads the files itself), the lmdq worker reads each file and hands LMDeploy
a data: URL; ``ignore_eos`` with ``--chat-max-new-tokens`` each, so both sides decode the same tokens.

Submit doors (a ``--lmdq-variant``'s bench key ``SUBMIT``, never passed to the worker): ``SUBMIT=cli`` (the
default) starts the ``lmdq-producer submit`` process per batch described above, what a shell user waits for;
``SUBMIT=python`` calls ``lmdq.Client(...).submit(...)`` in this driver process instead (the same file, model,
job size, Redis and key prefix), what a user's running Python process does, like the raw side's ``pipe()``
call: no interpreter start, and lmdq's client already imported. ``--lmdq-variant cli --lmdq-variant
api:SUBMIT=python`` reports both doors side by side in one run; each side's batch records say ``submit``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmdq.redis.connection import connect
from lmdq.redis.keys import Keys
from lmdq.results.store import ResultStore
from lmdq_bench.finished_batch import read_finished, timeline, wait_terminal
from lmdq_bench.gpu_monitor import GpuMonitor
from lmdq_bench.occupancy import batch_occupancy, occupancy_events
from lmdq_bench.proc_cpu import cpu_delta, tree_cpu

__all__ = ["SUBMIT_DOORS", "E2EConfig", "Variant", "make_workload", "parse_variant", "run_e2e", "run_interleaved",
           "summarize"]

_TOPICS = ["the ocean", "volcanoes", "the Roman empire", "photosynthesis", "black holes", "bees", "jazz",
           "the printing press", "glaciers", "the immune system", "chess", "electric cars", "coffee", "deserts",
           "the moon landing", "rainforests", "vaccines", "bridges", "the internet", "tea", "whales",
           "earthquakes", "the piano", "recycling", "the stock market", "dinosaurs", "solar panels", "trains",
           "honey", "castles", "the human heart", "clouds"]
_ASKS = ["Write a short story about {t}.", "Explain {t} to a ten-year-old.", "List five facts about {t}.",
         "Write a poem about {t}.", "What are the pros and cons of {t}?", "Describe the history of {t}.",
         "Give me three questions a teacher could ask about {t}, with answers.",
         "Write a product description inspired by {t}."]


SUBMIT_DOORS = ("cli", "python")
"""How an lmdq side submits each batch (a variant's ``SUBMIT``): an ``lmdq-producer submit`` process, or
``lmdq.Client.submit`` called in the driver process."""


@dataclass(frozen=True)
class Variant:
    """One lmdq side (``--lmdq-variant``): its name, the extra ``LMDQ_*`` env its worker starts with, and its
    submit door (a bench key: it never reaches the worker's env)."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    submit: str = "cli"


@dataclass
class E2EConfig:
    engine: str = "lmdeploy"
    workload: str = "mixed"
    n: int = 1024
    batches: int = 3
    batch_size: int = 32
    min_input: int = 32
    max_input: int = 512
    min_output: int = 16
    max_output: int = 1024
    chat_max_new_tokens: int = 384
    raw_warmup: bool = True
    seed: int = 0
    timeout_s: float = 1200.0
    #: lmdq sides to run against the one raw side, each with its own worker (:class:`Variant`);
    #: empty = one side named "default" with the worker's defaults and the CLI door
    variants: tuple[Variant, ...] = ()
    #: a py-spy binary: record the worker (all threads, collapsed stacks) during batch ``profile_batch``
    py_spy: str | None = None
    profile_batch: int = 1
    profile_s: float = 12.0
    #: load the raw process and every worker at once and alternate their batches (:func:`run_interleaved`)
    interleave: bool = False


def parse_variant(spec: str) -> Variant:
    """``NAME`` or ``NAME:K=V,K=V`` (``--lmdq-variant``): K is a worker setting's env name, with or without
    the ``LMDQ_`` prefix (``whole:STREAM_FROM_NEW_TOKENS=100000``); ``BATCH_SIZE`` (the producer's setting)
    sets the side's requests per job instead of ``--batch-size``. ``SUBMIT`` (no prefix: it is the bench's
    key, not an lmdq setting, and is not passed to the worker) picks the side's submit door, ``cli`` (default)
    or ``python`` (:data:`SUBMIT_DOORS`): ``api:SUBMIT=python``."""
    name, _, rest = spec.partition(":")
    env: dict[str, str] = {}
    submit = "cli"
    for kv in filter(None, rest.split(",")):
        k, eq, v = kv.partition("=")
        if not eq or not k.strip():
            raise ValueError(f"--lmdq-variant {spec!r}: expected NAME:K=V[,K=V...]")
        k, v = k.strip().upper(), v.strip()
        if k == "SUBMIT":
            if v not in SUBMIT_DOORS:
                raise ValueError(f"--lmdq-variant {spec!r}: SUBMIT: expected {' or '.join(SUBMIT_DOORS)}, got {v!r}")
            submit = v
            continue
        if k == "LMDQ_SUBMIT":
            raise ValueError(f"--lmdq-variant {spec!r}: the submit door is SUBMIT=... (the bench's key, no LMDQ_ "
                             "prefix: no lmdq setting has that name)")
        env[k if k.startswith("LMDQ_") else f"LMDQ_{k}"] = v
    if not name.strip():
        raise ValueError(f"--lmdq-variant {spec!r}: a name comes first")
    return Variant(name.strip(), env, submit)


def make_workload(cfg: E2EConfig, model: str, path: Path) -> dict[str, Any]:
    """Write the JSONL both sides read; returns what it holds (prompts, token budgets)."""
    rnd = random.Random(cfg.seed)
    lines = []
    budget = 0
    if cfg.workload == "mixed":
        decode: Any = None
        if cfg.engine != "sim":  # the sim counts words as tokens
            from transformers import AutoTokenizer

            decode = AutoTokenizer.from_pretrained(model).decode
        for i in range(cfg.n):
            k = rnd.randint(cfg.min_input, cfg.max_input)
            out = rnd.randint(cfg.min_output, cfg.max_output)
            ids = [rnd.randrange(100, 40000) for _ in range(k)]
            text = decode(ids) if decode else " ".join(f"w{x}" for x in ids)
            budget += out
            lines.append({"custom_id": f"m{i}", "endpoint": "completion", "prompt": text,
                          "params": {"max_new_tokens": out, "ignore_eos": True, "do_sample": False}})
    elif cfg.workload == "chat":
        for i in range(cfg.n):
            ask = _ASKS[i % len(_ASKS)].format(t=_TOPICS[(i // len(_ASKS)) % len(_TOPICS)])
            if i >= len(_ASKS) * len(_TOPICS):  # past the 256 distinct questions: vary the wording too
                ask = f"{ask} (variant {i // (len(_ASKS) * len(_TOPICS))})"
            budget += cfg.chat_max_new_tokens
            lines.append({"custom_id": f"c{i}", "messages": [{"role": "user", "content": ask}],
                          "params": {"max_new_tokens": cfg.chat_max_new_tokens, "do_sample": False}})
    elif cfg.workload == "image":
        lines, budget = _image_lines(cfg, path.parent / "images", rnd)
    else:
        raise ValueError(f"--workload: expected mixed, chat or image, got {cfg.workload!r}")
    with path.open("w") as f:
        for d in lines:
            f.write(json.dumps(d) + "\n")
    return {"workload": cfg.workload, "n": cfg.n, "max_new_tokens_sum": budget}


IMAGE_SIDE = 336
"""Pixels per side of the image workload's pictures (LLaVA-1.5's input: 576 vision tokens at 14 px patches)."""


def _image_lines(cfg: E2EConfig, folder: Path, rnd: random.Random) -> tuple[list[dict[str, Any]], int]:
    """The ``image`` workload: ``cfg.n`` distinct pictures (random colour blocks, JPEG) and one question each."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(cfg.n):
        img = Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), (rnd.randrange(256), rnd.randrange(256), rnd.randrange(256)))
        for _ in range(8):
            x, y = rnd.randrange(IMAGE_SIDE - 32), rnd.randrange(IMAGE_SIDE - 32)
            img.paste((rnd.randrange(256), rnd.randrange(256), rnd.randrange(256)), (x, y, x + 32, y + 32))
        f = folder / f"img{i:05d}.jpg"
        img.save(f, "JPEG", quality=90)
        ask = _ASKS[i % len(_ASKS)].format(t="this picture")
        lines.append({"custom_id": f"i{i}", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": str(f.resolve())}}, {"type": "text", "text": ask}]}],
            "params": {"max_new_tokens": cfg.chat_max_new_tokens, "ignore_eos": True, "do_sample": False}})
    return lines, cfg.n * cfg.chat_max_new_tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _engine_env(engine_settings: dict[str, Any]) -> dict[str, str]:
    return {f"LMDQ_{k.upper()}": (str(v).lower() if isinstance(v, bool) else str(v))
            for k, v in engine_settings.items()}


def _raw_spec(cfg: E2EConfig, model: str, workload: Path, engine_settings: dict[str, Any], work: Path,
              **gated: Any) -> dict[str, Any]:
    """raw_pipe's spec (``gated``: the gate keys of an interleaved run), written to ``work/raw_spec.json``."""
    spec = {"engine": cfg.engine, "model": model, "engine_settings": engine_settings, "workload": str(workload),
            "batches": cfg.batches, "warmup": cfg.raw_warmup, "output": str(work / "raw.json"), **gated}
    (work / "raw_spec.json").write_text(json.dumps(spec))
    return spec


def _raw_result(rc: int, work: Path) -> dict[str, Any]:
    """What the raw process wrote (``work/raw.json``) once it exited 0; else its log's tail as the error."""
    if rc != 0:
        raise RuntimeError(f"raw side exited {rc}: {(work / 'raw.log').read_text(errors='replace')[-3000:]}")
    res: dict[str, Any] = json.loads((work / "raw.json").read_text())
    return res


def run_raw(cfg: E2EConfig, model: str, workload: Path, engine_settings: dict[str, Any], work: Path,
            log: Any) -> dict[str, Any]:
    _raw_spec(cfg, model, workload, engine_settings, work)
    log(f"raw: python -m lmdq_bench.raw_pipe ({cfg.batches} batches of {cfg.n})")
    with (work / "raw.log").open("wb") as out:
        p = subprocess.run([sys.executable, "-m", "lmdq_bench.raw_pipe", str(work / "raw_spec.json")],
                           stdout=out, stderr=subprocess.STDOUT, timeout=cfg.timeout_s)
    return _raw_result(p.returncode, work)


class _RawGated:
    """The raw process of an interleaved run, driven through files in a fresh gate folder
    (:mod:`lmdq_bench.raw_pipe`'s ``gate_dir``): loaded beside the workers, one batch per ``go_<b>``.
    Its own session, so :meth:`kill` reaches LMDeploy's engine processes too, which a plain kill of the
    raw process would leave holding the GPU."""

    def __init__(self, cfg: E2EConfig, model: str, workload: Path, engine_settings: dict[str, Any], work: Path,
                 log: Any, gate_timeout_s: float) -> None:
        self.cfg, self.work, self.log = cfg, work, log
        self.gate = Path(tempfile.mkdtemp(prefix="gate-", dir=work))  # never a stale go_/done_ of a reused workdir
        self.model, self.workload, self.engine_settings = model, workload, engine_settings
        self.gate_timeout_s = gate_timeout_s
        self.p: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None

    def start(self) -> None:
        _raw_spec(self.cfg, self.model, self.workload, self.engine_settings, self.work, gate_dir=str(self.gate),
                  parent_pid=os.getpid(), gate_timeout_s=self.gate_timeout_s)
        self.log(f"raw: python -m lmdq_bench.raw_pipe ({self.cfg.batches} gated batches of {self.cfg.n})")
        self.started_at = time.time()
        with (self.work / "raw.log").open("wb") as out:
            self.p = subprocess.Popen([sys.executable, "-m", "lmdq_bench.raw_pipe", str(self.work / "raw_spec.json")],
                                      stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_file(self, path: Path, what: str) -> dict[str, Any]:
        from lmdq_bench.raw_pipe import GateError, wait_for_file

        p = self.p
        assert p is not None

        def gone() -> str | None:
            if p.poll() is None:
                return None
            return f"exited {p.returncode} before {what}: " \
                   f"{(self.work / 'raw.log').read_text(errors='replace')[-3000:]}"
        try:
            wait_for_file(path, self.cfg.timeout_s, gone)
        except GateError as e:
            raise RuntimeError(f"raw side: {e}") from None
        d: dict[str, Any] = json.loads(path.read_text())
        return d

    def wait_ready(self) -> None:
        r = self._wait_file(self.gate / "ready.json", "ready")
        self.log(f"raw: ready in {r['ready_s']} s (load + warm-up)")

    def run_batch(self, b: int) -> dict[str, Any]:
        from lmdq_bench.raw_pipe import write_atomic

        spy = profile = None
        if b == self.cfg.profile_batch and self.p is not None:  # raw's profile beside lmdq's, the same batch
            spy, profile = _spy(self.cfg, self.p.pid, self.work, "raw", b)
        write_atomic(self.gate / f"go_{b}", {"batch": b})
        rec = self._wait_file(self.gate / f"done_{b}.json", f"batch {b}")
        _spy_end(self.cfg, spy, profile)
        if profile is not None:
            rec["profile"] = profile
        return rec

    def finish(self) -> dict[str, Any]:
        """After the last batch: the process writes raw.json, closes its engine and exits 0."""
        assert self.p is not None
        return {**_raw_result(self.p.wait(self.cfg.timeout_s), self.work), "started_at": self.started_at}

    def kill(self) -> None:
        """The whole session (the raw process and its engine processes): SIGTERM, SIGKILL after 30 s."""
        if self.p is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                return  # the process and every one of its session are gone
            try:
                self.p.wait(30)
                if sig == signal.SIGTERM:
                    continue  # its engine processes may outlive it: SIGKILL what is left of the session
            except subprocess.TimeoutExpired:
                pass


def run_interleaved(cfg: E2EConfig, model: str, workload: Path, engine_settings: dict[str, Any], work: Path,
                    redis_url: str, log: Any) -> tuple[dict[str, Any], list[dict[str, Any]], list[list[str]]]:
    """The raw process and one worker per lmdq side started at once; when all are ready, batch ``b`` of
    every side in turn, one at a time: raw then the lmdq sides on even ``b``, the reverse on odd ``b``
    (no side always follows another). Returns (raw, lmdq sides, the order of each batch). Whatever fails
    (or Ctrl-C), the raw process and every worker are stopped before this returns or raises."""
    variants = cfg.variants or (Variant("default"),)
    if any(v.name == "raw" for v in variants):
        raise ValueError("--interleave: a --lmdq-variant cannot be named 'raw' (the raw side's name in the order)")
    # the raw process may wait for every worker's load and then every lmdq side's batch before each gate
    raw = _RawGated(cfg, model, workload, engine_settings, work, log,
                    gate_timeout_s=cfg.timeout_s * (len(variants) + 2))
    sides = [_LmdqSide(cfg, model, workload, engine_settings, work, redis_url, log, v.name, v.env, i == 0,
                       submit=v.submit) for i, v in enumerate(variants)]
    order: list[list[str]] = []
    try:
        raw.start()
        for side in sides:
            side.start()
        raw.wait_ready()
        for side in sides:
            side.wait_ready()
        runners: dict[str, Any] = {"raw": raw.run_batch, **{side.name: side.run_batch for side in sides}}
        for b in range(cfg.batches):
            seq = ["raw", *(side.name for side in sides)]
            if b % 2:
                seq.reverse()
            for who in seq:
                runners[who](b)
            order.append(seq)
        raw_res = raw.finish()
    finally:
        raw.kill()
        for side in sides:
            side.stop()
    return raw_res, [side.result() for side in sides], order


def _wait_ready(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"lmdq-worker exited {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"lmdq-worker not ready after {timeout_s:.0f} s")


def _spy(cfg: E2EConfig, pid: int, work: Path, name: str, b: int) -> tuple[subprocess.Popen[bytes] | None,
                                                                         dict[str, Any] | None]:
    """py-spy recording ``pid`` and its children (all threads, raw collapsed stacks, ``profile_s``) during batch
    ``b`` when ``cfg.py_spy`` names the binary: (the recorder, the side's ``profile`` record)."""
    if not cfg.py_spy:
        return None, None
    out_file = work / f"pyspy_{name}_b{b}.txt"
    spy = subprocess.Popen(
        [cfg.py_spy, "record", "--pid", str(pid), "--duration", str(int(cfg.profile_s)), "--rate", "100",
         "--format", "raw", "--threads", "--nonblocking", "--subprocesses", "-o", str(out_file)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return spy, {"batch": b, "file": out_file.name, "duration_s": cfg.profile_s}


def _spy_end(cfg: E2EConfig, spy: subprocess.Popen[bytes] | None, profile: dict[str, Any] | None) -> None:
    if spy is None:
        return
    try:
        _, err = spy.communicate(timeout=cfg.profile_s + 30)
        if profile is not None:
            profile["rc"] = spy.returncode
            profile["stderr"] = err.decode(errors="replace")[-500:]
    except subprocess.TimeoutExpired:
        spy.kill()


def _stuck(w: subprocess.Popen[bytes], end: float) -> str | None:
    """Why waiting on a batch gives up: its worker exited, or the deadline (``end``, monotonic) passed."""
    return f"worker exit {w.poll()}" if w.poll() is not None or time.monotonic() > end else None


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` is ``env`` inside (restored after): ``lmdq.Client()`` reads its ``LMDQ_*`` settings
    from the environment, and the python door's client must read the very env its side's CLI would get."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _proc_env_keys(pid: int) -> list[str] | None:
    """The ``LMDQ_*`` names in process ``pid``'s environment as the kernel has it (Linux ``/proc``; None
    elsewhere): which settings a side's worker really got, names only (a Redis URL may hold a password)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return sorted({kv.split(b"=", 1)[0].decode(errors="replace") for kv in raw.split(b"\0")
                   if kv.startswith(b"LMDQ_")})


class _LmdqSide:
    """One lmdq side: an lmdq-worker process (:meth:`start`, then :meth:`wait_ready`) and, per batch, one
    submit (:meth:`run_batch`) through the side's door: an lmdq-producer submit process (``cli``), or
    ``lmdq.Client.submit`` in this process (``python``). A class rather than one loop so that ``--interleave``
    can hold several sides and the raw process loaded at once and run their batches in turn. Every batch
    record has wall-clock ``start``/``end`` (and the side ``started_at``/``ready_at``): an interleaved run's
    order is checked by them, and the GPU monitor's windows are cut by them."""

    def __init__(self, cfg: E2EConfig, model: str, workload: Path, engine_settings: dict[str, Any], work: Path,
                 redis_url: str, log: Any, name: str, extra_env: dict[str, str] | None, profiled: bool,
                 submit: str = "cli") -> None:
        if submit not in SUBMIT_DOORS:
            raise ValueError(f"submit door: expected {' or '.join(SUBMIT_DOORS)}, got {submit!r}")
        self.cfg, self.workload, self.work, self.log = cfg, workload, work, log
        self.name, self.extra_env, self.profiled, self.submit = name, extra_env, profiled, submit
        self.client: Any = None  # the python door's lmdq.Client (made in start)
        self.port = _free_port()
        # each side its own key prefix (queues, results, registry): with --interleave every side's worker is up
        # while one side's batch runs, and on one shared queue the idle workers would take its jobs too
        self.env = {**os.environ, "LMDQ_REDIS_URL": redis_url, "LMDQ_ENGINE": cfg.engine,
                    "LMDQ_SERVED_MODEL_NAME": "bench", "LMDQ_HEALTH_PORT": str(self.port), "LMDQ_LOG_FORMAT": "json",
                    "LMDQ_KEY_PREFIX": f"lmdq-e2e-{name}",
                    **({"LMDQ_MODEL": model} if cfg.engine != "sim" else {}), **_engine_env(engine_settings),
                    **(extra_env or {})}
        self.store = ResultStore(connect(redis_url), keys=Keys(self.env.get("LMDQ_KEY_PREFIX", "lmdq")))
        # requests per job: the producer's own setting (LMDQ_BATCH_SIZE) when the variant names it
        # (``big:BATCH_SIZE=256``: fewer per-job steps in the worker), else --batch-size
        self.job_size = int((extra_env or {}).get("LMDQ_BATCH_SIZE", cfg.batch_size))
        self.log_name = "worker.log" if name == "default" else f"worker_{name}.log"
        self.batches: list[dict[str, Any]] = []
        self.profile: dict[str, Any] | None = None
        self.ready_s: float | None = None
        self.ready_at: float | None = None
        self.started_at: float | None = None
        self.w: subprocess.Popen[bytes] | None = None
        self.wlog: Any = None
        self.worker_env_keys: list[str] | None = None

    def start(self) -> None:
        self.t_start = time.monotonic()
        self.started_at = time.time()
        if self.submit == "python":
            # Imported here, once, never inside a batch's clock: a user's running process that submits through
            # lmdq's Python API has imported it already (as the raw side's process has LMDeploy loaded). The
            # Client is made once too, under this side's env (the Redis URL, key prefix and LMDQ_* settings the
            # CLI door's process gets); it connects at its first submit and keeps that connection, like a
            # user's client. Modules submit itself imports on first use are the first batch's to pay.
            import lmdq

            with _environ(self.env):
                self.client = lmdq.Client()
        self.wlog = (self.work / self.log_name).open("wb")
        self.w = subprocess.Popen([sys.executable, "-m", "lmdq.worker"], env=self.env, stdout=self.wlog,
                                  stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        assert self.w is not None
        _wait_ready(self.port, self.w, self.cfg.timeout_s)
        self.worker_env_keys = _proc_env_keys(self.w.pid)  # what the running worker got (SUBMIT never)
        self.ready_at = time.time()
        self.ready_s = round(time.monotonic() - self.t_start, 2)
        self.log(f"lmdq[{self.name}]: worker ready in {self.ready_s} s (load + warm-up)")

    def run_batch(self, b: int) -> dict[str, Any]:
        cfg, w, name = self.cfg, self.w, self.name
        assert w is not None
        spy = None
        if self.profiled and b == cfg.profile_batch:
            spy, self.profile = _spy(cfg, w.pid, self.work, name, b)
        cpu0 = tree_cpu(w.pid)
        if self.client is not None:  # the python door: t0 right before the call, as before the process below
            t0 = time.time()
            bid = str(self.client.submit(self.workload, model="bench", batch_size=self.job_size).id)
            t_sub = time.time()  # the call returned (the CLI door: the process exited)
        else:
            t0 = time.time()
            sub = subprocess.run([sys.executable, "-m", "lmdq.producer", "submit", str(self.workload), "--model",
                                  "bench", "--batch-size", str(self.job_size)], env=self.env, capture_output=True,
                                 timeout=cfg.timeout_s)
            t_sub = time.time()
            if sub.returncode != 0:
                raise RuntimeError(f"submit exited {sub.returncode}: {sub.stderr.decode()[-2000:]}")
            bid = sub.stdout.decode().strip().splitlines()[-1]
        end = time.monotonic() + cfg.timeout_s
        batch = wait_terminal(self.store, bid, poll_s=0.05, stuck=functools.partial(_stuck, w, end))
        t_end = time.time()  # the driver saw the batch terminal: only now may another side start
        cpu = cpu_delta(cpu0, tree_cpu(w.pid))
        _spy_end(cfg, spy, self.profile)
        fin = read_finished(self.store, batch, cfg.n)
        rows, toks = fin.results, fin.tokens
        secs = fin.last_stored_at - t0
        not_done = sum(1 for r in rows if r.status.value != "completed")
        rec = {"batch": b, "s": round(secs, 3), "tokens": toks, "tok_s": round(toks / secs, 1),
               "results": len(rows), "not_completed": not_done,
               "first_visible_s": round((batch.queued_at or t0) - t0, 3),
               "submit": self.submit, "submit_exit_s": round(t_sub - t0, 3), "batch_id": bid,
               "job_size": batch.batch_size,
               "worker_cpu_s": cpu["main"], "engine_cpu_s": cpu["children"], "start": t0, "end": t_end,
               "workers": sorted({r.worker for r in rows if r.worker}),  # this side's one worker, nobody else
               **timeline(rows, t0)}
        self.batches.append(rec)
        returned = "submit exited" if self.submit == "cli" else "Client.submit returned"
        self.log(f"lmdq[{name}] batch {b}: {toks:,} tokens in {secs:.2f} s = {toks / secs:,.0f} tok/s (jobs visible "
                 f"after {rec['first_visible_s']:.2f} s, {returned} after {t_sub - t0:.2f} s; CPU s: worker "
                 f"{cpu['main']}, engine processes {cpu['children']}; requests held: min {rec.get('held_min')}, "
                 f"mean {rec.get('held_mean')}; 99 % done after {rec.get('finished_p99_s')} s)")
        return rec

    def stop(self) -> None:
        """SIGTERM the worker (its graceful drain), SIGKILL if it is still up 120 s later."""
        w = self.w
        if w is not None and w.poll() is None:
            w.send_signal(signal.SIGTERM)
            try:
                w.wait(120)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait(30)
        if self.wlog is not None:
            self.wlog.close()

    def result(self) -> dict[str, Any]:
        assert self.w is not None
        lines = [ln for ln in (self.work / self.log_name).read_text(errors="replace").splitlines() if ln.strip()]
        non_json = [ln for ln in lines if not _json_object(ln)]
        out = {"name": self.name, "env": self.extra_env or {}, "submit": self.submit,
               "worker_env_keys": self.worker_env_keys, "ready_s": self.ready_s, "batches": self.batches,
               "log_name": self.log_name,
               "worker_exit": self.w.returncode, "worker_log_lines": len(lines),
               "worker_log_non_json": len(non_json), "worker_log_non_json_sample": non_json[:3],
               "warmup": _warmup_event(lines), "profile": self.profile, "started_at": self.started_at,
               "ready_at": self.ready_at}
        return out


def run_lmdq(cfg: E2EConfig, model: str, workload: Path, engine_settings: dict[str, Any], work: Path,
             redis_url: str, log: Any, name: str = "default", extra_env: dict[str, str] | None = None,
             profiled: bool = True, submit: str = "cli") -> dict[str, Any]:
    """One lmdq-worker process (ready first), then per batch one submit through the ``submit`` door (an
    lmdq-producer submit process, or ``lmdq.Client.submit`` here). ``name`` and ``extra_env``: one of several
    lmdq sides (``E2EConfig.variants``), its worker started with that env; ``profiled``: py-spy records this
    side (``E2EConfig.py_spy``: the first side only)."""
    side = _LmdqSide(cfg, model, workload, engine_settings, work, redis_url, log, name, extra_env, profiled,
                     submit=submit)
    side.start()
    try:
        side.wait_ready()
        for b in range(cfg.batches):
            side.run_batch(b)
    finally:
        side.stop()
    return side.result()


def _json_object(line: str) -> dict[str, Any] | None:
    try:
        d = json.loads(line)
    except ValueError:
        return None
    return d if isinstance(d, dict) else None


def _warmup_event(lines: list[str]) -> dict[str, Any] | None:
    """The worker's "engine warmed up" log line (what the warm-up cost), if any."""
    for ln in lines:
        d = _json_object(ln)
        if d and d.get("event") == "engine warmed up":
            return {k: v for k, v in d.items() if k.startswith("warmup")}
    return None


def _rate(batches: list[dict[str, Any]]) -> float | None:
    secs = sum(b["s"] for b in batches)
    return round(sum(b["tokens"] for b in batches) / secs, 1) if secs else None


def summarize(raw: dict[str, Any], lmdq: dict[str, Any]) -> dict[str, Any]:
    """First batch apart, later batches together (their tokens over their seconds), per batch too."""
    rb, lb = raw["batches"], lmdq["batches"]
    out: dict[str, Any] = {
        "raw_first_tok_s": rb[0]["tok_s"], "lmdq_first_tok_s": lb[0]["tok_s"],
        "ratio_first": round(lb[0]["tok_s"] / rb[0]["tok_s"], 4),
        "raw_later_tok_s": _rate(rb[1:]), "lmdq_later_tok_s": _rate(lb[1:]),
        "ratio_per_batch": [round(x["tok_s"] / y["tok_s"], 4) for x, y in zip(lb, rb)],
    }
    if out["raw_later_tok_s"] and out["lmdq_later_tok_s"]:
        out["ratio_later"] = round(out["lmdq_later_tok_s"] / out["raw_later_tok_s"], 4)
    out["ratio_all"] = round((_rate(lb) or 0) / (_rate(rb) or 1), 4)
    # The second clock (issue 49): lmdq from its first visible job, not from the submit process's start:
    # what the queue costs apart from the submit's start-up and staging (raw has one clock).
    queue = [{**b, "s": b["s"] - b.get("first_visible_s", 0.0)} for b in lb]
    out["ratio_first_from_visible"] = round(lb[0]["tokens"] / queue[0]["s"] / rb[0]["tok_s"], 4)
    out["ratio_all_from_visible"] = round((_rate(queue) or 0) / (_rate(rb) or 1), 4)
    return out


def _gpu_windows(mon: GpuMonitor, sides: list[tuple[str, dict[str, Any]]], log: Any) -> None:
    """Each batch's GPU readings (``gpu``: SM clock, utilization, power, temperature over its start..end),
    one line each: raw ``pipe()`` ran 21.3k / 17.7k / 16.6k tok/s on identical batches (session 11), and
    these say whether the GPU or the host changed under it."""
    for name, side in sides:
        for rec in side["batches"]:
            g = rec["gpu"] = mon.window(rec["start"], rec["end"])
            if g is not None:
                log(f"gpu {name} batch {rec['batch']}: SM {g['sm_mhz_median']} MHz (min {g['sm_mhz_min']}), "
                    f"util {g['util_pct_median']} %, {g['power_w_median']} W, max {g['temp_c_max']} C"
                    + (f", clock events {','.join(g['event_reasons_seen'])}" if g["event_reasons_seen"] else ""))


def _occupancy_windows(work: Path, raw: dict[str, Any], sides: list[dict[str, Any]], log: Any) -> None:
    """Each batch's ``occupancy`` (bench/occupancy.py) from its side's log, where the engine logged it
    (``--occupancy-log-s``), and one line per batch."""
    logs = [("raw", raw, work / "raw.log"), *((s["name"], s, work / s["log_name"]) for s in sides)]
    for name, side, path in logs:
        events = occupancy_events(path.read_text(errors="replace").splitlines()) if path.exists() else []
        if not events:
            continue
        for rec in side["batches"]:
            occ = rec["occupancy"] = batch_occupancy(events, rec["start"], rec["end"])
            if occ is not None:
                log(f"occupancy {name} batch {rec['batch']}: {occ['mean']} requests in the engine on average "
                    f"(emptiest window {occ['min_window']}, p10 {occ['p10_window']}, most {occ['max']})")


def run_e2e(cfg: E2EConfig, *, model: str, engine_settings: dict[str, Any], redis_url: str, work: Path | None = None,
            log: Any = print) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="lmdq-e2e-") as d:
        wd = work or Path(d)
        wd.mkdir(parents=True, exist_ok=True)
        workload = wd / "workload.jsonl"
        info = make_workload(cfg, model, workload)
        extra: dict[str, Any] = {}
        with GpuMonitor() as mon:
            if cfg.interleave:
                raw, sides, order = run_interleaved(cfg, model, workload, engine_settings, wd, redis_url, log)
                extra = {"interleave": True, "order": order}
            else:
                raw = run_raw(cfg, model, workload, engine_settings, wd, log)
                sides = [run_lmdq(cfg, model, workload, engine_settings, wd, redis_url, log, name=v.name,
                                  extra_env=v.env, profiled=i == 0, submit=v.submit)
                         for i, v in enumerate(cfg.variants or (Variant("default"),))]
        if mon.enabled:
            _gpu_windows(mon, [("raw", raw), *((s["name"], s) for s in sides)], log)
        _occupancy_windows(wd, raw, sides, log)
    lmdq = sides[0]  # the top-level keys (lmdq, ratio_*) are the first side's, as before several doors
    return {**info, "batches": cfg.batches, "batch_size": cfg.batch_size, "raw": raw, "lmdq": lmdq,
            "submit": lmdq["submit"], **summarize(raw, lmdq),
            "variants": {s["name"]: {"env": s["env"], "submit": s["submit"], **summarize(raw, s), "lmdq": s}
                         for s in sides}, **extra}
