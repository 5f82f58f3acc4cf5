"""No orphans: every process started for the worker's engine dies with the worker, SIGKILL included.

LMDeploy's PyTorch engine runs in a ``multiprocessing`` *spawn* child (``enable_mp_engine``), which starts
its own children (tp workers through the mp executor, the resource tracker, torch's compile workers).
When the worker is SIGKILLed none of them notices: they are re-parented to PID 1 and keep the whole KV
cache (120 GB of an H200 measured). Nothing in the worker can run at SIGKILL, so the children must
notice on their own. Three layers, each covering what the previous one cannot:

1. **Parent-death signal.** :func:`install` wraps the target of every ``multiprocessing`` process
   started from then on (all contexts; the hook is ``BaseProcess.start``, so LMDeploy needs no patch).
   The wrapped child calls ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` as soon as it is unpickled, before the
   target's own imports, then re-checks its parent pid (the parent may have died before the prctl).
   The child installs the same hook, so tp workers started by the engine process are guarded too.
   Linux sends the signal when the parent *thread* exits, so it is only asked for when the process is
   started from the main thread (a helper thread that spawns and then ends would kill a healthy child).
2. **Watchdog thread** in every guarded child: polls ``os.getppid()`` each second and, once the parent
   is gone, SIGKILLs its own descendants and its process group. It covers children started from a
   non-main thread and grandchildren that are not ``multiprocessing`` processes (they are in the group).
3. **Process group + reaper.** The worker's direct children start a new process group (the engine's
   group: its descendants inherit it), so a group kill never reaches the worker's own group (the shell,
   the test runner). A tiny reaper process, in its own session, holds a pipe from the worker and a list of
   the engine groups; when the pipe reads EOF (the worker is gone, however it died) it SIGKILLs those
   groups and every process it last saw below the worker. It is what still works when the engine process
   was killed by (1) before its watchdog (2) could kill the group.

Linux only (``prctl``, ``/proc``); elsewhere :func:`install` is a no-op. Ray-started tp workers
(``distributed_executor_backend='ray'``) are not covered: lmdq uses the mp executor for tp > 1.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing.process
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

__all__ = ["GuardedTarget", "descendants", "install", "kill_groups", "reap_main", "set_parent_death_signal",
           "tracked_groups"]

PR_SET_PDEATHSIG = 1
#: how often a guarded child checks that its parent is still there (the 10 s budget has room)
WATCH_INTERVAL_S = 1.0


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent thread exits; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(sig), ctypes.c_ulong(0), ctypes.c_ulong(0),
                              ctypes.c_ulong(0))) == 0
    except (OSError, AttributeError):
        return False


# --- /proc: who is below whom (no psutil in the worker's dependencies) -----------------------------------

def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgrp, starttime) from /proc/PID/stat, or None when the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    try:
        return fields[0], int(fields[1]), int(fields[2]), int(fields[19])
    except (IndexError, ValueError):
        return None


def _alive(pid: int, starttime: int | None = None) -> bool:
    """Running (not a zombie) and, when ``starttime`` is given, still the same process (pids are reused)."""
    st = _stat(pid)
    return st is not None and st[0] != "Z" and (starttime is None or st[3] == starttime)


def descendants(pid: int) -> dict[int, int]:
    """Every process below ``pid`` (children, grandchildren, ...) → its start time."""
    children: dict[int, list[tuple[int, int]]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            st = _stat(int(p.name))
            if st is not None:
                children.setdefault(st[1], []).append((int(p.name), st[3]))
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child, start in children.get(todo.pop(), []):
            if child not in out:
                out[child] = start
                todo.append(child)
    return out


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def _killpg(pgid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


# --- the guarded child -----------------------------------------------------------------------------------

_armed = False
_hook_lock = threading.Lock()
#: 'orig_start': the unpatched start; 'pid': the process that set the rest ('root', 'forbidden_pgid', 'reaper':
#: a fork child inherits them and sets its own)
_hook: dict[str, Any] = {}


def _die(forbidden_pgid: int) -> None:
    """The parent is gone: take down everything below this process, its group (unless it is the
    worker's own group) and then this process itself."""
    for pid in descendants(os.getpid()):
        _kill(pid)
    pgrp = os.getpgrp()
    if pgrp != forbidden_pgid:
        _killpg(pgrp)  # this process is in the group: the call does not return
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(parent_pid: int, forbidden_pgid: int, interval_s: float) -> None:
    while True:
        time.sleep(interval_s)
        if os.getppid() != parent_pid:
            _die(forbidden_pgid)


def _arm(creator_pid: int, parent_pid: int, own_group: bool, pdeathsig: bool, forbidden_pgid: int) -> None:
    """Run in the child, once, as early as it can: group, parent-death signal, parent check, watchdog.

    ``parent_pid`` 0: the parent is not the creator (forkserver children are forked by the fork server,
    which exits when its creator does): whoever the parent is now is the one to outlive."""
    global _armed
    if _armed or os.getpid() == creator_pid:  # already armed, or not a child at all (a copy in the creator)
        return
    _armed = True
    if own_group:
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
    if pdeathsig:
        set_parent_death_signal(signal.SIGKILL)
    if not parent_pid:
        parent_pid = os.getppid()
    elif os.getppid() != parent_pid:  # the parent died before the prctl: nobody would signal us
        _die(forbidden_pgid)
    threading.Thread(target=_watch, args=(parent_pid, forbidden_pgid, WATCH_INTERVAL_S), daemon=True,
                     name="lmdq-orphan-guard").start()
    _patch(root=False, forbidden_pgid=forbidden_pgid)  # this child's own children: guarded, same group


class GuardedTarget:
    """A process target that arms the guard in the child before it runs the real target.

    Pickled (spawn, forkserver) as a call to :func:`_rebuild` with plain ints, followed by the target as
    state: unpickling arms the guard before the target's modules are imported (seconds for torch)."""

    def __init__(self, target: Callable[..., Any], parent_pid: int, own_group: bool, pdeathsig: bool,
                 forbidden_pgid: int) -> None:
        self.target = target
        self.spec = (os.getpid(), parent_pid, own_group, pdeathsig, forbidden_pgid)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, self.spec, {"target": self.target})

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.target = state["target"]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _arm(*self.spec)  # fork context: nothing was unpickled
        return self.target(*args, **kwargs)


def _rebuild(creator_pid: int, parent_pid: int, own_group: bool, pdeathsig: bool,
             forbidden_pgid: int) -> GuardedTarget:
    _arm(creator_pid, parent_pid, own_group, pdeathsig, forbidden_pgid)
    g = GuardedTarget.__new__(GuardedTarget)
    g.spec = (creator_pid, parent_pid, own_group, pdeathsig, forbidden_pgid)
    return g


def _patch(*, root: bool, forbidden_pgid: int, reaper: bool = False) -> None:
    """Wrap the target of every ``multiprocessing`` process started from now on in this process."""
    global _the_reaper
    with _hook_lock:
        if _hook.get("pid") == os.getpid():
            return
        if "pid" in _hook:  # a fork child: the hook is inherited, its settings are the parent's
            if _the_reaper is not None:  # nor keep the worker's pipe open: its EOF is the worker's death
                _the_reaper.close()
            _the_reaper = None
        _hook.update(pid=os.getpid(), root=root, forbidden_pgid=forbidden_pgid, reaper=reaper)
        if "orig_start" in _hook:
            return
        base = multiprocessing.process.BaseProcess
        orig_start = base.start
        _hook["orig_start"] = orig_start

        def start(self: multiprocessing.process.BaseProcess) -> None:
            target = getattr(self, "_target", None)
            root, forbidden = bool(_hook["root"]), int(_hook["forbidden_pgid"])
            if target is not None and not isinstance(target, GuardedTarget):
                on_main = threading.current_thread() is threading.main_thread()
                parent = 0 if getattr(self, "_start_method", None) == "forkserver" else os.getpid()
                self._target = GuardedTarget(target, parent, root, on_main, forbidden)  # type: ignore[attr-defined]
            orig_start(self)
            if root and self.pid is not None:
                # The classic race-free pair: the parent sets the group too (EACCES once a spawn child has
                # exec'd; it then sets it itself on unpickling).
                with contextlib.suppress(OSError):
                    os.setpgid(self.pid, self.pid)
                _reaper().track(self.pid, start=bool(_hook["reaper"]))

        base.start = start  # type: ignore[method-assign]


# --- the reaper (layer 3) --------------------------------------------------------------------------------

class _Reaper:
    """The worker's end of the reaper: a pipe the reaper reads engine groups from, and whose EOF is the
    worker's death (the write end is close-on-exec, so no spawned child keeps it open)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.groups: dict[int, int] = {}  # pgid (= the leader's pid) -> the leader's start time
        self._lock = threading.Lock()

    def _start(self) -> IO[bytes] | None:
        if self.proc is None:
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", "import sys; from lmdq.worker.engines.orphan_guard import reap_main; "
                     "sys.exit(reap_main(int(sys.argv[1])))", str(os.getpid())],
                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
            except OSError:
                return None
            atexit.register(self.close)
        return self.proc.stdin

    def track(self, pgid: int, *, start: bool = True) -> None:
        """Remember an engine group (for :func:`kill_groups`) and hand it to the reaper."""
        st = _stat(pgid)
        with self._lock:
            self.groups[pgid] = st[3] if st else 0
            pipe = self._start() if start or self.proc is not None else None
            if pipe is not None:
                with contextlib.suppress(OSError, ValueError):
                    pipe.write(f"{pgid} {self.groups[pgid]}\n".encode())
                    pipe.flush()

    def kill_groups(self, pgids: Iterable[int]) -> None:
        """SIGKILL what is left of these engine groups (a teardown after LMDeploy's own close)."""
        with self._lock:
            groups = {pgid: self.groups[pgid] for pgid in pgids if pgid in self.groups}
        for pgid, start in groups.items():
            if pgid != os.getpgrp() and (not _alive(pgid) or _alive(pgid, start)):
                _killpg(pgid)

    def close(self) -> None:
        """Normal exit: the reaper kills what is left and exits (EOF)."""
        if self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.close()


_the_reaper: _Reaper | None = None


def _reaper() -> _Reaper:
    global _the_reaper
    if _the_reaper is None:
        _the_reaper = _Reaper()
    return _the_reaper


def reap_main(worker_pid: int, interval_s: float = WATCH_INTERVAL_S) -> int:
    """The reaper process: wait for the worker to go, then SIGKILL its engine groups and every process it
    last saw below the worker. EOF on stdin is the prompt signal; polling the worker's pid is the backup."""
    worker_start = (_stat(worker_pid) or ("", 0, 0, 0))[3]
    groups: dict[int, int] = {}
    seen: dict[int, int] = {}
    eof = threading.Event()

    def read() -> None:
        for line in sys.stdin:
            with contextlib.suppress(ValueError):
                pgid, start = (int(x) for x in line.split())
                groups[pgid] = start
        eof.set()

    threading.Thread(target=read, daemon=True).start()
    seen.update(descendants(worker_pid))
    while not eof.wait(interval_s) and _alive(worker_pid, worker_start):
        seen.update(descendants(worker_pid))
    if _alive(worker_pid, worker_start):
        seen.update(descendants(worker_pid))
    seen.pop(os.getpid(), None)
    for pgid, start in list(groups.items()):
        if not _alive(pgid) or _alive(pgid, start):  # a live leader with another start time: a reused pid
            _killpg(pgid)
    for pid, start in seen.items():
        if _alive(pid, start):
            _kill(pid)
    return 0


# --- public entry points ---------------------------------------------------------------------------------

def install(*, reaper: bool = True) -> None:
    """Guard every ``multiprocessing`` process this process (the worker) starts from now on. Idempotent;
    call it before the engine is built. ``reaper=False`` leaves layer 3 out (tests of layers 1-2).
    A no-op off Linux."""
    if sys.platform.startswith("linux"):
        _patch(root=True, forbidden_pgid=os.getpgrp(), reaper=reaper)


def tracked_groups() -> set[int]:
    """The process groups of the guarded children this process has started so far (their pids)."""
    return set(_the_reaper.groups) if _the_reaper is not None else set()


def kill_groups(pgids: Iterable[int]) -> None:
    """SIGKILL whatever is left in these groups (from :func:`tracked_groups`); never this process's own."""
    if _the_reaper is not None:
        _the_reaper.kill_groups(pgids)
