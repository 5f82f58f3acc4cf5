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
from pathlib import Path
from typing import Any

from lmdq.redis.keys import InvalidModelName, check_model_name

__all__ = ["ADAPTER_CONFIG", "adapter_name_problem", "adapter_path_problem", "adapter_refusal", "adapters_problem",
           "parse_adapters"]

ADAPTER_CONFIG = "adapter_config.json"
"""The file that makes a folder a LoRA adapter (peft's ``save_pretrained``; LMDeploy reads it too)."""

LORA_PREFIX = "lora_"
"""peft's LoRA parameter prefix (``lora_A``, ``lora_B``): an adapter name that is part of it (``lora``, ``a``)
makes peft warn that the adapter's weights may be reinitialized on load: a silently different model."""


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


def adapter_name_problem(name: str) -> str | None:
    """Why an engine cannot load an adapter called ``name`` although it follows the model name rule, or None.

    The ONE rule for adapter names beyond lmdq's own (both engines: LMDeploy's PyTorch engine and the
    transformers engine's peft keep a LoRA's weights in torch modules keyed by the adapter's name):

    * no ``.``: peft stores each adapter in a ``torch.nn.ModuleDict`` under its name, and torch refuses a
      submodule name holding a ``.`` (``KeyError: module name can't contain "."``), after the model loaded;
    * not part of ``lora_`` (``lora``, ``a``): peft matches state-dict keys by that prefix, and warns that such
      a name may reinitialize the adapter's weights on load (a silently different model).
    """
    if "." in name:
        return (f"adapter name {name!r} contains '.', which LoRA engines refuse (peft and LMDeploy key an adapter's "
                f"weights by its name, and a torch module name cannot hold a '.'); name it e.g. "
                f"{name.replace('.', '-')!r}")
    if name in LORA_PREFIX:
        return (f"adapter name {name!r} is part of peft's LoRA prefix {LORA_PREFIX!r}, with which peft may "
                f"reinitialize the adapter's weights on load; choose another name")
    return None


def adapter_path_problem(name: str, path: str) -> str | None:
    """Why ``path`` is not a LoRA adapter folder (one with a readable ``adapter_config.json`` holding a JSON
    object), or None; checked before a model load of minutes instead of a library traceback after it."""
    where = f"adapter {name!r}: {path}"
    folder = Path(path).expanduser()
    try:
        if not folder.exists():
            return f"{where} does not exist (expected a folder with {ADAPTER_CONFIG})"
        if not folder.is_dir():
            return f"{where} is not a folder (expected a folder with {ADAPTER_CONFIG})"
        config = folder / ADAPTER_CONFIG
        if not config.is_file():
            return f"{where} has no {ADAPTER_CONFIG} (not a LoRA adapter folder)"
        text = config.read_text(encoding="utf-8")
    except OSError as e:
        return f"{where}: cannot read {ADAPTER_CONFIG}: {e.strerror or e}"
    except UnicodeDecodeError:
        return f"{where}: {ADAPTER_CONFIG} is not UTF-8 text"
    try:
        data = json.loads(text)
    except ValueError as e:
        return f"{where}: {ADAPTER_CONFIG} is not valid JSON ({e})"
    if not isinstance(data, dict):
        return f"{where}: {ADAPTER_CONFIG} is not a JSON object"
    return None


def adapters_problem(adapters: Mapping[str, str], served_model_name: str) -> str | None:
    """The first reason the worker cannot serve ``adapters`` beside a base model served as
    ``served_model_name``, or None: a name taken by the base model (the engine would answer the base
    model's requests with the adapter) or by another adapter, a name the engines cannot load
    (:func:`adapter_name_problem`), a path that is not an adapter folder (:func:`adapter_path_problem`)."""
    seen: set[str] = set()
    for name, path in adapters.items():
        if name == served_model_name:
            return (f"adapter name {name!r} is the base model's served name; requests for {name!r} must get the base "
                    f"model, so give the adapter another name (or the base model another --served-model-name)")
        if name in seen:
            return f"adapter {name!r} given twice"
        seen.add(name)
        why = adapter_name_problem(name) or adapter_path_problem(name, path)
        if why:
            return why
    return None
