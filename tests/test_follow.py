"""``results --follow`` (src/lmdq/submission/follow.py) on a real Redis: each result as it is stored (finish order),
``--in-order`` holding back only what must wait, the results sink's shards included, and the end of
the batch ending the command. Every step waits on a line the follower wrote or on a poll's return,
never on the clock."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from lmdq.contract import Batch, BatchStatus, JobPayload, Request, RequestCounts, Result, ResultStatus
from lmdq.redis.keys import Keys
from lmdq.results.sink import flush_job
from lmdq.results.store import ResultStore
from lmdq.submission.follow import Follower
from tests.conftest import ROOT
from tests.test_cli_terminal import _Lines


def _batch(store: ResultStore, total: int, results_url: str | None = None) -> Batch:
    bid = f"batch_{time.time_ns():024x}"[:30]
    b = Batch(id=bid, model="sim", status=BatchStatus.in_progress, batch_size=2,
              request_counts=RequestCounts(total=total), created_at=time.time(), results_url=results_url)
    store.batches.create(b)
    return b


def _store_result(store: ResultStore, bid: str, i: int, status: ResultStatus = ResultStatus.completed) -> None:
    assert store.write_result(Result(batch_id=bid, custom_id=f"r{i}", index=i, status=status, model="sim",
                                     text=f"answer {i}", generate_token_len=2))


def _indices(raws: list[bytes]) -> list[int]:
    return [json.loads(r)["index"] for r in raws]


def test_finish_order_writes_each_result_at_the_first_poll_after_it_is_stored(client: redis.Redis,
                                                                              prefix: str) -> None:
    store = ResultStore(client, keys=Keys(prefix))
    b = _batch(store, 4)
    f = Follower(store, b)
    assert f.poll(store.batches.get(b.id)) == []
    _store_result(store, b.id, 2)
    assert _indices(f.poll(store.batches.get(b.id))) == [2]
    assert f.poll(store.batches.get(b.id)) == []  # never twice
    _store_result(store, b.id, 0)
    _store_result(store, b.id, 3, ResultStatus.failed)
    assert _indices(f.poll(store.batches.get(b.id))) == [0, 3]
    assert not f.finished
    _store_result(store, b.id, 1)
    last = store.batches.get(b.id)
    assert last.status is BatchStatus.completed
    assert _indices(f.poll(last)) == [1] and f.finished


def test_in_order_holds_back_only_what_must_wait(client: redis.Redis, prefix: str) -> None:
    store = ResultStore(client, keys=Keys(prefix))
    b = _batch(store, 5)
    f = Follower(store, b, in_order=True)
    _store_result(store, b.id, 1)
    _store_result(store, b.id, 2)
    assert f.poll(store.batches.get(b.id)) == []  # 0 is not in: 1 and 2 must wait
    _store_result(store, b.id, 0)
    assert _indices(f.poll(store.batches.get(b.id))) == [0, 1, 2]  # all three at once, no later
    _store_result(store, b.id, 4)
    assert f.poll(store.batches.get(b.id)) == []
    _store_result(store, b.id, 3)
    assert _indices(f.poll(store.batches.get(b.id))) == [3, 4] and f.finished


@pytest.mark.parametrize("in_order", [False, True])
def test_results_sealed_into_shards_are_followed_from_there(client: redis.Redis, prefix: str, tmp_path: Path,
                                                            in_order: bool) -> None:
    """With a results sink a finished job's records leave Redis for its shard before the follower polls."""
    keys = Keys(prefix)
    store = ResultStore(client, keys=keys)
    b = _batch(store, 4, results_url=str(tmp_path))
    f = Follower(store, b, in_order=in_order)
    jobs = [JobPayload(batch_id=b.id, model="sim", job_no=j, results_url=str(tmp_path),
                       requests=[Request(index=i, custom_id=f"r{i}", prompt="p") for i in (2 * j, 2 * j + 1)])
            for j in range(2)]
    for i in (2, 3):
        _store_result(store, b.id, i)
    assert flush_job(client, keys, jobs[1]) is not None
    assert client.hlen(keys.results(b.id)) == 0  # in the shard only
    got = f.poll(store.batches.get(b.id))
    assert _indices(got) == ([] if in_order else [2, 3])
    for i in (0, 1):
        _store_result(store, b.id, i)
    assert flush_job(client, keys, jobs[0]) is not None
    got += f.poll(store.batches.get(b.id))
    assert _indices(got) == ([0, 1, 2, 3] if in_order else [2, 3, 0, 1]) and f.finished
    assert [json.loads(r)["text"] for r in sorted(got, key=lambda r: json.loads(r)["index"])] == [
        f"answer {i}" for i in range(4)]


def _follow(env: dict[str, str], bid: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "lmdq.producer", "results", bid, "--follow", *args], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("in_order", [False, True])
def test_cli_follow_writes_while_the_batch_runs_and_ends_with_it(client: redis.Redis, prefix: str,
                                                                 env: dict[str, str], in_order: bool) -> None:
    """bd9ca4b had no --follow (and --wait wrote nothing before the end). Here the line for a result is
    read BEFORE the next result is stored, so it cannot have come at the end."""
    store = ResultStore(client, keys=Keys(prefix))
    b = _batch(store, 4)
    p = _follow(env, b.id, *(["--in-order"] if in_order else []))
    try:
        assert p.stdout is not None
        out = _Lines(p.stdout)
        _store_result(store, b.id, 2)
        if in_order:
            _store_result(store, b.id, 0)
            assert json.loads(out.next())["index"] == 0  # 2 waits for 1
            _store_result(store, b.id, 1)
            assert [json.loads(out.next())["index"] for _ in range(2)] == [1, 2]
        else:
            assert json.loads(out.next())["index"] == 2  # before anything else is stored
            _store_result(store, b.id, 0)
            assert json.loads(out.next())["index"] == 0
            _store_result(store, b.id, 1)
            assert json.loads(out.next())["index"] == 1
        assert store.batches.get(b.id).status is BatchStatus.in_progress
        _store_result(store, b.id, 3)
        assert json.loads(out.next())["index"] == 3
        assert out.next() == ""  # end of output: the batch ended, so did the command
        assert p.wait(60) == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_cli_follow_openai_format_and_timeout(client: redis.Redis, prefix: str, env: dict[str, str],
                                              tmp_path: Path) -> None:
    store = ResultStore(client, keys=Keys(prefix))
    b = _batch(store, 3)
    _store_result(store, b.id, 0)
    _store_result(store, b.id, 1, ResultStatus.failed)
    out, errs = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    p = _follow(env, b.id, "--format", "OpenAI", "-o", str(out), "--errors-file", str(errs), "--timeout", "1",
                "--interval", "0.1")
    _, stderr = p.communicate(timeout=60)
    assert p.returncode == 1, stderr
    lines = stderr.decode().splitlines()
    assert lines[-1] == f"error: batch {b.id} still in_progress after 1.0s (2/3 done)", lines
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["r0"]
    assert [json.loads(x)["custom_id"] for x in errs.read_text().splitlines()] == ["r1"]
    assert any(" in_progress 2/3 done " in ln for ln in lines), lines  # progress on stderr: -o is a file


def test_cli_wait_shows_progress_before_the_batch_ends(client: redis.Redis, prefix: str, env: dict[str, str],
                                                       tmp_path: Path) -> None:
    """bd9ca4b's --wait wrote nothing at all until the batch ended (first line at 68.8 s of a 69 s batch).
    Progress lines on stderr (not a terminal) come while it runs; the results then follow in input order."""
    store = ResultStore(client, keys=Keys(prefix))
    b = _batch(store, 3)
    _store_result(store, b.id, 1)
    out = tmp_path / "r.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "lmdq.producer", "results", b.id, "--wait", "-o", str(out),
                          "--interval", "0.1"], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stderr is not None
        err = _Lines(p.stderr)
        first = err.next()
        assert f" {b.id} in_progress 1/3 done (33.3%) " in first, first
        assert err.next().startswith("hint: no live worker serves model 'sim'"), err.seen
        _store_result(store, b.id, 0)
        _store_result(store, b.id, 2)
        assert p.wait(60) == 0, err.seen
    finally:
        if p.poll() is None:
            p.kill()
    assert [json.loads(x)["index"] for x in out.read_text().splitlines()] == [0, 1, 2]
