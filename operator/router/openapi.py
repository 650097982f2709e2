"""The served OpenAPI schema says what the server really answers: 400 (not FastAPI's 422) for a
bad body, the OpenAI error shape for every error status, SSE as well as JSON for generation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gearshift.operator.router.protocol import ErrorResponse

_ERROR = {"model": ErrorResponse}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {**_ERROR, "description": "The request is malformed; `param` names the field."},
    401: {**_ERROR, "description": "Missing or wrong API key."},
    404: {**_ERROR, "description": "Unknown model."},
}
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    200: {
        "description": "The completion; with `stream: true`, server-sent events.",
        "content": {"application/json": {}, "text/event-stream": {"schema": {"type": "string"}}},
    },
    409: {**_ERROR, "description": "A request with this request_id is already running."},
    429: {**_ERROR, "description": "Every worker group is full; retry after Retry-After."},
    499: {"description": "The client disconnected before the answer."},
    502: {**_ERROR, "description": "The worker group failed."},
    503: {**_ERROR, "description": "No worker group can serve, or the server is draining."},
}


def openapi_400(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """`app.openapi` without FastAPI's 422 (the validation handler answers 400)."""

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in spec.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            components = spec.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = spec
        return app.openapi_schema

    return schema
