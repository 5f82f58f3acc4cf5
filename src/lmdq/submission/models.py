"""``lmdq-producer models``: what ``models list`` prints, at any terminal width.

The names and times come from :class:`lmdq.registry.store.ModelRegistry`; this module only lays them out.
Times are shown as ages against the Redis server's clock (the clock they were written with), so a
producer machine with a wrong clock does not make a live model look stale. A model name is never
cut: it is what an operator copies into ``submit --model`` or ``models remove``.
"""

from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text

from lmdq.registry.store import ModelInfo

__all__ = ["age", "model_lines", "models_table"]


def age(then: float | None, now: float) -> str:
    """'12s ago', '3m ago', '5h ago', '2d ago'; 'never' for no time at all."""
    if then is None:
        return "never"
    s = max(0.0, now - then)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{int(s // size)}{unit} ago"
    return f"{int(s)}s ago"


def _registered(m: ModelInfo, now: float) -> str:
    return age(m.registered_at, now) if m.registered else "no"


def models_table(models: list[ModelInfo], now: float) -> Table:
    """The table ``models list`` prints when it fits; only the note may wrap."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("model", no_wrap=True)
    table.add_column("registered", no_wrap=True)
    table.add_column("last seen", no_wrap=True)
    table.add_column("workers", justify="right", no_wrap=True)
    notes = any(m.note for m in models)
    if notes:
        table.add_column("note", overflow="fold", min_width=8)
    for m in models:
        # Text, not str: a name or note read from Redis is data, never rich markup ("[b]" stays "[b]")
        row: list[Text | str] = [Text(m.name), _registered(m, now), age(m.last_seen, now), str(m.live_workers)]
        table.add_row(*row, *([Text(m.note or "")] if notes else []))
    return table


def model_lines(models: list[ModelInfo], now: float) -> list[tuple[str, list[str]]]:
    """For a terminal too narrow for the table: each name whole on its own line, then its fields."""
    out = []
    for m in models:
        fields = [f"registered={_registered(m, now)}", f"last_seen={age(m.last_seen, now)}",
                  f"workers={m.live_workers}"]
        if m.note:
            fields.append(f"note={m.note}")
        out.append((m.name, fields))
    return out
