"""Every error of the HTTP API as the OpenAI error shape: one handler per exception kind."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from gearshift.operator.router import errors
from gearshift.operator.router.http_streaming import ClientDisconnected

log = logging.getLogger(__name__)


def error_response(error: errors.APIError) -> Response:
    """The error as its HTTP answer."""
    # ASCII-escaped: an error may quote input, and no input may make the answer unencodable.
    body = json.dumps(error.body(), ensure_ascii=True).encode()
    return Response(body, error.status, error.headers(), media_type="application/json")


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, errors.APIError)
    return error_response(exc)


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)


async def _invalid_body(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        error = errors.bad_request(f"malformed JSON body: {first.get('msg')}")
    else:
        error = errors.invalid_field(loc, first.get("msg", "invalid request"))
    return error_response(error)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error = errors.APIError(exc.status_code, str(exc.detail), "invalid_request_error")
    # Keeps e.g. the Allow header of a 405.
    response = error_response(error)
    response.headers.update(exc.headers or {})
    return response


async def _unexpected(request: Request, exc: Exception) -> Response:
    # The details (a traceback, maybe internal addresses) go to the log only.
    log.exception("unexpected error answering %s %s", request.method, request.url.path)
    return error_response(
        errors.internal(f"internal error ({type(exc).__name__}); see the router log")
    )


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error the app can raise as an OpenAI error (FastAPI's 422 becomes 400)."""
    app.add_exception_handler(errors.APIError, _api_error)
    app.add_exception_handler(ClientDisconnected, _client_gone)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
