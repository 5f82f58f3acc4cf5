"""Unit tests of src/lmdq/logs/ modules (tests/unit/test_mirror.py: one file per module)."""
