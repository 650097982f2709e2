"""The served OpenAPI schema says what the server really answers: 400 (not FastAPI's 422) for a
bad body, the OpenAI error shape for every error status, SSE as well as JSON for generation,
and each body's schema (the routes read their bodies as bytes, so FastAPI does not see it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.encoders import jsonable_encoder
from fastapi.openapi.models import OpenAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

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


_REF = "#/components/schemas/{model}"
# The body models of the routes, whose schemas `openapi_400` adds to the components.
_BODIES: dict[str, type[BaseModel]] = {}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: a required JSON body of `model`'s schema."""
    _BODIES[model.__name__] = model
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _body_schemas() -> dict[str, Any]:
    models = [(m, "validation") for m in _BODIES.values()]
    _, top = models_json_schema(models, ref_template=_REF)  # type: ignore[arg-type]
    return dict(top.get("$defs", {}))


def openapi_400(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """`app.openapi` without FastAPI's 422 (the validation handler answers 400)."""

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in spec.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            components = spec.setdefault("components", {}).setdefault("schemas", {})
            components.update(_body_schemas())
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            # Normalised as get_openapi normalises its own (no null defaults, float bounds).
            spec = jsonable_encoder(OpenAPI(**spec), by_alias=True, exclude_none=True)
            app.openapi_schema = spec
        return app.openapi_schema

    return schema
