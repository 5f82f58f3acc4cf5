"""Quality gates: a canary sample judged before the rest of a batch runs, and a rolling window judged as
it runs (issue 46, docs/plan-deadline-canary.md "Canary"). ``config`` says what a batch's gates are,
``gates`` judges results against them, ``store`` keeps their state in Redis (its keys, its Lua)."""
