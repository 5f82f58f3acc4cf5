"""lmdq's Redis home: connections, the key layout, reply decoding, every Lua script, and the data access
that is nothing but Redis (wake-ups, the idle roster, the worker and model registries, the exporter's read).

Concept packages (batches, jobs, results, metrics) keep the rules; what they say to Redis belongs here
(tests/test_redis_boundary.py lists, exactly, the modules that still say it themselves).
"""
