"""lmdq.results.store: final and partial records, the shard index read, on a real redis-server."""

from __future__ import annotations

import redis

from lmdq.redis.keys import BatchField, Keys
from lmdq.results.store import ResultRecords, ResultWrite


def _records(client: redis.Redis, prefix: str, batch_id: str = "b1") -> ResultRecords:
    client.hset(Keys(prefix).batch(batch_id), mapping={BatchField.status.value: "in_progress"})
    return ResultRecords(client, keys=Keys(prefix))


def _final(index: int, data: str, batch_id: str = "b1") -> ResultWrite:
    return (batch_id, index, data, BatchField.completed.value, 1.0, 60, 3, "m")


def test_a_final_is_written_once_and_counted_once(client: redis.Redis, prefix: str) -> None:
    r = _records(client, prefix)
    assert r.write_final(_final(0, '{"a":1}')) is True
    assert r.write_final(_final(0, '{"a":2}')) is False  # HSETNX: the first answer stays
    k = Keys(prefix)
    assert client.hget(k.results("b1"), "0") == b'{"a":1}'
    assert client.hget(k.batch("b1"), BatchField.completed.value) == b"1"
    assert r.output_tokens_field("b1") == b"3"


def test_many_finals_go_in_one_pipeline_with_per_result_answers(client: redis.Redis, prefix: str) -> None:
    r = _records(client, prefix)
    r.write_final(_final(1, "x"))
    assert r.write_finals([_final(0, "a"), _final(1, "b"), _final(2, "c")]) == [True, False, True]
    assert r.write_finals([]) == []
    finals, partials = r.read("b1", [0, 1, 2, 3], partial=False)
    assert finals == [b"a", b"x", b"c", None] and partials == [None] * 4


def test_a_group_is_one_script_call_per_batch_with_counters_added_once(client: redis.Redis, prefix: str) -> None:
    r = _records(client, prefix, "b1")
    _records(client, prefix, "b2")
    k = Keys(prefix)
    client.hset(k.batch("b2"), mapping={BatchField.total.value: 2})
    failed = ("b1", 3, "f", BatchField.failed.value, 1.0, 60, 0, "")
    writes = [_final(0, "a"), _final(0, "b2-0", batch_id="b2"), _final(1, "b"), failed, _final(0, "dup"),
              _final(1, "b2-1", batch_id="b2")]
    client.config_resetstat()
    assert r.write_finals(writes) == [True, True, True, True, False, True]
    calls = {key: v["calls"] for key, v in client.info("commandstats").items()}
    assert calls.get("cmdstat_evalsha", 0) + calls.get("cmdstat_eval", 0) == 2  # one per batch, not per result
    assert calls["cmdstat_hincrby"] == 4 + 3  # b1: completed, by_model:m:completed, failed, output_tokens; b2: 3
    b1 = client.hgetall(k.batch("b1"))
    assert b1[b"completed"] == b"2" and b1[b"failed"] == b"1" and b1[b"output_tokens"] == b"6"
    assert b1[b"by_model:m:completed"] == b"2" and b"by_model::failed" not in b1
    b2 = client.hgetall(k.batch("b2"))
    assert b2[b"completed"] == b"2" and b2[b"status"] == b"completed"  # its last result ended it, once
    assert client.ttl(k.results("b1")) > 0


def test_one_batch_is_one_plain_script_call_without_script_exists(client: redis.Redis, prefix: str) -> None:
    """A job's results (one batch) go as one EVALSHA: no pipeline, so no SCRIPT EXISTS round trip first."""
    r = _records(client, prefix)
    r.write_final(_final(1, "x"))  # the script is loaded from here on
    client.config_resetstat()
    assert r.write_finals([_final(0, "a"), _final(1, "b"), _final(2, "c")]) == [True, False, True]
    calls = {key: v["calls"] for key, v in client.info("commandstats").items()}
    assert calls.get("cmdstat_evalsha", 0) == 1 and "cmdstat_script|exists" not in calls, calls
    client.script_flush()  # a Redis restarted without its scripts: NOSCRIPT, then loaded, same answers
    assert r.write_finals([_final(3, "d"), _final(0, "again")]) == [True, False]


def test_a_write_for_a_batch_without_a_record_is_refused(client: redis.Redis, prefix: str) -> None:
    r = ResultRecords(client, keys=Keys(prefix))
    assert r.write_final(_final(0, "a", batch_id="gone")) is False
    assert r.write_finals([_final(0, "a", batch_id="gone"), _final(1, "b", batch_id="gone")]) == [False, False]
    assert not client.exists(Keys(prefix).results("gone"))


def test_partials_are_read_beside_finals_and_dropped_by_the_final(client: redis.Redis, prefix: str) -> None:
    r = _records(client, prefix)
    assert r.write_partials([("b1", 0, "p0", 60), ("b1", 1, "p1", 60), ("gone", 0, "x", 60)]) == [True, True, False]
    assert r.partial_count("b1") == 2
    assert r.read("b1", [0, 1], partial=True) == ([None, None], [b"p0", b"p1"])
    with client.pipeline(transaction=False) as p:
        assert r.write_final(_final(0, "f0"), pipe=p) is True  # in a pipeline: the answer is execute's
        assert p.execute() == [[1]]  # the script answers one 0/1 per result it was given
    assert r.partial_count("b1") == 1
    assert r.read("b1", [0, 1], partial=True) == ([b"f0", None], [None, b"p1"])


def test_the_shard_index_is_read_raw(client: redis.Redis, prefix: str) -> None:
    r = _records(client, prefix)
    assert r.index_len("b1") == 0 and list(r.index_items("b1")) == []
    client.hset(Keys(prefix).shards("b1"), mapping={"0": "e0", "1": "e1"})
    assert r.index_len("b1") == 2
    assert sorted(r.index_items("b1")) == [(b"0", b"e0"), (b"1", b"e1")]
    assert r.output_tokens_field("nope") is None
