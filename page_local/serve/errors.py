"""The HTTP error every serve module raises: ApiError, in the OpenAI envelope, and `bad` for a 400.

The bottom of serve/: it imports nothing from serve, so that the request parsers (protocol, fields),
the slots, the guards and the routes all raise the same error without importing each other.
"""

from __future__ import annotations

from typing import ClassVar


class ApiError(Exception):
    """An HTTP error in the OpenAI envelope: {"error": {"message", "type", "code", "param"}}."""

    TYPES: ClassVar[dict[int, str]] = {400: "invalid_request_error", 401: "authentication_error",
                                       403: "permission_error", 404: "not_found_error",
                                       405: "invalid_request_error", 413: "invalid_request_error",
                                       415: "invalid_request_error", 503: "server_busy_error"}

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = self.TYPES.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    """A 400 naming the offending field (`param`)."""
    return ApiError(400, message, code, param)
