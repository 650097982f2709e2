"""The control-plane token: a shared secret on every internal gRPC call, checked in constant time.

One token per deployment (the operator keeps it in a Secret; `gearshift serve` makes one per
run) authenticates router → worker and operator → router Admin calls. It travels as gRPC
metadata `authorization: Bearer <token>`. Health checks stay open, so kubelet probes and the
router's poller need no credential (they reveal only SERVING / NOT_SERVING).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

TOKEN_FILE_ENV = "GEARSHIFT_CONTROL_TOKEN_FILE"
# Methods anyone may call: the standard health service (probes, pollers).
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
Metadata = tuple[tuple[str, str], ...]


class TokenError(ValueError):
    """The token file is missing, unreadable or empty; the message names it."""


def generate_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def write_token(path: Path, token: str) -> Path:
    """Write `token` readable by this user only (0600), before any content is visible."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token)
    return path


def read_token(path: str | Path) -> str:
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise TokenError(f"cannot read the control token file {path}: {exc.strerror}") from exc
    if not token:
        raise TokenError(f"the control token file {path} is empty")
    return token


def call_metadata(token: str | None) -> Metadata | None:
    """What a client attaches to each call (None: no token configured)."""
    return (("authorization", f"Bearer {token}"),) if token else None


def authorized(metadata: Any, token: bytes) -> bool:
    """Whether invocation metadata carries `Bearer <token>` (compared in constant time)."""
    header = ""
    for key, value in metadata or ():
        if key == "authorization":
            header = value if isinstance(value, str) else value.decode(errors="replace")
    scheme, _, presented = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), token)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but the open ones with UNAUTHENTICATED unless it carries the token."""

    def __init__(self, token: str, service: str = "") -> None:
        self._token = token.encode()
        self._service = service  # for the log line: which server refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        if authorized(details.invocation_metadata, self._token):
            return handler
        log.warning("%s: refused %s without a valid control token", self._service, method)
        return _refusal(handler)


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid control token")


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only refuses."""
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_deny, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_deny, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_deny, **kw)
    return grpc.stream_stream_rpc_method_handler(_deny, **kw)


def interceptors(token: str | None, service: str) -> list[grpc.aio.ServerInterceptor]:
    """The server interceptors for `token`; none (and a warning) when there is no token."""
    if not token:
        log.warning("%s: no control token configured; gRPC calls are not authenticated", service)
        return []
    return [TokenInterceptor(token, service)]
