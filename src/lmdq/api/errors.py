"""Error responses in OpenAI's shape, so the SDK raises its own typed exceptions.

OpenAI answers every error as ``{"error": {"message", "type", "param", "code"}}`` with the status
that tells the SDK which exception to raise (400 ``BadRequestError``, 401 ``AuthenticationError``,
404 ``NotFoundError``, 409 ``ConflictError``, 413, 422 ``UnprocessableEntityError``, 500/503).
"""

from __future__ import annotations

from typing import Any

from lmdq.contract import ErrorCode

__all__ = ["ApiError", "bad_request", "conflict", "error_body", "not_found", "unauthorized"]


class ApiError(Exception):
    """An error the API answers with ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: ErrorCode | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type_=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: ErrorCode | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: ErrorCode | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_found(what: str, id_: str) -> ApiError:
    """404 for an id that does not exist *or belongs to another tenant*: the same answer for both, so a
    tenant cannot probe for other tenants' ids."""
    return ApiError(404, f"No such {what}: {id_!r}", param="id", code=None)


def conflict(message: str) -> ApiError:
    return ApiError(409, message)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code=ErrorCode.invalid_api_key)
