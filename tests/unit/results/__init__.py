"""Unit tests of src/lmdq/results/ modules (tests/unit/test_mirror.py: one file per module)."""
