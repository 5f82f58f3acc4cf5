"""lmdq's Redis home: connections, the key layout, reply decoding and the Lua scripts (the core's only Redis code).

Concept packages (batches, jobs, results, workers, metrics) keep the rules; what they say to Redis is here.
"""
