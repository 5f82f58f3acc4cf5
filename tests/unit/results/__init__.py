"""Unit tests of lmdq/results/ modules (tests/unit/test_mirror.py: one file per module)."""
