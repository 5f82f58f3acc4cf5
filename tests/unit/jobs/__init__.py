"""Unit tests of src/lmdq/jobs/ modules (tests/unit/test_mirror.py: one file per module)."""
