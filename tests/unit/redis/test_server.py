"""lmdq.redis.server: what lmdq asks the Redis server about itself (PING, INFO sections)."""

from __future__ import annotations

import redis

from lmdq.redis import server


def test_ping_answers_true_on_a_live_server(client: redis.Redis) -> None:
    assert server.ping(client) is True


def test_info_returns_the_asked_section_and_its_counters_move(client: redis.Redis, prefix: str) -> None:
    before = int(server.info(client, "stats")["total_commands_processed"])
    for i in range(5):
        client.set(f"{prefix}:k{i}", i)
    after = int(server.info(client, "stats")["total_commands_processed"])
    assert after - before >= 6  # the five SETs and the first INFO
    assert "blocked_clients" in server.info(client, "clients")
    assert "redis_version" in server.info(client, "server")
    assert any(k.startswith("cmdstat_set") for k in server.info(client, "commandstats"))


def test_memory_info_is_info_memory(client: redis.Redis) -> None:
    got = server.memory_info(client)
    assert int(got["used_memory"]) > 0 and "maxmemory" in got
