"""Unit tests of src/lmdq/redis/ modules, each against a real redis-server (tests/conftest.py)."""
