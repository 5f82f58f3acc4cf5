"""Counting a request's input tokens as the model's engine will: its own tokenizer and chat template.

On the producer, without torch or transformers: ``tokenizers`` reads the model's ``tokenizer.json`` and
jinja2 renders the chat template from its ``tokenizer_config.json`` (what transformers'
``apply_chat_template`` does: ``add_generation_prompt=True``, the template's own special tokens, none
added on encoding). A completion (raw) prompt is encoded with the tokenizer's special tokens, as an
engine given raw text does. Both libraries are optional: without them, or without a tokenizer folder
for the model, :func:`load_counter` returns an estimate of 4 characters a token, and says so (every
figure of a plan says what it rests on).

Where the folder comes from: ``--tokenizer PATH`` (a folder, or its ``tokenizer.json``), else the model
name when it is a local folder, else the model's snapshot in the Hugging Face cache
(``$HF_HUB_CACHE`` or ``$HF_HOME/hub`` or ``~/.cache/huggingface/hub``), read as files: no hub client.

Shared prefixes: :meth:`TokenCounter.blocks` cuts a prompt's ids into blocks of ``block`` tokens, each
keyed by a hash chained over the blocks before it (the block-granular prefix cache of LMDeploy and the
sim), so a plan counts how many prompt tokens a prefix cache would find already computed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CHARS_PER_TOKEN", "SIM_CHAT_TEMPLATE", "TokenCounter", "block_keys", "find_tokenizer", "load_counter",
           "render_chat", "write_word_tokenizer"]

CHARS_PER_TOKEN = 4.0
"""The estimate used when no tokenizer can be loaded (English text averages about 4 characters a token)."""


@dataclass
class TokenCounter:
    """Counts a request's input tokens; ``exact`` False: an estimate (``basis`` says why)."""

    basis: str
    exact: bool
    encode: Callable[[str, bool], list[int]] | None = None
    template: Callable[[list[dict[str, Any]]], str] | None = None

    def ids(self, prompt: str | None, messages: Sequence[dict[str, Any]] | None, *, chat: bool) -> list[int] | None:
        """The token ids the engine is given (None with no tokenizer)."""
        if self.encode is None:
            return None
        if not chat:
            return self.encode(prompt or "", True)
        msgs = list(messages) if messages is not None else [{"role": "user", "content": prompt or ""}]
        if self.template is None:
            text = "\n".join(f"{m.get('role')}: {_content(m)}" for m in msgs)
            return self.encode(text, True)
        return self.encode(self.template(msgs), False)

    def count(self, prompt: str | None, messages: Sequence[dict[str, Any]] | None, *, chat: bool) -> int:
        ids = self.ids(prompt, messages, chat=chat)
        if ids is not None:
            return len(ids)
        chars = len(prompt or "") + sum(len(_content(m)) + len(str(m.get("role", ""))) + 4 for m in messages or [])
        return max(1, round(chars / CHARS_PER_TOKEN))


def _content(m: dict[str, Any]) -> str:
    c = m.get("content")
    if isinstance(c, list):
        return "".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
    return "" if c is None else str(c)


def block_keys(ids: Sequence[int], block: int) -> list[bytes]:
    """Keys of the prompt's full blocks of ``block`` tokens, each chained over the blocks before it."""
    out: list[bytes] = []
    prev = b""
    for start in range(0, len(ids) - block + 1, block):
        h = hashlib.blake2b(prev, digest_size=8)
        h.update(b",".join(str(i).encode() for i in ids[start:start + block]))
        prev = h.digest()
        out.append(prev)
    return out


def find_tokenizer(model: str, given: str | os.PathLike[str] | None) -> Path | None:
    """The folder holding ``model``'s ``tokenizer.json`` (see the module doc), or None."""
    if given is not None:
        p = Path(given).expanduser()
        p = p.parent if p.name == "tokenizer.json" else p
        return p if (p / "tokenizer.json").is_file() else None
    local = Path(model).expanduser()
    if (local / "tokenizer.json").is_file():
        return local
    hub = os.environ.get("HF_HUB_CACHE") or (
        str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None)
    root = Path(hub) if hub else Path.home() / ".cache" / "huggingface" / "hub"
    snaps = root / f"models--{model.replace('/', '--')}" / "snapshots"
    if snaps.is_dir():
        for snap in sorted(snaps.iterdir(), key=lambda s: s.stat().st_mtime, reverse=True):
            if (snap / "tokenizer.json").is_file():
                return snap
    return None


def render_chat(template: str, config: dict[str, Any]) -> Callable[[list[dict[str, Any]]], str]:
    """The chat template as transformers renders it (sandboxed jinja2, ``add_generation_prompt``)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)
    specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}

    def render(messages: list[dict[str, Any]]) -> str:
        return compiled.render(messages=messages, add_generation_prompt=True, **specials)

    return render


def _token_text(v: Any) -> str:
    if isinstance(v, dict):
        return str(v.get("content", ""))
    return "" if v is None else str(v)


def load_counter(model: str, tokenizer: str | os.PathLike[str] | None = None) -> TokenCounter:
    """The model's exact counter when its tokenizer can be loaded, else the estimate (``basis`` says which)."""
    folder = find_tokenizer(model, tokenizer)
    estimate = f"input tokens estimated at {CHARS_PER_TOKEN:g} characters a token"
    if folder is None:
        where = f"no tokenizer.json at {tokenizer}" if tokenizer is not None else (
            f"no tokenizer found for {model} (not a local folder, not in the Hugging Face cache)")
        return TokenCounter(basis=f"{estimate}: {where}; pass --tokenizer PATH for an exact count", exact=False)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return TokenCounter(basis=f"{estimate}: the tokenizers package is not installed "
                                  "(pip install tokenizers jinja2 for an exact count)", exact=False)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {}
    cfg_path = folder / "tokenizer_config.json"
    if cfg_path.is_file():
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")

    def encode(text: str, special: bool) -> list[int]:
        return list(tok.encode(text, add_special_tokens=special).ids)

    if not isinstance(template, str):
        return TokenCounter(basis=f"input tokens counted with {folder}/tokenizer.json; no chat template there: "
                                  "chat requests rendered as 'role: content' lines", exact=False, encode=encode)
    return TokenCounter(basis=f"input tokens counted with the model's tokenizer and chat template ({folder})",
                        exact=True, encode=encode, template=render_chat(template, config))


SIM_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant:{% endif %}")
"""The sim engine's rendering of a chat (``role: content`` lines, then ``assistant:``) as a chat template."""


def write_word_tokenizer(folder: str | os.PathLike[str], words: Sequence[str]) -> Path:
    """Write a tokenizer folder that counts as the sim engine does (one token a whitespace-separated word,
    its chat template the sim's rendering), ``words`` its vocabulary (others are one unknown token each):
    plans of sim batches count exactly what the sim's workers report. Needs ``tokenizers``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {"[UNK]": 0}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": SIM_CHAT_TEMPLATE}), encoding="utf-8")
    return out
