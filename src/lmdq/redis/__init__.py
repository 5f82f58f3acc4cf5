"""What lmdq's concepts share about Redis: connections and retry (``connection``), the key layout
(``keys``), reply decoding (``replies``), server checks (``server``), and the one way Lua is composed
and run with the fragments several concepts use (``scripts``).

Each concept owns its stored state: its Redis commands and its Lua live beside its rules, in its own
package's store modules (tests/test_redis_boundary.py lists them, exactly, in ``STORE_MODULES``).
"""
