"""Request bodies over the cap are refused with 413 before they are read whole.

An ASGI middleware: a `Content-Length` over the cap is answered at once, without reading the
body; a body without one (chunked) is counted as it arrives and refused as soon as it passes
the cap, so no more than the cap is ever held. What is left of a refused body is read and
dropped (bounded), so the client can read the 413.
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


# After a 413, up to this much more of the body is read and dropped, so that a client still
# sending can finish and read the answer (closing on it resets the connection under it);
# beyond it the connection is closed.
DRAIN_BYTES = 64 << 20


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
            await _drain(receive)
            return
        received = 0
        more = True

        async def counted() -> Message:
            nonlocal received, more
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                more = bool(message.get("more_body", False))
                if received > self.max_bytes:
                    raise too_large(self.max_bytes)  # the routes answer it (an APIError)
            return message

        await self.app(scope, counted, send)
        if received > self.max_bytes and more:
            await _drain(receive)


async def _answer(error: errors.APIError, send: Send) -> None:
    response = error_response(error)
    start = {"type": "http.response.start", "status": response.status_code}
    await send({**start, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


async def _drain(receive: Receive) -> None:
    dropped = 0
    while dropped <= DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
