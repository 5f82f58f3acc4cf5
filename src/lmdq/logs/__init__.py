"""Logging: structlog JSON set-up, the fd relay, tqdm bars as events, and redaction of secrets."""
