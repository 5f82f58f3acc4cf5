"""Jobs on RQ: the queue (stage, claim, lease, release, reap) and the one door untrusted job data comes in by."""
