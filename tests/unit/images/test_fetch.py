"""lmdq.images.fetch (and the worker's use of it, worker/images.py): a worker reads the bytes behind a
reference: a file, a data: URL, a real HTTP server on 127.0.0.1, a real S3-compatible server (moto)."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmdq.contract import Request
from lmdq.images.fetch import ImageFetchError, describe, read_image
from lmdq.images.refs import ImageChecker, ImageRefError, data_url
from lmdq.worker.images import has_images, resolve_images
from tests.conftest import free_port
from tests.helpers import moto_s3

PNG = b"\x89PNG\r\n\x1a\n" + b"\1" * 40


@pytest.fixture(scope="module")
def http_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("www")
    (root / "cat.png").write_bytes(PNG)
    (root / "big.png").write_bytes(PNG + b"\0" * 5000)
    (root / "page.html").write_text("<html></html>")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: object, **kw: object) -> None:
            super().__init__(*a, directory=str(root), **kw)  # type: ignore[arg-type]

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_read_a_file_a_file_url_and_a_data_url(tmp_path: Path) -> None:
    f = tmp_path / "x.png"
    f.write_bytes(PNG)
    for url in (str(f), f.as_uri(), data_url(PNG)):
        img = read_image(url)
        assert img.data == PNG and img.mime == "image/png"
    assert read_image(str(f)).data_url() == data_url(PNG)


def test_read_failures_are_one_line_each(tmp_path: Path) -> None:
    (tmp_path / "t.png").write_bytes(b"not really")
    (tmp_path / "big.png").write_bytes(PNG + b"\0" * 100)
    with pytest.raises(ImageFetchError, match="no such image: .*gone.png"):
        read_image(str(tmp_path / "gone.png"))
    with pytest.raises(ImageFetchError, match="is not an image lmdq knows"):
        read_image(str(tmp_path / "t.png"))
    with pytest.raises(ImageFetchError, match="over the limit of 64 bytes"):
        read_image(str(tmp_path / "big.png"), max_bytes=64)
    with pytest.raises(ImageFetchError, match="unsupported image URL scheme"):
        read_image("ftp://h/x.png")
    with pytest.raises(ImageFetchError, match=r"data: URL \(26 characters\): .*not valid base64"):
        read_image("data:image/png;base64,!!!!")


def test_describe_never_prints_a_data_url() -> None:
    assert describe(data_url(PNG)).startswith("data: URL (")
    assert describe("s3://b/" + "k" * 400).endswith("...")


def test_http_fetch_from_a_real_server(http_root: str) -> None:
    assert read_image(f"{http_root}/cat.png").data == PNG
    with pytest.raises(ImageFetchError, match="HTTPError.*404"):
        read_image(f"{http_root}/nope.png")
    with pytest.raises(ImageFetchError, match="over the limit of 1,024"):
        read_image(f"{http_root}/big.png", max_bytes=1024)
    with pytest.raises(ImageFetchError, match="is not an image"):
        read_image(f"{http_root}/page.html")
    with pytest.raises(ImageFetchError, match="cannot read image"):
        read_image(f"http://127.0.0.1:{free_port()}/x.png", timeout_s=5)


def test_s3_checked_at_submit_and_read_by_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("s3fs")
    boto3 = pytest.importorskip("boto3")
    with moto_s3("imgs") as port:
        endpoint = f"http://127.0.0.1:{port}"
        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_DEFAULT_REGION": "us-east-1", "LMDQ_S3_ENDPOINT_URL": endpoint}.items():
            monkeypatch.setenv(k, v)
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.put_object(Bucket="imgs", Key="cat.png", Body=PNG)
        s3.put_object(Bucket="imgs", Key="doc.txt", Body=b"hello there")
        c = ImageChecker()
        assert c.check("s3://imgs/cat.png") == "s3://imgs/cat.png"
        with pytest.raises(ImageRefError, match="no such image object: s3://imgs/gone.png"):
            c.check("s3://imgs/gone.png")
        with pytest.raises(ImageRefError, match="doc.txt is not an image"):
            c.check("s3://imgs/doc.txt")
        with pytest.raises(ImageRefError, match="over the limit of 1,024"):
            s3.put_object(Bucket="imgs", Key="big.png", Body=PNG + b"\0" * 2000)
            ImageChecker(max_bytes=1024).check("s3://imgs/big.png")
        assert read_image("s3://imgs/cat.png").data == PNG
        with pytest.raises(ImageFetchError, match="over the limit"):
            read_image("s3://imgs/big.png", max_bytes=1024)


def _req(index: int, url: str | None) -> Request:
    content: object = "no image" if url is None else [
        {"type": "image_url", "image_url": {"url": url, "detail": "low"}}, {"type": "text", "text": "q"}]
    return Request.model_validate({"index": index, "custom_id": str(index),
                                   "messages": [{"role": "user", "content": content}]})


def test_the_worker_inlines_each_image_once_and_fails_only_its_request(tmp_path: Path, http_root: str) -> None:
    f = tmp_path / "x.png"
    f.write_bytes(PNG)
    todo = [_req(0, str(f)), _req(1, None), _req(2, f"{http_root}/cat.png"), _req(3, str(tmp_path / "gone.png")),
            _req(4, f.as_uri()), _req(5, data_url(PNG))]
    assert [has_images(r) for r in todo] == [True, False, True, True, True, True]
    resolved, failed = resolve_images(todo, max_bytes=1 << 20, timeout_s=10)
    assert set(resolved) == {0, 2, 4, 5} and set(failed) == {3}
    assert "no such image" in failed[3] and "gone.png" in failed[3]
    for pos in resolved:
        part = resolved[pos][0]["content"][0]
        assert part == {"type": "image_url", "image_url": {"url": data_url(PNG), "detail": "low"}}
    assert resolve_images([todo[1]], max_bytes=1 << 20, timeout_s=10) == ({}, {})
    assert os.path.exists(f)  # nothing consumed
