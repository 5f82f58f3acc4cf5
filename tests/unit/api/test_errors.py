"""lmdq.api.errors: errors in OpenAI's body shape, with the status the SDK maps to its exceptions."""

from __future__ import annotations

from lmdq.api.errors import ApiError, bad_request, conflict, error_body, not_found, unauthorized
from lmdq.contract import ErrorCode


def test_body_has_openais_four_fields() -> None:
    assert error_body("m") == {"error": {"message": "m", "type": "invalid_request_error", "param": None,
                                         "code": None}}
    e = bad_request("limit: expected 1-100", param="limit", code=ErrorCode.bad_request)
    assert (e.status, str(e)) == (400, "limit: expected 1-100")
    assert e.body() == {"error": {"message": "limit: expected 1-100", "type": "invalid_request_error",
                                  "param": "limit", "code": ErrorCode.bad_request}}


def test_statuses_the_sdk_maps() -> None:
    assert unauthorized("invalid API key").status == 401
    assert unauthorized("x").code == ErrorCode.invalid_api_key
    assert conflict("busy").status == 409
    nf = not_found("file", "file-abc")
    assert (nf.status, nf.param, nf.message) == (404, "id", "No such file: 'file-abc'")
    # the same answer for an id of another tenant: nothing in it depends on who owns the id
    assert not_found("file", "file-abc").body() == nf.body()
    assert isinstance(ApiError(500, "x"), Exception)

