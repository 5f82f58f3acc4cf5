"""LoRA adapters a worker serves beside its base model (issue 24): ``lmdq-worker --adapter NAME=PATH``.

Each NAME is a model of its own to producers: a line whose ``model`` is NAME goes to NAME's queue,
which the worker drains with its base model's, and runs with that adapter. The name follows the model
name rule (lmdq.redis.keys: it is a queue key). Which engines can apply one is decided here, before a
model load of minutes: LMDeploy's PyTorch backend (``PytorchEngineConfig(adapters=...)``, and the
request's ``adapter_name``), the transformers engine through peft; TurboMind and the sim engine cannot,
and refusing at start beats answering an adapter's requests with the base model's outputs.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from typing import Any

from lmdq.redis.keys import InvalidModelName, check_model_name

__all__ = ["adapter_refusal", "parse_adapters"]


def parse_adapters(value: Any) -> dict[str, str]:
    """``{NAME: PATH}`` from the flag's ``NAME=PATH`` strings (a list), a comma-separated string, a JSON
    object or a mapping; ValueError (one line, what was expected) for anything else."""
    if value is None or value == "" or value == []:
        return {}
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except ValueError as e:
                raise ValueError(f"expected NAME=PATH or a JSON object of them: {e}") from None
        else:
            value = [part for part in text.split(",") if part.strip()]
    items: list[tuple[Any, Any]]
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = []
        for spec in value:
            name, sep, path = str(spec).partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"expected NAME=PATH, got {str(spec)!r}")
            items.append((name.strip(), path.strip()))
    else:
        raise ValueError(f"expected NAME=PATH, got {value!r}")
    out: dict[str, str] = {}
    for name, path in items:
        if not isinstance(path, str) or not path:
            raise ValueError(f"expected NAME=PATH, got {name!r} with no path")
        try:
            check_model_name(str(name))
        except InvalidModelName as e:
            raise ValueError(f"adapter {e}") from None
        if name in out:
            raise ValueError(f"adapter {name!r} given twice")
        out[str(name)] = path
    return out


def adapter_refusal(engine: str, lmdeploy: Any = None) -> str | None:
    """Why ``engine`` cannot serve LoRA adapters, or None when it can."""
    if engine == "sim":
        return "the sim engine has no weights to adapt; serve adapters with --engine lmdeploy --backend pytorch"
    if engine == "transformers":
        if importlib.util.find_spec("peft") is None:
            return "the transformers engine serves adapters through peft: pip install 'lmdq[lora]'"
        return None
    if engine == "lmdeploy" and getattr(lmdeploy, "backend", "auto") == "turbomind":
        return "TurboMind cannot serve LoRA adapters; use --backend pytorch (LMDeploy's PyTorch engine)"
    return None
