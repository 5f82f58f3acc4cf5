"""Unit tests of src/lmdq/client/ modules (tests/unit/test_mirror.py: one file per module)."""
