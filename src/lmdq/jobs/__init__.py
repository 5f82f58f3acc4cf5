"""Jobs on RQ: the queue (stage, claim, lease, release, reap), wake-ups and the idle roster, and the one
door untrusted job data comes in by; their Redis commands and Lua are this package's store (``leases``,
``rq_records``, ``reads``, ``wakeup``, ``idle_roster``, and the capped reads in ``data`` and ``decode``)."""
