"""Run by Python at start-up in every Python process a worker starts (``PYTHONPATH``, set by
:func:`lmdq.logs.config.route_child_logs`), so that a *spawned* child logs JSON like its parent.

Why: LMDeploy's PyTorch engine with ``enable_mp_engine`` runs in a child started with
``torch.multiprocessing``'s ``spawn`` (``lmdeploy/pytorch/engine/mp_engine/zmq_engine.py``): a fresh
interpreter that imports only LMDeploy, whose ``get_logger`` then prints colour text to stdout
beside the worker's JSON lines. Nothing of lmdq is imported there before LMDeploy logs, except this
file: Python imports ``sitecustomize`` from ``sys.path`` while it starts (the same mechanism tracers
such as ddtrace use). Only multiprocessing children (``--multiprocessing-fork`` in the command line)
are configured; any other Python child the worker runs (a compiler helper whose stdout is data) is
left alone. The ``sitecustomize`` this file shadows (Debian and Ubuntu ship one) still runs.
"""

import os
import sys


def _configure() -> None:
    fmt = os.environ.get("LMDQ_CHILD_LOG_FORMAT")
    if not fmt or "--multiprocessing-fork" not in getattr(sys, "orig_argv", ()):
        return
    try:
        import structlog

        from lmdq.logs.config import configure_logging

        configure_logging(fmt, os.environ.get("LMDQ_CHILD_LOG_LEVEL", "INFO"))
        from lmdq.logs.tqdm_events import install as install_tqdm_events

        install_tqdm_events()  # LMDeploy's weight-loading and warm-up bars: progress events, not raw text
        structlog.contextvars.bind_contextvars(pid=os.getpid())  # tells the child's lines apart
    except Exception as e:  # never stop a child from starting over its logging
        print(f"lmdq: child logging not configured: {type(e).__name__}: {e}", file=sys.stderr)


def _chain() -> None:
    """Run the next ``sitecustomize.py`` on ``sys.path``, the one this file hides."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_lmdq_shadowed_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                try:
                    spec.loader.exec_module(module)
                except Exception as e:
                    print(f"lmdq: {candidate} failed: {type(e).__name__}: {e}", file=sys.stderr)
            return


_configure()
_chain()
