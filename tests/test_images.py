"""Image inputs end to end (issue 48), on CPU: a tiny LLaVA-style model built locally from a config with random
weights (lmdq_bench.tiny_vlm: no download), served by a real ``lmdq-worker`` on the transformers engine.

* 20 image requests (data: URLs and paths in a JSONL file, a Parquet image column of paths and bytes) complete
  through the worker with one result each; the same through the HTTP API with the official openai SDK;
* bad references are refused at submit with the line or row and the field, nothing enqueued;
* the engine's answer to an image request is the model's own (``generate`` on the processor's inputs), and
  the pixels reach it (two images, two different first-token distributions).
"""

from __future__ import annotations

import base64
import io
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import lmdq
from lmdq.errors import SubmitRejected
from lmdq.submission.settings import ProducerSettings
from lmdq_bench.api_bench import ApiProcess
from tests.conftest import run_cli, start_worker

pytestmark = pytest.mark.model
VLM = "tiny-vlm"
COLORS = [(255, 0, 0), (0, 160, 0), (0, 0, 255), (250, 250, 0), (0, 0, 0), (255, 255, 255), (128, 0, 128)]


def png(color: tuple[int, int, int], size: tuple[int, int] = (40, 30), fmt: str = "PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_line(cid: str, url: str, question: str = "What is in the picture?") -> dict[str, Any]:
    return {"custom_id": cid, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]}],
        "params": {"max_new_tokens": 6}}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers import need_default_model

    tok = need_default_model()  # the tokenizer the tiny VLM borrows (skips where the CPU extras are missing)
    pytest.importorskip("PIL")
    from lmdq_bench.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-vlm", tok)


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("images")
    for i, color in enumerate(COLORS):
        (d / f"img{i}.png").write_bytes(png(color))
    (d / "photo.jpg").write_bytes(png((10, 200, 30), (64, 48), "JPEG"))
    (d / "notes.txt").write_text("not an image\n")
    return d


def lmdq_client(redis_url: str, prefix: str, **settings: Any) -> lmdq.Client:
    return lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix, **settings))


def worker(env: dict[str, str], vlm_dir: Path) -> int:
    return start_worker("--engine", "transformers", "--model", str(vlm_dir), "--served-model-name", VLM, "--burst",
                        env=env).wait(600)


def test_twenty_image_requests_through_a_real_worker(redis_url: str, prefix: str, env: dict[str, str],
                                                     vlm_dir: Path, image_dir: Path, tmp_path: Path) -> None:
    """8 data: URLs, 4 relative paths (--image-dir), 2 absolute file:// URLs in a JSONL file; a Parquet image column
    of 3 paths and 3 images' bytes: 20 requests, 20 completed results, each one's prompt holding its image tokens."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    lines = [image_line(f"data-{i}", data_url(png(COLORS[i % len(COLORS)]))) for i in range(7)]
    lines.append(image_line("data-jpeg", data_url((image_dir / "photo.jpg").read_bytes(), "image/jpeg")))
    lines += [image_line(f"rel-{i}", f"img{i}.png") for i in range(4)]
    lines += [image_line(f"abs-{i}", (image_dir / f"img{i + 4}.png").as_uri()) for i in range(2)]
    jsonl = tmp_path / "images.jsonl"
    jsonl.write_text("".join(json.dumps(x) + "\n" for x in lines))
    # two Parquet files with an image column: one of paths (strings, relative to --image-dir), one of bytes
    paths = tmp_path / "paths.parquet"
    pq.write_table(pa.table({"id": ["pq-path-0", "pq-path-1", "pq-path-2"],
                             "question": ["Describe it.", "What colour?", "Caption:"],
                             "image": ["img1.png", "img2.png", "photo.jpg"]}), paths)
    blobs = tmp_path / "bytes.parquet"
    pq.write_table(pa.table({"id": ["pq-bytes-0", "pq-bytes-1", "pq-bytes-2"],
                             "question": ["Describe it.", "What colour?", "Say"],
                             "image": pa.array([png((1, 2, 3)), png((90, 90, 90)),
                                                (image_dir / "img6.png").read_bytes()], pa.binary())}), blobs)
    c = lmdq_client(redis_url, prefix)
    common: dict[str, Any] = {"model": VLM, "allow_unknown_model": True, "max_new_tokens": 6}
    b1 = c.submit(jsonl, image_dir=image_dir, **common)
    columns: dict[str, Any] = {"prompt_column": "question", "id_column": "id", "image_column": "image"}
    b2 = c.submit(paths, image_dir=image_dir, **columns, **common)
    b3 = c.submit(blobs, **columns, **common)
    assert worker(env, vlm_dir) == 0
    got: dict[str, Any] = {}
    for b in (b1, b2, b3):
        info = b.wait(timeout=300, progress=False)
        assert info.status.value == "completed", info
        for res in b.results():
            assert res.custom_id not in got
            got[res.custom_id] = res
    assert len(got) == 20
    for cid, res in got.items():
        assert res.status.value == "completed", (cid, res.error)
        assert res.generate_token_len == 6 and res.text is not None, cid
    # the prompt holds the image's tokens: 5 for the tiny CLIP (4 patches + CLS) in place of one <image>
    assert got["data-0"].input_token_len == got["rel-0"].input_token_len == got["abs-0"].input_token_len
    assert got["data-0"].model == VLM


def test_the_engine_answers_as_the_model_does_and_sees_the_pixels(vlm_dir: Path) -> None:
    """The transformers engine's greedy answer to an image request equals the model's own ``generate`` on the
    processor's inputs; and two different images give two different first-token distributions."""
    import threading

    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from lmdq.contract import GenerationParams
    from lmdq.worker.engines.base import EngineRequest
    from lmdq.worker.engines.transformers_engine import TransformersEngine

    eng = TransformersEngine(model_path=vlm_dir, served_model_name=VLM)
    try:
        params = GenerationParams(max_new_tokens=8, ignore_eos=True, logprobs=3)
        reqs = [EngineRequest(index=i, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(png(color))}},
            {"type": "text", "text": "What is it?"}]}], params=params) for i, color in enumerate(COLORS[:2])]
        finals = {ev.index: ev for ev in eng.stream(reqs, threading.Event()) if ev.finish_reason is not None}
        texts: dict[int, str] = {}
        for ev in eng.stream(reqs, threading.Event()):
            texts[ev.index] = texts.get(ev.index, "") + ev.text
    finally:
        eng.close()
    proc = AutoProcessor.from_pretrained(vlm_dir, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, local_files_only=True).eval()
    prompt = proc.tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is it?"}]}], tokenize=False, add_generation_prompt=True)
    for i, color in enumerate(COLORS[:2]):
        enc = proc(text=[prompt], images=[Image.new("RGB", (40, 30), color)], return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        want = proc.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        assert finals[i].finish_reason.value == "length" and finals[i].input_token_len == enc["input_ids"].shape[1]
        assert texts[i] == want
    first = [finals[i].logprobs[0][2] for i in (0, 1)]  # the top-3 (id, logprob) of the first token
    assert first[0] != first[1]


def test_a_text_model_refuses_an_image_request_alone(tf_engine: Any) -> None:
    """The embedded text model: an image request fails unsupported_feature; its neighbour answers."""
    import threading

    from lmdq.contract import GenerationParams
    from lmdq.worker.engines.base import EngineRequest

    p = GenerationParams(max_new_tokens=2)
    reqs = [EngineRequest(index=0, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png((1, 1, 1)))}}]}], params=p),
        EngineRequest(index=1, prompt="Hi", params=p)]
    finals = {ev.index: ev for ev in tf_engine.stream(reqs, threading.Event()) if ev.finish_reason is not None}
    assert finals[0].error_code == "unsupported_feature" and "vision-language" in (finals[0].error_message or "")
    assert finals[1].finish_reason.value == "length"


# ------------------------------------------------------------------ refused at submit


def test_bad_references_are_refused_with_line_and_field_and_nothing_is_enqueued(
        redis_url: str, prefix: str, image_dir: Path, tmp_path: Path) -> None:
    big = tmp_path / "big.png"
    big.write_bytes(png((5, 5, 5), (400, 400)) + b"\0" * 4096)
    lines = [
        image_line("ok", "img0.png"),
        image_line("missing", "nope.png"),
        image_line("text", "notes.txt"),
        image_line("bad-b64", "data:image/png;base64,@@@"),
        image_line("not-image", data_url(b"hello world, no image here", "image/png")),
        image_line("big", str(big)),
        image_line("scheme", "ftp://host/x.png"),
        {"custom_id": "shape",
         "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x.png"}]}]},
    ]
    f = tmp_path / "bad.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    c = lmdq_client(redis_url, prefix, max_image_bytes=4096)
    with pytest.raises(SubmitRejected) as e:
        c.submit(f, model=VLM, allow_unknown_model=True, image_dir=image_dir)
    msg = str(e.value)
    field = "field 'messages[0].content[0].image_url.url'"
    assert f"{f}:2: {field}: no such image file: {image_dir / 'nope.png'}" in msg
    assert f"{f}:3: {field}: {image_dir / 'notes.txt'} is not an image lmdq knows" in msg
    assert f"{f}:4: {field}: the data: URL's payload is not valid base64" in msg
    assert f"{f}:5: {field}: the data: URL does not hold an image lmdq knows" in msg
    assert f"{f}:6: {field}: image {big} is " in msg and "over the limit of 4,096 (LMDQ_MAX_IMAGE_BYTES)" in msg
    assert f"{f}:7: {field}: unsupported URL scheme 'ftp'" in msg
    assert f"{f}:8: field 'messages[0].content[0].image_url': expected an object {{'url': '...'}}" in msg
    assert f"{f}:1:" not in msg
    # without --image-dir a relative path says what to do
    good = tmp_path / "rel.jsonl"
    good.write_text(json.dumps(image_line("rel", "img0.png")) + "\n")
    with pytest.raises(SubmitRejected, match=r"rel.jsonl:1: field 'messages\[0\]\.content\[0\]\.image_url\.url': "
                                             r"relative image path 'img0.png': name the folder"):
        c.submit(good, model=VLM, allow_unknown_model=True)
    # a Parquet-like source: the row and the image column
    rows = [{"q": "x", "img": "img0.png"}, {"q": "y", "img": "img1.png"}, {"q": "z", "img": "gone.png"},
            {"q": "w", "img": b"not an image"}]
    with pytest.raises(SubmitRejected) as e:
        c.submit(rows, model=VLM, allow_unknown_model=True, prompt_column="q", image_column="img",
                 image_dir=image_dir)
    assert f"rows: row 2 (0-based): column 'img': no such image file: {image_dir / 'gone.png'}" in str(e.value)
    assert "rows: row 3 (0-based): column 'img': the bytes are not an image lmdq knows" in str(e.value)
    assert [(p.row, p.column) for p in e.value.problems] == [(2, "img"), (3, "img")]
    r = redis.Redis.from_url(redis_url)
    assert not list(r.scan_iter(f"{prefix}:*")), "a refused submit left keys behind"


def test_the_cli_refuses_a_bad_image_in_one_line_exit_2(env: dict[str, str], image_dir: Path, tmp_path: Path,
                                                       redis_url: str, prefix: str) -> None:
    f = tmp_path / "in.jsonl"
    f.write_text(json.dumps(image_line("a", "img0.png")) + "\n" + json.dumps(image_line("b", "nope.png")) + "\n")
    p = run_cli("lmdq.producer", "submit", str(f), "--model", VLM, "--allow-unknown-model", "--image-dir",
                str(image_dir), env=env)
    assert p.returncode == 2, p.stderr
    err = p.stderr.decode()
    assert f"{f}:2: field 'messages[0].content[0].image_url.url': no such image file" in err
    assert not list(redis.Redis.from_url(redis_url).scan_iter(f"{prefix}:*"))
    ok = run_cli("lmdq.producer", "submit", str(f.with_name("ok.jsonl")), "--model", VLM, env=env)
    assert ok.returncode == 2  # (no such file: the same one-line refusal path)
    f.with_name("one.jsonl").write_text(json.dumps(image_line("a", "img0.png")) + "\n")
    p = run_cli("lmdq.producer", "submit", str(f.with_name("one.jsonl")), "--model", VLM, "--allow-unknown-model",
                "--image-dir", str(image_dir), "--json", env=env)
    assert p.returncode == 0, p.stderr
    batch_id = json.loads(p.stdout)["id"]
    r = redis.Redis.from_url(redis_url)
    from lmdq.jobs.data import read_job

    (job,) = [k.decode().removeprefix("rq:job:") for k in r.scan_iter(f"rq:job:{batch_id}-*")]
    payload = read_job(r, job).args[0]
    url = payload["requests"][0]["messages"][0]["content"][0]["image_url"]["url"]
    assert url == (image_dir / "img0.png").as_uri()  # the job carries the absolute reference, not the pixels


# ------------------------------------------------------------------ the HTTP API, through the openai SDK

KEYS = {"alice": f"alice-{uuid.uuid4().hex}"}


@pytest.fixture()
def api(redis_url: str, prefix: str, image_dir: Path, tmp_path: Path) -> Iterator[ApiProcess]:
    srv = ApiProcess(redis_url=redis_url, prefix=prefix, keys=KEYS, files_dir=tmp_path / "files",
                     log=tmp_path / "api.log", env={"LMDQ_KNOWN_MODELS": f'["{VLM}"]',
                                                    "LMDQ_API_IMAGE_ROOT": str(image_dir)}).start()
    try:
        yield srv
    finally:
        srv.stop()


def openai_line(cid: str, url: str) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": VLM, "max_tokens": 5, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "Describe:"}, {"type": "image_url", "image_url": {"url": url}}]}]}}


def test_twenty_image_requests_through_the_http_api_with_the_openai_sdk(
        api: ApiProcess, env: dict[str, str], vlm_dir: Path, image_dir: Path) -> None:
    from openai import OpenAI
    from openai.types.chat import ChatCompletion

    c = OpenAI(base_url=api.url + "/v1", api_key=KEYS["alice"])
    lines = [openai_line(f"d{i}", data_url(png(COLORS[i % len(COLORS)]))) for i in range(10)]
    lines += [openai_line(f"p{i}", f"img{i % 7}.png") for i in range(8)]  # relative to LMDQ_API_IMAGE_ROOT
    lines += [openai_line("abs", str(image_dir / "photo.jpg")), openai_line("uri", (image_dir / "img3.png").as_uri())]
    f = c.files.create(file=("img.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = _until(c, b.id, "in_progress", "failed")
    assert b.status == "in_progress", b.errors
    assert worker(env, vlm_dir) == 0
    b = _until(c, b.id, "completed", "failed", "expired", "cancelled")
    assert b.status == "completed" and b.request_counts is not None and b.request_counts.completed == 20
    assert b.output_file_id
    out = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(x["custom_id"] for x in lines)
    for o in out:
        answer = ChatCompletion.model_validate(o["response"]["body"])
        assert answer.model == VLM and answer.usage is not None and answer.usage.completion_tokens == 5


def test_the_api_refuses_paths_outside_its_image_root(api: ApiProcess, image_dir: Path, tmp_path: Path) -> None:
    """/etc/passwd, ../, an absolute path elsewhere, and a symlink inside the root that leads out of it: each
    refused (the batch fails with OpenAI's line-numbered errors), the messages naming no server path."""
    from openai import OpenAI

    outside = tmp_path / "secret.png"
    outside.write_bytes(png((9, 9, 9)))
    c = OpenAI(base_url=api.url + "/v1", api_key=KEYS["alice"])
    link = f"escape-{uuid.uuid4().hex[:6]}.png"
    (image_dir / link).symlink_to(outside)
    lines = [openai_line("ok", "img0.png"), openai_line("etc", "/etc/passwd"), openai_line("up", "../secret.png"),
             openai_line("abs", str(outside)), openai_line("link", link)]
    f = c.files.create(file=("bad.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
    b = _until(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id,
               "failed", "in_progress")
    assert b.status == "failed" and b.errors is not None and b.errors.data
    errs = {(e.line, e.param, e.code) for e in b.errors.data}
    field = "body.messages[0].content[1].image_url.url"
    assert {(n, field, "invalid_image") for n in (2, 3, 4, 5)} <= errs and not any(e[0] == 1 for e in errs)
    text = " ".join(e.message or "" for e in b.errors.data)
    assert "outside the server's image root" in text and str(image_dir) not in text


def _until(c: Any, batch_id: str, *statuses: str, polls: int = 3000) -> Any:
    import time

    b = c.batches.retrieve(batch_id)
    for _ in range(polls):
        if b.status in statuses:
            return b
        time.sleep(0.1)
        b = c.batches.retrieve(batch_id)
    raise AssertionError(f"batch {batch_id} still {b.status}, want {statuses}")


# ------------------------------------------------------------------ LMDeploy's VL path (a stand-in pipeline on CPU)


class _VLPipe:
    """The part of ``lmdeploy.Pipeline`` the engine uses, recording what ``stream_infer`` was given; with
    ``vision`` its async engine has the image encoder LMDeploy's VLAsyncEngine has (``vl_encoder``)."""

    def __init__(self, vision: bool) -> None:
        from lmdeploy.messages import PytorchEngineConfig

        self.backend_config = PytorchEngineConfig(max_batch_size=8)
        self.async_engine = type("VLAsyncEngine" if vision else "AsyncEngine", (), {})()
        if vision:
            self.async_engine.vl_encoder = object()  # type: ignore[attr-defined]
        self.prompts: list[Any] = []

    def session(self) -> Any:
        return type("S", (), {"abort": lambda self: None, "close": lambda self: None})()

    def stream_infer(self, prompts: list[Any], **_: Any) -> Iterator[Any]:
        from lmdeploy.messages import Response

        self.prompts.extend(prompts)
        for i, _p in enumerate(prompts):
            yield Response(text="a cat", generate_token_len=2, input_token_len=9, finish_reason="stop", index=i)


def test_lmdeploy_hands_image_messages_to_its_vl_path_and_a_text_pipeline_refuses_them() -> None:
    pytest.importorskip("lmdeploy")
    import threading

    from lmdq.contract import Endpoint, GenerationParams
    from lmdq.worker.engine_config import LMDeployConfig
    from lmdq.worker.engines.base import EngineRequest
    from lmdq.worker.engines.lmdeploy_engine import LMDeployEngine

    url = data_url(png((3, 4, 5)))
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is it?"}]}]
    p = GenerationParams(max_new_tokens=4)
    reqs = [EngineRequest(index=0, messages=msgs, params=p), EngineRequest(index=1, prompt="hi", params=p),
            EngineRequest(index=2, messages=msgs, endpoint=Endpoint.score, continuations=("a cat",), params=p)]
    vl = _VLPipe(vision=True)
    eng = LMDeployEngine(vl, LMDeployConfig(backend="pytorch"), model_name="vl", emit_interval_s=0.0)
    assert eng.vision
    finals = {e.index: e for e in eng.stream(reqs, threading.Event()) if e.finish_reason is not None}
    assert finals[0].finish_reason.value == "stop" and finals[0].text == "a cat"
    assert vl.prompts[0] == msgs  # the OpenAI messages with the image's data: URL, as LMDeploy's VL path takes them
    assert finals[2].error_code == "unsupported_feature" and "scores text only" in (finals[2].error_message or "")
    text = _VLPipe(vision=False)
    eng = LMDeployEngine(text, LMDeployConfig(backend="pytorch"), model_name="llm", emit_interval_s=0.0)
    finals = {e.index: e for e in eng.stream(reqs[:2], threading.Event()) if e.finish_reason is not None}
    assert finals[0].error_code == "unsupported_feature" and "vision-language" in (finals[0].error_message or "")
    assert finals[1].finish_reason.value == "stop" and all(p != msgs for p in text.prompts)


def test_prefix_groups_keep_the_requests_over_one_image_together(redis_url: str, prefix: str, image_dir: Path,
                                                                 tmp_path: Path) -> None:
    """3 images x 4 questions, shuffled: with prefix grouping each job of 4 holds one image's 4 questions (the
    image counts as a long prefix, lmdq.submission.prefix_groups.IMAGE_PREFIX_BYTES); different images with the
    same question never group."""
    import random

    from lmdq.jobs.data import read_job

    urls = [data_url(png(COLORS[0])), "img1.png", (image_dir / "img2.png").as_uri()]
    lines = [image_line(f"{i}-{q}", url, question) for i, url in enumerate(urls)
             for q, question in enumerate(["What is it?", "What colour is it?", "Describe it.", "Count things."])]
    random.Random(7).shuffle(lines)
    f = tmp_path / "grouped.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    b = lmdq_client(redis_url, prefix).submit(f, model=VLM, allow_unknown_model=True, image_dir=image_dir,
                                             batch_size=4)
    assert b.info().prefix_groups
    r = redis.Redis.from_url(redis_url)
    jobs = [read_job(r, k.decode().removeprefix("rq:job:")).args[0] for k in r.scan_iter(f"rq:job:{b.id}-*")]
    assert len(jobs) == 3
    for job in jobs:
        assert len({req["custom_id"].split("-")[0] for req in job["requests"]}) == 1, job["requests"]


def test_the_sim_engine_takes_images_and_an_image_gone_by_run_time_fails_alone(
        redis_url: str, prefix: str, env: dict[str, str], tmp_path: Path) -> None:
    """Load tests run on the sim engine: each image counts SIM_IMAGE_TOKENS prompt tokens. An image deleted
    between submit and the worker's read fails its own request (invalid_image, naming it); the rest complete."""
    from lmdq.worker.engines.sim import SIM_IMAGE_TOKENS

    d = tmp_path / "imgs"
    d.mkdir()
    for i in range(3):
        (d / f"{i}.png").write_bytes(png(COLORS[i]))
    lines = [image_line(f"p{i}", f"{i}.png", "Q") for i in range(3)] + [image_line("d", data_url(png((7, 7, 7))), "Q")]
    lines.append({"custom_id": "text", "messages": [{"role": "user", "content": "Q"}]})
    f = tmp_path / "sim.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    b = lmdq_client(redis_url, prefix).submit(f, model="sim", allow_unknown_model=True, image_dir=d,
                                             max_new_tokens=3, prefix_groups=False)
    (d / "1.png").unlink()
    assert start_worker("--engine", "sim", "--served-model-name", "sim", "--sim-step-ms", "1", "--burst",
                        env=env).wait(120) == 0
    b.wait(timeout=60, progress=False)
    got = {res.custom_id: res for res in b.results()}
    assert got["p1"].status.value == "failed" and got["p1"].error is not None
    assert got["p1"].error.code == "invalid_image" and "1.png" in got["p1"].error.message
    for cid in ("p0", "p2", "d"):
        assert got[cid].status.value == "completed"
        assert got[cid].input_token_len == got["text"].input_token_len + SIM_IMAGE_TOKENS


def test_the_image_bench_workload_runs_end_to_end_on_the_sim(tmp_path: Path, env: dict[str, str]) -> None:
    """``lmdq-bench e2e --workload image``: the orchestration the GPU run (tests/gpu/test_images_gpu.py) relies on,
    on the sim: 24 image requests, each answered on both sides, the worker reading every image file."""
    p = run_cli("lmdq_bench", "e2e", "--engine", "sim", "--sim-step-ms", "1", "--workload", "image", "--n", "24",
                "--batches", "1", "--batch-size", "8", "--chat-max-new-tokens", "4", "--workdir", str(tmp_path / "w"),
                "-o", str(tmp_path / "e2e.json"), env=env, timeout=600)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    d = json.loads((tmp_path / "e2e.json").read_text())["detail"]
    assert d["workload"] == "image" and d["max_new_tokens_sum"] == 24 * 4
    assert d["lmdq"]["batches"][0]["results"] == 24 and d["lmdq"]["batches"][0]["not_completed"] == 0
    assert d["raw"]["batches"][0]["tokens"] == d["lmdq"]["batches"][0]["tokens"] == 24 * 4
    lines = [json.loads(x) for x in (tmp_path / "w" / "workload.jsonl").read_text().splitlines()]
    urls = [x["messages"][0]["content"][0]["image_url"]["url"] for x in lines]
    assert len(set(urls)) == 24 and all(Path(u).is_file() and u.endswith(".jpg") for u in urls)


def test_a_llava_pipeline_gets_the_pil_image_processor_that_reads_channels_last(vlm_dir: Path) -> None:
    """LMDeploy's llava_hf preprocess calls ``processor(pil_image, input_data_format='channels_last')``;
    transformers' torchvision processors misread that (every image request failed on an H200), the PIL one
    reads it: the worker swaps it in for LMDeploy's LLaVA vision models only."""
    import types

    from PIL import Image

    from lmdq.worker.engines.lmdeploy_engine import pil_image_processor

    def pipe_with(model: object) -> Any:
        return types.SimpleNamespace(async_engine=types.SimpleNamespace(vl_encoder=types.SimpleNamespace(model=model)))

    llava = type("LlavaHfVisionModel", (), {})()
    llava.processor = None  # type: ignore[attr-defined]
    assert not pil_image_processor(pipe_with(llava), str(vlm_dir))  # nothing to replace
    llava.processor = object()  # type: ignore[attr-defined]
    assert pil_image_processor(pipe_with(llava), str(vlm_dir))
    pv = llava.processor(Image.new("RGB", (50, 30), (255, 0, 0)), return_tensors="pt",  # type: ignore[attr-defined]
                         input_data_format="channels_last").pixel_values
    assert tuple(pv.shape) == (1, 3, 28, 28)  # the tiny model's image size, channels first
    assert float(pv[0, 0].mean()) > float(pv[0, 2].mean())  # red stays in the red channel
    other = type("Qwen2VLModel", (), {})()
    other.processor = sentinel = object()  # type: ignore[attr-defined]
    assert not pil_image_processor(pipe_with(other), str(vlm_dir)) and other.processor is sentinel  # type: ignore[attr-defined]
    assert not pil_image_processor(types.SimpleNamespace(), str(vlm_dir))  # a text pipeline: no vision encoder
