"""lmdq.images.refs: what submit accepts as an image reference, checked without reading the pixels."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from lmdq.images.refs import ImageChecker, ImageRefError, data_url, decode_data_url, local_path, ref_kind, sniff

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 40
JPEG = b"\xff\xd8\xff\xe0" + b"\0" * 40


@pytest.mark.parametrize(("head", "mime"), [
    (PNG, "image/png"), (JPEG, "image/jpeg"), (b"GIF89a....", "image/gif"), (b"GIF87a....", "image/gif"),
    (b"RIFF\0\0\0\0WEBPVP8 ", "image/webp"), (b"BM\0\0\0\0", "image/bmp"), (b"II*\0....", "image/tiff"),
    (b"MM\0*....", "image/tiff"), (b"%PDF-1.7", None), (b"", None), (b"RIFF\0\0\0\0WAVE", None),
])
def test_sniff_by_magic_bytes(head: bytes, mime: str | None) -> None:
    assert sniff(head) == mime


@pytest.mark.parametrize(("url", "kind"), [
    ("data:image/png;base64,AAAA", "data"), ("DATA:image/png;base64,AA", "data"), ("file:///x.png", "file"),
    ("s3://b/k.png", "s3"), ("https://h/x.png", "http"), ("http://h/x", "http"), ("x.png", "path"),
    ("/abs/x.png", "path"), ("ftp://h/x", "unknown"), ("gs://b/k", "unknown"),
])
def test_ref_kind(url: str, kind: str) -> None:
    assert ref_kind(url) == kind


def test_data_urls_round_trip_and_are_bounded() -> None:
    url = data_url(PNG)
    assert url.startswith("data:image/png;base64,")
    assert decode_data_url(url, 1000) == ("image/png", PNG)
    with pytest.raises(ImageRefError, match="over the limit of 10"):
        decode_data_url(url, 10)
    with pytest.raises(ImageRefError, match="base64 data: URL"):
        decode_data_url("data:image/png,rawtext", 1000)
    with pytest.raises(ImageRefError, match="not valid base64"):
        decode_data_url("data:image/png;base64,!!!!", 1000)
    huge = "data:image/png;base64," + "A" * 4000  # refused on the text's length: never decoded
    with pytest.raises(ImageRefError, match="about 3,000 bytes"):
        decode_data_url(huge, 100)


def test_data_url_must_hold_an_image() -> None:
    c = ImageChecker()
    assert c.check(data_url(PNG)) == data_url(PNG)
    with pytest.raises(ImageRefError, match="does not hold an image lmdq knows.*it says image/png"):
        c.check("data:image/png;base64," + base64.b64encode(b"hello").decode())


def test_local_paths_relative_absolute_and_file_urls(tmp_path: Path) -> None:
    (tmp_path / "a b.png").write_bytes(PNG)
    c = ImageChecker(image_dir=str(tmp_path))
    want = (tmp_path / "a b.png").as_uri()
    assert c.check("a b.png") == want
    assert c.check(str(tmp_path / "a b.png")) == want
    assert c.check(want) == want  # percent-escapes decoded
    assert c.normalize("a b.png") == want and c.normalize("s3://b/k") == "s3://b/k"
    assert local_path(want) == str(tmp_path / "a b.png")
    with pytest.raises(ImageRefError, match="relative image path 'a b.png': name the folder"):
        ImageChecker().check("a b.png")
    with pytest.raises(ImageRefError, match="expected a local file URL"):
        c.check("file://otherhost/x.png")


def test_local_paths_missing_not_a_file_too_large_not_an_image(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("text")
    (tmp_path / "big.png").write_bytes(PNG + b"\0" * 2000)
    (tmp_path / "d").mkdir()
    c = ImageChecker(image_dir=str(tmp_path), max_bytes=1024)
    with pytest.raises(ImageRefError, match="no such image file: .*nope.png"):
        c.check("nope.png")
    with pytest.raises(ImageRefError, match="not a regular file"):
        c.check("d")
    with pytest.raises(ImageRefError, match="2,048 bytes, over the limit of 1,024"):
        c.check("big.png")
    with pytest.raises(ImageRefError, match="t.txt is not an image lmdq knows"):
        c.check("t.txt")
    with pytest.raises(ImageRefError, match="NUL"):
        c.check("a\0b.png")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "x.png"
    f.write_bytes(PNG)
    f.chmod(0)
    with pytest.raises(ImageRefError, match="cannot read image file"):
        ImageChecker().check(str(f))


def test_a_root_confines_local_paths_and_hides_server_paths(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "ok.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    c = ImageChecker(root=str(root))
    assert c.check("sub/ok.png") == (root / "sub" / "ok.png").as_uri()
    assert c.check(str(root / "sub" / "ok.png")) == (root / "sub" / "ok.png").as_uri()
    for bad in ("../secret.png", str(tmp_path / "secret.png"), "link.png", "/etc/passwd", "sub/../../secret.png",
                (tmp_path / "secret.png").as_uri()):
        with pytest.raises(ImageRefError, match="outside the server's image root") as e:
            c.check(bad)
        assert str(tmp_path) not in str(e.value).replace(local_path(bad), "")  # only the path as written
    with pytest.raises(ImageRefError, match="no such image file: sub/gone.png$"):
        c.check("sub/gone.png")  # named as written, not as the server's path
    with pytest.raises(ImageRefError, match="local image paths are not allowed here"):
        ImageChecker(allow_local=False).check("x.png")


def test_http_is_checked_for_syntax_only_and_other_schemes_are_refused() -> None:
    c = ImageChecker()
    assert c.check("https://example.invalid/cat.png") == "https://example.invalid/cat.png"
    with pytest.raises(ImageRefError, match="with a host"):
        c.check("http:///cat.png")
    with pytest.raises(ImageRefError, match="unsupported URL scheme 'ftp'"):
        c.check("ftp://h/x.png")
    assert ImageChecker(check_remote=False).check("s3://bucket/x.png") == "s3://bucket/x.png"
