"""lmdq.errors: exit codes never change meaning; each error class exits with its documented code."""

from __future__ import annotations

import pytest

from lmdq import errors
from lmdq.errors import EXIT_CODES_HELP, ExitCode


def test_exit_code_values_are_stable() -> None:
    assert {c.name: int(c) for c in ExitCode} == {"ok": 0, "failed": 1, "bad_input": 2, "redis_unavailable": 3,
                                                 "results_unavailable": 4, "redis_refused": 5}


def test_help_epilog_names_every_nonzero_code() -> None:
    for c in ExitCode:
        if c:
            assert f"{int(c)} " in EXIT_CODES_HELP


@pytest.mark.parametrize("cls, code", [
    (errors.LmdqError, 1), (errors.UnknownModel, 2), (errors.SubmitRejected, 2), (errors.IdempotencyConflict, 2),
    (errors.RetryRejected, 1), (errors.PurgeRefused, 2), (errors.RedisUnavailable, 3),
    (errors.ResultsUnavailable, 4), (errors.RedisRefused, 5), (errors.BadSetting, 2), (errors.InvalidArgument, 2),
    (errors.WaitTimeout, 1),
])
def test_each_error_exits_with_its_code(cls: type[errors.LmdqError], code: int) -> None:
    assert cls.exit_code == code
    assert issubclass(cls, errors.LmdqError)


def test_python_callers_can_catch_the_builtin_kind() -> None:
    assert issubclass(errors.BadSetting, ValueError)
    assert issubclass(errors.InvalidArgument, ValueError)
    assert issubclass(errors.WaitTimeout, TimeoutError)
    assert issubclass(errors.IdempotencyConflict, errors.SubmitRejected)


def test_batch_not_found_names_the_id_quoted_on_one_line() -> None:
    e = errors.BatchNotFound("b\nx")
    assert e.batch_id == "b\nx"
    assert "'b\\nx'" in str(e) and "\n" not in str(e)
    assert e.exit_code == ExitCode.failed


def test_all_names_exist() -> None:
    for name in errors.__all__:
        assert hasattr(errors, name)
