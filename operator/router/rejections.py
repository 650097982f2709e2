"""Counts every 4xx/5xx answer of the router's client APIs, by status and reason.

HTTP answers are counted where they leave the app (an ASGI middleware outside the API-key
check), so no refusal path can forget to count: a bad body, a wrong key, an unknown model, a
full group, a failed worker, an unknown route. The reason is the OpenAI error's `code` (else
one per status, else its `type`). Probes and /metrics are not client requests and are not
counted; gRPC Generate counts through `count_grpc`.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gearshift.operator.router.errors import APIError
from gearshift.operator.router.metrics import RouterMetrics

NOT_COUNTED = frozenset({"/health", "/ready", "/metrics"})
STATUS_REASONS = {404: "not_found", 405: "method_not_allowed", 499: "client_disconnected"}
_MAX_BODY = 64 << 10  # error bodies are small; never buffer a large one


def reason_of(status: int, body: bytes) -> str:
    """The reason label of an error answer: its OpenAI `code`, the status's, or its `type`."""
    error: dict[str, Any] = {}
    try:
        parsed = json.loads(body) if body else {}
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            error = parsed["error"]
    except ValueError:
        pass
    return str(error.get("code") or STATUS_REASONS.get(status) or error.get("type") or status)


class RejectionCounter:
    """ASGI middleware: `gearshift_requests_rejected_total{status, reason}` for 4xx/5xx."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in NOT_COUNTED:
            await self.app(scope, receive, send)
            return
        status, body = 0, bytearray()

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif (
                message["type"] == "http.response.body" and status >= 400 and len(body) < _MAX_BODY
            ):
                body.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except BaseException:
            if status == 0:  # Starlette's outermost layer will answer 500
                self.metrics.reject(500, "internal_error")
            raise
        if status >= 400:
            self.metrics.reject(status, reason_of(status, bytes(body)))


def count_grpc(metrics: RouterMetrics, error: APIError) -> None:
    """Count an APIError that gRPC Generate answers with (as its HTTP twin would be)."""
    metrics.reject(error.status, error.code or STATUS_REASONS.get(error.status) or error.type)
