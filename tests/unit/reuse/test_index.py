"""Resolving index entries into results: shard pointers, compact copies, and what is never believed."""

from __future__ import annotations

import hashlib
from pathlib import Path

import redis

from lmdq.contract import Result, ResultStatus
from lmdq.redis.keys import Keys
from lmdq.results.shards import shard_key
from lmdq.reuse.index import Completed, ReuseIndex
from lmdq.reuse.store import ReuseStore

BID = "batch_" + "c" * 24


def ident(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def result(i: int, status: ResultStatus = ResultStatus.completed) -> Result:
    return Result(batch_id=BID, custom_id=f"q{i}", index=i, status=status, text=f"answer {i}", model="m",
                  input_token_len=3, generate_token_len=2)


def test_copies_answer_until_their_source_expires(client: redis.Redis, prefix: str) -> None:
    idx = ReuseIndex(ReuseStore(client, keys=Keys(prefix)))
    n = idx.record("m", batch_id=BID, results_url=None, ttl_s=100, sealed=False,
                   done=[Completed(ident(i), result(i), 0) for i in range(3)]
                   + [Completed(ident(9), result(9, ResultStatus.failed), 0)])
    assert n == 3  # the failed one is never indexed
    got = idx.find("m", [ident(0), ident(2), ident(9), ident(5)])
    assert sorted(got) == [0, 1]
    assert got[1].text == "answer 2" and got[1].reused_from is not None and got[1].reused_from.custom_id == "q2"
    client.hset(Keys(prefix).reuse_sources("m"), "e1", 1)  # the source's expiry is in the past now
    assert idx.find("m", [ident(0)]) == {}


def test_pointers_read_the_shard_line_and_check_it(client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    url = tmp_path.as_uri()
    shard = tmp_path / shard_key(BID, 4)
    shard.parent.mkdir(parents=True)
    lines = [result(i).model_dump_json(exclude={"reused_from"}) for i in (10, 11)]
    shard.write_text("\n".join(lines) + "\n")
    idx = ReuseIndex(ReuseStore(client, keys=Keys(prefix)))
    idx.record("m", batch_id=BID, results_url=url, ttl_s=100, sealed=True,
               done=[Completed(ident(i), result(i), 4) for i in (10, 11)])
    got = idx.find("m", [ident(11), ident(10)])
    assert got[0].text == "answer 11" and got[0].reused_from is not None and got[0].reused_from.batch == BID
    # a shard rewritten with another batch's line at that index is not believed; a deleted one is a miss
    shard.write_text(lines[0] + "\n" + lines[1].replace(BID, "batch_" + "d" * 24) + "\n")
    assert sorted(idx.find("m", [ident(11), ident(10)])) == [1]
    shard.unlink()
    assert idx.find("m", [ident(10)]) == {}
    assert ReuseStore(client, keys=Keys(prefix)).counters("m")["hits"] == 3


def test_exports_show_reused_from_only_on_a_reused_result() -> None:
    import json

    from lmdq.contract import ReusedFrom
    from lmdq.results.export import _columns
    from lmdq.results.openai import to_openai
    from lmdq.results.store import _record_json

    fresh = result(1)
    reused = result(2).model_copy(update={"reused_from": ReusedFrom(batch=BID, custom_id="q9")})
    assert "reused_from" not in json.loads(_record_json(fresh))
    assert json.loads(_record_json(reused))["reused_from"] == {"batch": BID, "custom_id": "q9"}
    assert "reused_from" not in to_openai(fresh) and to_openai(reused)["reused_from"]["custom_id"] == "q9"
    cols = _columns([_record_json(fresh).encode(), _record_json(reused).encode()])
    assert cols["reused_from"][0] is None and json.loads(cols["reused_from"][1])["batch"] == BID
    assert to_openai(reused)["response"] == to_openai(fresh.model_copy(update={"index": 2, "custom_id": "q2",
                                                                               "text": "answer 2"}))["response"]
