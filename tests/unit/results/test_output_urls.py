"""lmdq.results.output_urls: where a worker may write, for URLs that come from untrusted jobs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lmdq.errors import SubmitRejected
from lmdq.results.output_urls import (
    MAX_URL_CHARS,
    OutputPolicy,
    OutputUrlRejected,
    Scheme,
    check_submit_urls,
    parse_output_url,
    prefixes_from_csv,
    shown_output_url,
)


def test_local_paths_resolve_dotdot_and_symlinks(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    real = os.path.realpath(tmp_path)
    assert parse_output_url(str(out / ".." / "out" / "x")).url == f"{real}/out/x"
    assert parse_output_url(f"file://{out}").url == f"{real}/out"
    assert parse_output_url(str(tmp_path / "link" / "y")).url == f"{real}/elsewhere/y"
    assert parse_output_url(str(out)).scheme is Scheme.local


def test_s3_urls_normalise_and_refuse_odd_keys() -> None:
    p = parse_output_url("s3://my-bucket/a/b/")
    assert (p.scheme, p.root, p.parts, p.url) == (Scheme.s3, "my-bucket", ("a", "b"), "s3://my-bucket/a/b")
    assert parse_output_url("s3://my-bucket").url == "s3://my-bucket"
    for bad in ["s3://my-bucket/a/../b", "s3://my-bucket/a//b", "s3://K:S@my-bucket/a", "s3://my-bucket:9000/a",
                "s3://my-bucket/a?x=1", "s3://UPPER/a", "s3://x/a"]:
        with pytest.raises(OutputUrlRejected):
            parse_output_url(bad)


@pytest.mark.parametrize("bad, why", [
    ("", "non-empty"), (None, "non-empty"), ("/a\nb", "control"), ("/a\x00", "control"),
    ("simplecache::s3://b/x", "chained"), ("gs://b/x", "not supported"), ("file://host/x", "file:///"),
    ("file:///x?y=1", "file:///"), ("/" + "a" * MAX_URL_CHARS, "over"),
])
def test_unsupported_or_malformed_urls_say_why(bad: object, why: str) -> None:
    with pytest.raises(OutputUrlRejected, match=why):
        parse_output_url(bad)


def test_policy_matches_whole_segments_only(tmp_path: Path) -> None:
    allowed = tmp_path / "data" / "out"
    policy = OutputPolicy.for_worker(f"s3://my-bucket/results, {allowed}", None)
    assert policy.check(str(allowed / "batch")) == os.path.realpath(allowed / "batch")
    assert policy.check(str(allowed)) == os.path.realpath(allowed)
    assert policy.check("s3://my-bucket/results/x") == "s3://my-bucket/results/x"
    for outside in [str(tmp_path / "data" / "out-evil"), str(allowed / ".." / ".." / "x"),
                    "s3://my-bucket/results-evil", "s3://other-bucket/results"]:
        with pytest.raises(OutputUrlRejected, match="outside"):
            policy.check(outside)


def test_a_symlink_out_of_the_allowed_folder_is_refused(tmp_path: Path) -> None:
    allowed = tmp_path / "out"
    allowed.mkdir()
    (allowed / "escape").symlink_to(tmp_path / "secret")
    with pytest.raises(OutputUrlRejected):
        OutputPolicy([str(allowed)]).check(str(allowed / "escape" / "x"))


def test_no_prefix_allows_nothing_and_the_worker_urls_count() -> None:
    with pytest.raises(OutputUrlRejected, match="none configured"):
        OutputPolicy([None, ""]).check("/tmp/x")
    own = OutputPolicy.for_worker("", "s3://blob-bucket/b", "s3://res-bucket/r")
    assert own.check("s3://res-bucket/r/1") == "s3://res-bucket/r/1"
    assert own.check("s3://blob-bucket/b/1") == "s3://blob-bucket/b/1"


def test_prefixes_from_csv_checks_each_now() -> None:
    assert prefixes_from_csv(" s3://my-bucket/a , ,/tmp ") == ("s3://my-bucket/a", "/tmp")
    with pytest.raises(ValueError, match="LMDQ_ALLOWED_OUTPUT_URLS"):
        prefixes_from_csv("/tmp,gs://x/y")


def test_submit_refuses_credentials_without_printing_them() -> None:
    check_submit_urls("s3://my-bucket/a", "/data/we@ird")  # '@' in a plain path is just a character
    check_submit_urls(None, None)
    for flag, args in [("--results-url", ("s3://AKIA:S3cret@my-bucket/a", None)),
                       ("--blob-url", (None, "s3://my-bucket/a?X-Amz-Signature=S3cret")),
                       ("--results-url", ("https://h/x#S3cret", None))]:
        with pytest.raises(SubmitRejected, match=flag) as e:
            check_submit_urls(*args)
        assert "S3cret" not in str(e.value)


def test_shown_output_url() -> None:
    assert shown_output_url(None) is None
    assert shown_output_url("/data/x") == "/data/x"
    assert shown_output_url("s3://my-bucket/a") == "s3://my-bucket/a"
    assert "S3cret" not in (shown_output_url("s3://K:S3cret@my-bucket/a") or "")
