"""Request bodies over the cap are refused with 413 before they are read whole.

An ASGI middleware: a `Content-Length` over the cap is answered at once, without reading the
body; a body without one (chunked) is counted as it arrives and refused as soon as it passes
the cap, so no more than the cap is ever held.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gearshift.operator.router import errors
from gearshift.operator.router.http_errors import error_response


def too_large(limit: int) -> errors.APIError:
    """413: the body is over --max-body-bytes (router.json maxBodyBytes)."""
    return errors.APIError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes (--max-body-bytes)",
        "invalid_request_error",
        None,
        "request_too_large",
    )


class BodyLimit:
    """Caps every HTTP request body at `max_bytes`."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _answer(too_large(self.max_bytes), send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise too_large(self.max_bytes)  # the routes answer it (an APIError)
            return message

        await self.app(scope, counted, send)


async def _answer(error: errors.APIError, send: Send) -> None:
    response = error_response(error)
    response.headers["connection"] = "close"  # the unread body stays unread
    start = {"type": "http.response.start", "status": response.status_code}
    await send({**start, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
