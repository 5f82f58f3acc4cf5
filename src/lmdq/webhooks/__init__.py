"""Completion webhooks (issue 48): a signed HTTP POST when a batch ends (``batch.completed``,
``batch.failed``, ``batch.expired``, ``batch.cancelled``: OpenAI's event names) or is paused
(``batch.paused``).

Why its own package: an event is state of its own (an outbox, leases, tries, tenants' secrets) with its own
rules (never lost, never made twice, never blocking a job, only to allowed destinations). ``store`` holds
its Redis keys and Lua (the fragment the batch-end scripts run), ``signing`` the Standard Webhooks
signature, ``allow`` the allow list, ``delivery`` the thread that sends. docs/webhooks.md is the user's
side.
"""
