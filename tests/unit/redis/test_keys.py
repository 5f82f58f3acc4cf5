"""lmdq.redis.keys: the model-name rule, the injective model slug, and the key layout."""

from __future__ import annotations

import pytest

from lmdq.contract import Priority
from lmdq.errors import ExitCode
from lmdq.redis.keys import (
    BATCH_COUNT_FIELDS,
    BATCH_TIME_FIELDS,
    MAX_MODEL_NAME,
    BatchField,
    InvalidModelName,
    Keys,
    check_model_name,
    model_count_field,
    model_slug,
    queue_name,
    queue_names,
    rq_queue_key,
    rq_worker_key,
    rq_workers_by_queue_key,
    rq_workers_key,
)


@pytest.mark.parametrize("name", ["m", "Qwen/Qwen2.5-0.5B-Instruct", "a" * MAX_MODEL_NAME, "0x_1.2-3/4"])
def test_valid_names_are_returned_unchanged(name: str) -> None:
    assert check_model_name(name) == name
    assert model_slug(name) == name


@pytest.mark.parametrize("name, bad", [("a:b", "':'"), ("org/m*", "'*'"), ("a b", "' '"), ("通义", "'通'"),
                                       ("-lead", "'-'"), (".x", "'.'")])
def test_invalid_names_name_the_bad_character(name: str, bad: str) -> None:
    with pytest.raises(InvalidModelName) as e:
        check_model_name(name)
    assert bad in str(e.value) and "expected" in str(e.value)
    assert e.value.exit_code == ExitCode.bad_input


def test_empty_and_overlong_names_are_refused_with_a_one_line_reason() -> None:
    with pytest.raises(InvalidModelName, match="empty"):
        check_model_name("")
    with pytest.raises(InvalidModelName, match=f"{MAX_MODEL_NAME + 1} characters") as e:
        check_model_name("a" * (MAX_MODEL_NAME + 1))
    assert "\n" not in str(e.value) and len(str(e.value)) < 200  # the name is cut, not echoed whole


def test_model_slug_is_injective_and_key_safe_for_any_string() -> None:
    names = ["a:b", "a%3Ab", "org/model-x", "org_model-x", "通义千问", "a*", "a\nb", "", "x" * 200, "\udcff"]
    slugs = [model_slug(n) for n in names]
    assert len(set(slugs)) == len(names)
    for s in slugs:
        assert ":" not in s and "*" not in s and " " not in s and "\n" not in s
    assert model_slug("a:b") == "a%3Ab"


def test_queue_names_follow_drain_order_under_the_prefix() -> None:
    assert queue_names("m", prefix="p") == ["p:m:high", "p:m:normal", "p:m:low"]
    assert queue_name("a:b", Priority.low) == "lmdq:a%3Ab:low"
    assert queue_name("m", "high") == "lmdq:m:high"
    with pytest.raises(ValueError):
        queue_name("m", "urgent")
    assert rq_queue_key("lmdq:m:normal") == "rq:queue:lmdq:m:normal"


def test_rq_registry_keys_match_rq_spelling() -> None:
    assert rq_worker_key("w1") == "rq:worker:w1"
    assert rq_workers_key() == "rq:workers"
    assert rq_workers_by_queue_key("lmdq:m:normal") == "rq:workers:lmdq:m:normal"


def test_keys_live_under_the_prefix_and_never_collide() -> None:
    k = Keys("pfx")
    built = [k.batch("b"), k.results("b"), k.partials("b"), k.shards("b"), k.sealed("b"), k.batch_jobs("b"),
             k.batches(), k.idempotency("b"), k.cancelled(), k.leases(), k.lease_owner(), k.attempts(),
             k.runs(), k.crashes(), k.inflight("b"), k.wake("b"), k.idle("b"), k.worker("b"), k.workers(),
             k.models(), k.registered_models()]
    assert all(x.startswith("pfx:") for x in built)
    assert len(set(built)) == len(built)
    assert Keys().batch("b") == "lmdq:batch:b"
    # a model name that bypassed the rule cannot reach into another key's namespace
    assert k.wake("x:inflight:y") == "pfx:wake:x%3Ainflight%3Ay"


def test_batch_fields_print_as_their_value_and_families_are_disjoint() -> None:
    assert str(BatchField.completed) == "completed" and f"{BatchField.meta}" == "meta"
    assert not set(BATCH_COUNT_FIELDS) & set(BATCH_TIME_FIELDS)
    assert model_count_field("org/m", "failed") == "by_model:org/m:failed"
