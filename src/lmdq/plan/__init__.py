"""Know before you run (issue 46): a batch's plan (tokens, GPU-seconds, ETA, cost) from what the fleet
measured, and the store of those measurements (:mod:`lmdq.plan.store`)."""
