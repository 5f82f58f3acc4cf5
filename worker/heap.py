"""The worker's heap after start-up: moved out of the garbage collector's sight once, with ``gc.freeze()``.

Why: a loaded engine leaves millions of Python objects that live as long as the process (torch, transformers
and LMDeploy modules, the tokenizer, the model's config and module tree). Every full collection walks all of
them, and the worker and its engine make garbage at hundreds of results a second, so a full collection comes
round again and again and takes the GIL from the engine's loop each time (TurboMind runs its per-step
callbacks in the loading process). vLLM freezes its heap the same way after start-up. What is frozen is never
collected, so this runs once, when start-up's own garbage is gone (``gc.collect()`` first).
"""

from __future__ import annotations

import atexit
import gc

__all__ = ["freeze_heap"]


def freeze_heap() -> int:
    """Collect start-up's garbage, then freeze what is left; returns how many objects are now frozen."""
    gc.collect()
    gc.freeze()
    # Back in the collector's sight at exit: objects still frozen when the interpreter finalizes are never
    # freed, and extension modules report them (nanobind: "leaked 4 instances!", a raw line after the log relay).
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()
