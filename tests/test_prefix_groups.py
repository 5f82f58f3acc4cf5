"""Prefix-aware job formation (src/lmdq/submission/prefix_groups.py) through the real submit and a real redis-server:
which requests land in which job, input indices and custom_ids kept, the off switch, file edits caught."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from lmdq.contract import Request
from lmdq.jobs.queue import JobQueue
from lmdq.redis.keys import Keys
from lmdq.submission.ledger import BatchLedger
from lmdq.submission.submit import SubmitOptions, submit_file
from tests.helpers import write_jsonl

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike"]


def doc_qa_rows(docs: int, questions: int, doc_words: int, seed: int = 0, system: str | None = None
                ) -> list[dict[str, Any]]:
    """``docs`` documents of random words, ``questions`` questions each, shuffled: doc d's question q
    has custom_id ``d{d}-q{q}``."""
    rnd = random.Random(seed)
    rows = []
    for d in range(docs):
        doc = " ".join(rnd.choice(WORDS) for _ in range(doc_words))
        for q in range(questions):
            msgs = [{"role": "user", "content": f"Document {d}:\n{doc}\n\nQuestion {q}: what is word {q}?"}]
            if system is not None:
                msgs.insert(0, {"role": "system", "content": system})
            rows.append({"custom_id": f"d{d}-q{q}", "messages": msgs})
    rnd.shuffle(rows)
    return rows


def jobs_of(client: redis.Redis, prefix: str, batch_id: str) -> list[list[Request]]:
    keys = Keys(prefix)
    jq = JobQueue(client, keys=keys)
    ids = [j.decode() for j in client.lrange(keys.batch_jobs(batch_id), 0, -1)]
    return [JobQueue.payload_of(jq.fetch_job(i)).requests for i in ids]


def submit(client: redis.Redis, prefix: str, path: Path, **kw: Any) -> Any:
    opts = SubmitOptions(model="sim", allow_unknown_model=True, **kw)
    batch, created = submit_file(path, opts, client=client, keys=Keys(prefix), ttl_s=3600)
    assert created
    return batch


def doc_of(r: Request) -> str:
    return r.custom_id.split("-")[0]


def test_shuffled_doc_questions_go_whole_into_jobs(tmp_path: Path, client: redis.Redis, prefix: str) -> None:
    rows = doc_qa_rows(docs=10, questions=8, doc_words=150)
    f = write_jsonl(tmp_path / "qa.jsonl", rows)
    batch = submit(client, prefix, f, batch_size=20)
    jobs = jobs_of(client, prefix, batch.id)
    assert batch.prefix_groups and batch.num_jobs == len(jobs) == 5  # two 8-question groups a job, never three
    where: dict[str, set[int]] = {}
    for n, reqs in enumerate(jobs):
        assert len(reqs) == 16
        for r in reqs:
            where.setdefault(doc_of(r), set()).add(n)
            # each request keeps its input index and custom_id (results and exports are by index)
            assert rows[r.index]["custom_id"] == r.custom_id
            assert r.messages is not None and r.messages[0].content == rows[r.index]["messages"][0]["content"]
        # within a job: a group's questions back to back, in input order
        docs = [doc_of(r) for r in reqs]
        assert docs == sorted(docs, key=docs.index)
        assert [r.index for r in reqs if doc_of(r) == docs[0]] == sorted(r.index for r in reqs if doc_of(r) == docs[0])
    assert all(len(jobs_) == 1 for jobs_ in where.values()), where
    assert sorted(r.index for reqs in jobs for r in reqs) == list(range(80))
    # groups in the order of their first request in the file
    first = {}
    for i, row in enumerate(rows):
        first.setdefault(row["custom_id"].split("-")[0], i)
    order = list(dict.fromkeys(doc_of(r) for reqs in jobs for r in reqs))
    assert order == sorted(first, key=first.__getitem__)


def test_a_long_shared_system_prompt_is_not_the_group(tmp_path: Path, client: redis.Redis, prefix: str) -> None:
    """Every request starts with the same 3 KB system prompt: the documents after it are the groups."""
    rows = doc_qa_rows(docs=6, questions=4, doc_words=300, system="You answer from the document. " * 100)
    f = write_jsonl(tmp_path / "qa.jsonl", rows)
    jobs = jobs_of(client, prefix, submit(client, prefix, f, batch_size=8).id)
    assert len(jobs) == 3
    for reqs in jobs:
        assert len({doc_of(r) for r in reqs}) == 2


def test_group_bigger_than_a_job_fills_consecutive_jobs(tmp_path: Path, client: redis.Redis, prefix: str) -> None:
    rows = doc_qa_rows(docs=3, questions=10, doc_words=150, seed=3)
    f = write_jsonl(tmp_path / "qa.jsonl", rows)
    jobs = jobs_of(client, prefix, submit(client, prefix, f, batch_size=4).id)
    flat = [doc_of(r) for reqs in jobs for r in reqs]
    # groups bigger than a job straddle jobs anyway: they fill the jobs they touch, no half-empty job
    assert [len(j) for j in jobs] == [4] * 7 + [2]
    assert flat == sorted(flat, key=flat.index)  # each document's questions contiguous


def test_no_shared_prefix_keeps_input_order(tmp_path: Path, client: redis.Redis, prefix: str) -> None:
    rows = [{"custom_id": f"r{i}", "prompt": f"{i} " + " ".join(random.Random(i).choices(WORDS, k=200))}
            for i in range(30)]
    f = write_jsonl(tmp_path / "plain.jsonl", rows)
    batch = submit(client, prefix, f, batch_size=8)
    jobs = jobs_of(client, prefix, batch.id)
    assert not batch.prefix_groups and batch.num_jobs == 4
    # the record of a batch in input order is what it was before the field (older workers read it)
    assert b"prefix_groups" not in client.hget(Keys(prefix).batch(batch.id), "meta")  # type: ignore[operator]
    assert [[r.index for r in reqs] for reqs in jobs] == [list(range(s, min(s + 8, 30))) for s in range(0, 30, 8)]


def test_no_prefix_groups_flag_keeps_input_order(tmp_path: Path, env: dict[str, str], client: redis.Redis,
                                                 prefix: str) -> None:
    from tests.conftest import run_cli

    f = write_jsonl(tmp_path / "qa.jsonl", doc_qa_rows(docs=4, questions=4, doc_words=150))
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--json",
                "--batch-size", "4", "--no-prefix-groups", env=env)
    assert p.returncode == 0, p.stderr.decode()
    b = json.loads(p.stdout)
    assert b["prefix_groups"] is False
    assert [[r.index for r in reqs] for reqs in jobs_of(client, prefix, b["id"])] == [
        list(range(s, s + 4)) for s in range(0, 16, 4)]
    p = run_cli("producer", "submit", str(f), "--model", "sim", "--allow-unknown-model", "--json",
                "--batch-size", "4", env=env)
    b = json.loads(p.stdout)
    assert b["prefix_groups"] is True
    assert all(len({doc_of(r) for r in reqs}) == 1 for reqs in jobs_of(client, prefix, b["id"]))


def test_retry_sources_of_a_grouped_batch(tmp_path: Path, client: redis.Redis, prefix: str) -> None:
    """A grouped batch's request i is not in job i // batch_size: the retry's source read finds it anyway."""
    rows = doc_qa_rows(docs=5, questions=6, doc_words=150)
    f = write_jsonl(tmp_path / "qa.jsonl", rows)
    batch = submit(client, prefix, f, batch_size=7)
    ledger = BatchLedger(client, keys=Keys(prefix), ttl_s=3600)
    want = [0, 5, 6, 13, 29]
    got = list(ledger.source_requests(batch, want))
    assert sorted(r.index for r in got) == want
    assert all(r.custom_id == rows[r.index]["custom_id"] for r in got)


@pytest.mark.parametrize("mode", ["append", "truncate", "same-size", "delete"])
def test_file_edited_during_a_grouped_submit_exits_2(mode: str, tmp_path: Path, env: dict[str, str],
                                                     client: redis.Redis, prefix: str) -> None:
    """The grouped pass 2 reads by offset in group order: the same edits as test_submit's are caught."""
    from tests.test_submit import _EDIT_DURING_SUBMIT, _all_keys, _nothing_enqueued

    rows = doc_qa_rows(docs=6, questions=5, doc_words=150)
    for i, r in enumerate(rows):
        r["messages"][0]["content"] += f" (prompt number {i})"
    f = write_jsonl(tmp_path / "edited.jsonl", rows)
    before = _all_keys(client)
    p = subprocess.run([sys.executable, "-c", _EDIT_DURING_SUBMIT, mode, "submit", str(f), "--model", "sim",
                        "--allow-unknown-model", "--batch-size", "7"], env=env, capture_output=True, timeout=120)
    err = p.stderr.decode()
    assert p.returncode == 2, err
    assert f"{f}: the file changed during submit" in err and "Traceback" not in err, err
    _nothing_enqueued(client, prefix)
    assert not _all_keys(client) - before  # nothing added (other tests' TTL'd keys may expire meanwhile)


def _line(no: int, prompt: str | None = None, messages: list[dict[str, Any]] | None = None) -> Any:
    from lmdq.contract import Endpoint
    from lmdq.submission.formats import ParsedLine

    return ParsedLine(no, str(no), prompt, messages, Endpoint.chat, None, None)


def test_a_chat_prompt_groups_with_the_same_text_as_one_user_message() -> None:
    from lmdq.submission.prefix_groups import prefix_text

    doc = "lorem ipsum " * 100
    assert prefix_text(_line(1, prompt=doc + "a"), 600) == prefix_text(
        _line(2, messages=[{"role": "user", "content": [{"type": "text", "text": doc + "b"}]}]), 600)
    assert prefix_text(_line(1, prompt=doc), 600) != prefix_text(
        _line(2, messages=[{"role": "system", "content": doc}]), 600)


def test_unshared_requests_fill_the_gaps_between_groups_in_input_order() -> None:
    """Singletons (short or unshared prompts) are never moved past a later group's first request."""
    from lmdq.submission.prefix_groups import PrefixKeys, plan_jobs

    doc_a, doc_b = "alpha " * 200, "bravo " * 200
    texts = [doc_a + "1", "short 1", doc_b + "1", doc_a + "2", "short 2", "x" * 3000, doc_b + "2", doc_a + "3"]
    pk = PrefixKeys(512)
    for i, t in enumerate(texts):
        pk.add(i * 10, _line(i + 1, prompt=t))
    plan = plan_jobs(pk, batch_size=4)
    assert plan is not None and plan.groups == 2
    # doc_a's three fit in job 0 with "short 1"; doc_b's two do not fit behind them: a new job
    assert list(plan.order) == [0, 3, 7, 1, 2, 6, 4, 5] and list(plan.sizes) == [4, 4]
    assert list(pk.line_nos) == list(range(1, 9)) and list(pk.offsets) == [i * 10 for i in range(8)]
