"""Unit tests mirroring lmdq/ packages: tests/unit/<package>/test_<module>.py (issue 30)."""
