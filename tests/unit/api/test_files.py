"""lmdq.api.files: the HTTP API's file records, one hash each plus one id list per tenant."""

from __future__ import annotations

import redis

from lmdq.api.files import ApiFileRecords
from lmdq.redis.keys import Keys


def test_create_writes_the_owner_the_fields_the_ttls_and_the_tenants_list(client: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    files = ApiFileRecords(client, keys)
    files.create("file-a", "acme", {"filename": "in.jsonl", "bytes": 12}, ttl_s=100, index_ttl_s=500, created=1.5)
    assert files.read("file-a") == {b"tenant": b"acme", b"filename": b"in.jsonl", b"bytes": b"12"}
    assert 0 < client.ttl(keys.api_file("file-a")) <= 100
    assert files.index("acme") == keys.api_files("acme") == f"{prefix}:api:tenant:acme:files"
    assert client.zrange(files.index("acme"), 0, -1, withscores=True) == [(b"file-a", 1.5)]
    assert 100 < client.ttl(files.index("acme")) <= 500
    assert client.zcard(files.index("other")) == 0  # listed for its owner only


def test_read_many_keeps_the_order_and_a_missing_record_reads_empty(client: redis.Redis, prefix: str) -> None:
    files = ApiFileRecords(client, Keys(prefix))
    for n, fid in enumerate(("file-1", "file-2")):
        files.create(fid, "t", {"bytes": n}, ttl_s=60, index_ttl_s=60, created=float(n))
    assert files.read_many(["file-2", "file-gone", "file-1"]) == [
        {b"tenant": b"t", b"bytes": b"1"}, {}, {b"tenant": b"t", b"bytes": b"0"}]
    assert files.read_many([]) == []
    assert files.read("file-gone") == {}


def test_remove_drops_the_record_and_its_list_entry_and_has_record_follows(client: redis.Redis, prefix: str) -> None:
    files = ApiFileRecords(client, Keys(prefix))
    files.create("file-x", "t", {"bytes": 1}, ttl_s=60, index_ttl_s=60, created=1.0)
    files.create("file-y", "t", {"bytes": 2}, ttl_s=60, index_ttl_s=60, created=2.0)
    assert files.has_record("file-x")
    files.remove("t", "file-x")
    assert not files.has_record("file-x") and files.read("file-x") == {}
    assert client.zrange(files.index("t"), 0, -1) == [b"file-y"]
    assert files.has_record("file-y")
