"""Blob store (tensors as safetensors) and results sink (JSONL shards), on a local folder and on a
REAL S3-compatible server (moto's server mode, started here on a loopback port)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis

np = pytest.importorskip("numpy")
pytest.importorskip("safetensors")
pytest.importorskip("fsspec")

from lmdq.contract import (  # noqa: E402
    Batch,
    BatchStatus,
    JobPayload,
    RequestCounts,
    Result,
    ResultStatus,
)
from lmdq.redis.keys import Keys  # noqa: E402
from lmdq.results.blobs import BlobStore, TensorTooLarge, read_tensor  # noqa: E402
from lmdq.results.sink import flush_job, shard_key  # noqa: E402
from lmdq.results.store import ResultStore  # noqa: E402
from tests.conftest import run_cli, start_worker  # noqa: E402
from tests.helpers import moto_s3, wait_batch, write_jsonl  # noqa: E402

BUCKET = "lmdq-test"
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    """A moto S3 server on a free loopback port with one bucket; yields the env that points at it."""
    pytest.importorskip("s3fs")
    with moto_s3(BUCKET) as port:
        env = {**_AWS_ENV, "LMDQ_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield env
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _tensors() -> dict[str, Any]:
    return {
        "logits": np.arange(3 * 7, dtype=np.float32).reshape(3, 7),
        "last_hidden_state": np.full((3, 4), 0.5, dtype=np.float16),
    }


def _check_roundtrip(store: BlobStore, prefix_uri: str) -> None:
    t = _tensors()
    refs = store.put_tensors("batch_x/3", t)
    assert set(refs) == {"logits", "last_hidden_state"}
    lg = refs["logits"]
    assert lg.uri == f"{prefix_uri}/batch_x/3.safetensors" and lg.key == "logits"
    assert (lg.dtype, lg.shape, lg.nbytes) == ("float32", [3, 7], 3 * 7 * 4)
    hs = refs["last_hidden_state"]
    assert hs.uri == lg.uri  # one file per request
    assert (hs.dtype, hs.shape, hs.nbytes) == ("float16", [3, 4], 3 * 4 * 2)
    for name, ref in refs.items():
        got = read_tensor(ref)
        assert got.dtype == t[name].dtype and got.shape == t[name].shape
        assert np.array_equal(got, t[name])


@pytest.mark.parametrize("scheme", ["path", "file"])
def test_local_folder_roundtrip(tmp_path: Path, scheme: str) -> None:
    url = str(tmp_path / "blobs") if scheme == "path" else f"file://{tmp_path}/blobs"
    _check_roundtrip(BlobStore.from_url(url), url)
    assert (tmp_path / "blobs" / "batch_x" / "3.safetensors").is_file()
    assert not [p for p in (tmp_path / "blobs" / "batch_x").iterdir() if ".tmp-" in p.name]


def test_s3_roundtrip(s3: dict[str, str]) -> None:
    import boto3

    url = f"s3://{BUCKET}/tensors"
    _check_roundtrip(BlobStore.from_url(url), url)
    c = boto3.client("s3", endpoint_url=s3["LMDQ_S3_ENDPOINT_URL"], region_name="us-east-1")
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=BUCKET, Prefix="tensors/")["Contents"]]
    assert keys == ["tensors/batch_x/3.safetensors"]


def test_torch_bf16_becomes_float32(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    refs = BlobStore.from_url(str(tmp_path)).put_tensors("b/0", {"h": torch.ones(2, 3, dtype=torch.bfloat16)})
    assert (refs["h"].dtype, refs["h"].shape, refs["h"].nbytes) == ("float32", [2, 3], 24)
    assert np.array_equal(read_tensor(refs["h"]), np.ones((2, 3), np.float32))


def test_size_cap_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMDQ_MAX_TENSOR_BYTES", "100")
    with pytest.raises(TensorTooLarge, match=r"LMDQ_MAX_TENSOR_BYTES=100.*") as e:
        BlobStore.from_url(str(tmp_path)).put_tensors("b/0", _tensors())
    assert "logits=[3, 7] float32" in str(e.value)
    assert not (tmp_path / "b").exists()  # nothing written


# ---- the worker's side: a SIMULATED engine that returns logprobs and tensors ----------------------


class SimulatedTensorEngine:
    """Test-only engine: 3 tokens per request, logprobs always, tensors when the request asks for them."""

    name = backend = "sim-tensors"
    model_name = "simt"
    capacity = 8

    def stream(self, requests: Sequence[Any], abort: threading.Event) -> Iterator[Any]:
        from lmdq.worker.engines.base import EngineEvent

        for r in requests:
            yield EngineEvent(index=r.index, text="a b", input_token_len=2, generate_token_len=2)
        for r in requests:
            p = r.params
            tensors = None
            if p.output_logits or p.output_last_hidden_state:
                tensors = {"logits": np.full((3, 5), float(r.index), dtype=np.float32)}
            lps = [(10 + k, -0.5 * k, [(10 + k, -0.5 * k), (99, -3.0)]) for k in range(3)]
            yield EngineEvent(index=r.index, text=" c", input_token_len=2, generate_token_len=3,
                              finish_reason="stop", logprobs=lps, tensors=tensors)

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        pass


def _enqueue(client: redis.Redis, prefix: str, rows: list[dict[str, Any]], **batch_kw: Any) -> str:
    from lmdq.testing import enqueue_requests

    return enqueue_requests(client, Keys(prefix), "simt", [{"prompt": "x", **r} for r in rows], batch_size=2,
                            **batch_kw)


def _run_worker(client: redis.Redis, redis_url: str, prefix: str, **settings: Any) -> None:
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, burst=True, health_port=0, **settings)
    Worker(engine=SimulatedTensorEngine(), client=client, settings=s).run()


def _results(client: redis.Redis, prefix: str, bid: str) -> list[Result]:
    store = ResultStore(client, keys=Keys(prefix))
    return [Result.model_validate_json(raw) for _, raw in store.iter_results(bid, 4, partial=False) if raw]


def test_worker_writes_tensors_and_logprobs(tmp_path: Path, client: redis.Redis, redis_url: str, prefix: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    rows: list[dict[str, Any]] = [{"params": {"output_logits": "generation"}}, {}, {"params": {"logprobs": 2}},
                                  {"params": {"output_last_hidden_state": "all"}}]
    bid = _enqueue(client, prefix, rows, blob_url=str(tmp_path / "blobs"))
    # a batch's blob_url must fall under a prefix the worker allows (issue 14: LMDQ_ALLOWED_OUTPUT_URLS)
    _run_worker(client, redis_url, prefix, allowed_output_urls=str(tmp_path))
    res = _results(client, prefix, bid)
    assert [r.status for r in res] == [ResultStatus.completed] * 4
    assert res[0].text == "a b c" and res[0].logprobs is not None
    assert [(lp.token_id, lp.logprob, lp.top) for lp in res[0].logprobs][1] == (11, -0.5, [(11, -0.5), (99, -3.0)])
    for i in (0, 3):
        ref = res[i].tensors["logits"]  # type: ignore[index]
        assert ref.uri == f"{tmp_path}/blobs/{bid}/{i}.safetensors" and ref.shape == [3, 5]
        assert np.array_equal(read_tensor(ref), np.full((3, 5), float(i % 2), np.float32))  # job-local index
    assert res[1].tensors is None and res[2].tensors is None
    # Redis holds only the reference, never the tensor bytes
    raw = client.hget(Keys(prefix).results(bid), "0")
    assert raw is not None and len(raw) < 2000

    # No blob store anywhere: the requests that asked for tensors fail, the others carry on.
    bid2 = _enqueue(client, prefix, rows)
    _run_worker(client, redis_url, prefix)
    res2 = _results(client, prefix, bid2)
    assert [r.status for r in res2] == [ResultStatus.failed, ResultStatus.completed, ResultStatus.completed,
                                        ResultStatus.failed]
    assert res2[0].error is not None and res2[0].error.code == "no_blob_store"
    assert "LMDQ_BLOB_URL" in res2[0].error.message and res2[0].tensors is None

    # The worker's own LMDQ_BLOB_URL is used when the batch names none; the size cap fails one request.
    monkeypatch.setenv("LMDQ_MAX_TENSOR_BYTES", "40")  # 3x5 float32 = 60 bytes
    bid3 = _enqueue(client, prefix, rows)
    _run_worker(client, redis_url, prefix, blob_url=str(tmp_path / "worker-blobs"))
    res3 = _results(client, prefix, bid3)
    assert res3[0].status is ResultStatus.failed and res3[0].error.code == "tensor_too_large"  # type: ignore[union-attr]
    assert res3[1].status is ResultStatus.completed
    monkeypatch.setenv("LMDQ_MAX_TENSOR_BYTES", "1000")
    bid4 = _enqueue(client, prefix, rows[:1])
    _run_worker(client, redis_url, prefix, blob_url=str(tmp_path / "worker-blobs"))
    ref = _results(client, prefix, bid4)[0].tensors["logits"]  # type: ignore[index]
    assert ref.uri.startswith(str(tmp_path / "worker-blobs"))


# ---- results sink --------------------------------------------------------------------------------


def test_flush_job_rerun_writes_every_request_exactly_once(tmp_path: Path, client: redis.Redis, prefix: str) -> None:
    """A re-run (after a worker death at any step) rewrites the same shard or leaves it alone."""
    keys = Keys(prefix)
    store = ResultStore(client, keys=keys)
    url = str(tmp_path / "sink")
    b = "batch_" + "0" * 24  # a job's batch id has the form lmdq makes (issue 14)
    store.batches.create(Batch(id=b, model="m", status=BatchStatus.queued, batch_size=3,
                             request_counts=RequestCounts(total=6), created_at=time.time(), results_url=url))
    payload = JobPayload(batch_id=b, model="m", job_no=1, results_url=url,
                         requests=[{"index": i, "custom_id": f"c{i}", "prompt": "p"} for i in (3, 4, 5)])
    for i in (3, 4):
        store.write_result(Result(batch_id=b, custom_id=f"c{i}", index=i, status=ResultStatus.completed,
                                  text=f"answer {i}", model="m"))
    assert flush_job(client, keys, payload) is None  # request 5 not final yet: nothing written
    assert not (tmp_path / "sink").exists()
    store.write_result(Result(batch_id=b, custom_id="c5", index=5, status=ResultStatus.failed, model="m",
                              error={"code": "x", "message": "y"}))
    entry = flush_job(client, keys, payload)
    shard = tmp_path / "sink" / shard_key(b, 1)
    assert entry is not None and entry.shard == "results-000001.jsonl" and shard.is_file()
    assert entry.ranges == [(3, 5)] and entry.counts == {ResultStatus.completed: 2, ResultStatus.failed: 1}
    lines = [json.loads(x) for x in shard.read_text().splitlines()]
    assert [x["index"] for x in lines] == [3, 4, 5] and lines[0]["text"] == "answer 3"
    # Redis keeps no per-request record: one index entry for the job, and the sealed bits
    assert not client.exists(keys.results(b))
    assert client.hkeys(keys.shards(b)) == [b"1"]
    assert [client.getbit(keys.sealed(b), i) for i in range(6)] == [0, 0, 0, 1, 1, 1]
    # a late/re-run flush finds the index entry: the shard is not rewritten
    before = shard.read_bytes()
    mtime = shard.stat().st_mtime_ns
    assert flush_job(client, keys, payload) == entry
    assert shard.stat().st_mtime_ns == mtime and shard.read_bytes() == before
    # a duplicate final (late worker) after the trim is refused by the sealed bit: counts unchanged
    assert not store.write_result(Result(batch_id=b, custom_id="c3", index=3, status=ResultStatus.completed,
                                         text="dup", model="m"))
    assert not client.exists(keys.results(b))
    assert store.batches.get(b).request_counts.completed == 2
    # the reader takes the job's records from its shard, in order
    from lmdq.results.export import iter_lmdq_lines

    out = [json.loads(x) for x in iter_lmdq_lines(store, store.batches.get(b))]
    assert [(x["index"], x["text"]) for x in out] == [(3, "answer 3"), (4, "answer 4"), (5, "")]
    assert all("stored_at" not in x for x in out)  # full records (the compact kind is gone with 0.1.0)


def _submit(path: Path, env: dict[str, str], *extra: str) -> str:
    p = run_cli("producer", "submit", str(path), "--model", "sim", "--allow-unknown-model", *extra, env=env)
    assert p.returncode == 0, p.stderr.decode()
    return p.stdout.decode().strip()


def _hash_bytes(client: redis.Redis, key: str) -> int:
    return int(client.memory_usage(key, samples=0) or 0)


def test_results_sink_on_s3_end_to_end(tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str,
                                       s3: dict[str, str]) -> None:
    import boto3

    env = {**env, **s3, "LMDQ_ALLOWED_OUTPUT_URLS": f"s3://{BUCKET}/sink"}  # issue 14: workers write where allowed
    n = 500
    rows = [{"custom_id": f"r{i}", "prompt": f"question number {i} about the sink"} for i in range(n)]
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    args = ("--batch-size", "50", "--max-new-tokens", "64")
    sink = f"s3://{BUCKET}/sink"
    with_sink = _submit(f, env, *args, "--results-url", sink)
    without = _submit(f, env, *args)
    w = start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "0", "--burst", env=env,
                     log=tmp_path / "worker.log")
    assert w.wait(120) == 0, (tmp_path / "worker.log").read_text()[-3000:]
    for bid in (with_sink, without):
        b = wait_batch(client, prefix, bid)
        assert b.status is BatchStatus.completed and b.request_counts.completed == n

    c = boto3.client("s3", endpoint_url=s3["LMDQ_S3_ENDPOINT_URL"], region_name="us-east-1")
    listed = c.list_objects_v2(Bucket=BUCKET, Prefix=f"sink/{with_sink}/")["Contents"]
    assert sorted(o["Key"] for o in listed) == [f"sink/{with_sink}/results-{j:06d}.jsonl" for j in range(10)]

    outs = {}
    for bid in (with_sink, without):
        p = run_cli("producer", "results", bid, env=env)
        assert p.returncode == 0, p.stderr.decode()
        outs[bid] = [Result.model_validate_json(x) for x in p.stdout.splitlines()]
    got = outs[with_sink]
    assert [r.custom_id for r in got] == [f"r{i}" for i in range(n)]
    assert all(r.text and r.generate_token_len == 64 for r in got)
    assert all(b'"stored_at"' not in x for x in p.stdout.splitlines())  # full records, never compact ones
    assert [r.text for r in got] == [r.text for r in outs[without]]
    p = run_cli("producer", "results", with_sink, "--format", "openai", env=env)
    assert p.returncode == 0 and len(p.stdout.splitlines()) == n

    keys = Keys(prefix)
    small, full = _hash_bytes(client, keys.results(with_sink)), _hash_bytes(client, keys.results(without))
    print(f"\nRedis MEMORY USAGE of the results hash, {n} requests x 64 tokens: "
          f"with --results-url {small:,} B, without {full:,} B, ratio {small / full:.2f}")
    assert small < 0.5 * full
