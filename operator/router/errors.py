"""OpenAI-style errors: one exception type, one JSON shape, one HTTP status per cause.

`{"error": {"message", "type", "param", "code"}}` is what the official clients parse; the
status picks the client's exception class (400 BadRequestError, 401, 404, 429, 5xx).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

# Trailing metadata of a worker's INVALID_ARGUMENT: the request field at fault.
PARAM_METADATA_KEY = "gearshift-param"

_GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ALREADY_EXISTS,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    501: grpc.StatusCode.UNIMPLEMENTED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
}


@dataclass
class APIError(Exception):
    """An error the API answers with; `status` is the HTTP status."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after: float | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __reduce__(self) -> tuple[Any, ...]:
        # Raised in a preparation process too (lanes.py): it crosses back by pickle.
        return (
            type(self),
            (self.status, self.message, self.type, self.param, self.code, self.retry_after),
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after)))}

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _GRPC_CODES.get(self.status, grpc.StatusCode.UNKNOWN)


# Input echoed in an error message is cut to this many characters.
ECHO_LIMIT = 100


def clip(value: object, limit: int = ECHO_LIMIT) -> str:
    """`value` as text, cut (with a note) when longer than `limit`: errors never echo a
    megabyte back."""
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def invalid_field(loc: Sequence[object], message: str) -> APIError:
    """A body field that failed validation, named by its location (`a.b.0`)."""
    param = ".".join(str(x) for x in loc) or None
    return bad_request(f"{param}: {message}" if param else message, param)


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{clip(model)}` does not exist.",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def unauthorized() -> APIError:
    return APIError(
        401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key"
    )


def overloaded(message: str, retry_after: float = 1.0) -> APIError:
    return APIError(429, message, "rate_limit_exceeded", None, "rate_limit_exceeded", retry_after)


def unavailable(message: str) -> APIError:
    return APIError(503, message, "service_unavailable", None, "service_unavailable", 1.0)


def worker_failed(message: str) -> APIError:
    return APIError(502, message, "worker_error", None, "worker_failed")


def internal(message: str) -> APIError:
    return APIError(500, message, "internal_error", None, "internal_error")


def from_worker_invalid(exc: grpc.aio.AioRpcError) -> APIError:
    """A worker's INVALID_ARGUMENT as a 400 naming the field."""
    param = None
    for key, value in exc.trailing_metadata() or ():
        if key == PARAM_METADATA_KEY:
            param = str(value)
    return bad_request(exc.details() or "invalid request", param)
