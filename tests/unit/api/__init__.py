"""Unit tests of lmdq/api/ modules (tests/unit/test_mirror.py: one file per module)."""
