"""Unit tests of src/lmdq/batches/ modules (tests/unit/test_mirror.py: one file per module)."""
