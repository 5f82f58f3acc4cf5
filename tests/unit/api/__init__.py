"""Unit tests of src/lmdq/api/ modules (tests/unit/test_mirror.py: one file per module)."""
