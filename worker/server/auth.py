"""The control-plane tokens: shared secrets on every internal gRPC call, checked in constant time.

Two tokens per deployment (the operator keeps each in its own Secret; `gearshift serve` makes
both per run): the *control* token authenticates router → worker calls (and whatever else the
workers of a group say to each other), the *admin* token operator → router Admin calls. Each
travels as gRPC metadata `authorization: Bearer <token>`. Health checks stay open, so kubelet
probes and the router's poller need no credential (they reveal only SERVING / NOT_SERVING).

A server with no token refuses to start unless it is told `--insecure-no-auth` (fail closed).

Rotation: a token read from a file (a mounted Secret) is read again when the file changes, and
the token it replaced stays valid for a grace window. Clients present the current token and,
within the window, the previous one too, so a server that has not seen the new file yet (the
kubelet refreshes mounted Secrets pod by pod) still admits them.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

TOKEN_FILE_ENV = "GEARSHIFT_CONTROL_TOKEN_FILE"
ADMIN_TOKEN_FILE_ENV = "GEARSHIFT_ADMIN_TOKEN_FILE"
# Methods anyone may call: the standard health service (probes, pollers).
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
# How long a rotated-out token is still accepted: above the kubelet's Secret refresh (its sync
# period plus its cache TTL, about a minute each by default) on every pod of the deployment.
DEFAULT_GRACE_S = 300.0
# Authorization entries a server looks at per call: the current and the previous token.
_MAX_PRESENTED = 2
Metadata = tuple[tuple[str, str], ...]


class TokenError(ValueError):
    """The token file is missing, unreadable or empty, or no token is configured; the message
    names it."""


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
        raise TokenError(f"cannot read the token file {path}: {exc.strerror}") from exc
    if not token:
        raise TokenError(f"the token file {path} is empty")
    return token


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()  # follows the kubelet's ..data symlink to the current version
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_ino, st.st_size)


@dataclass
class TokenSource:
    """A token, re-read from its file when the file changes; the token it replaced is still
    accepted (and presented) for `grace_s` seconds."""

    current: str
    path: Path | None = None
    grace_s: float = DEFAULT_GRACE_S
    recheck_s: float = 1.0  # a stat() at most this often, not on every call
    previous: str = ""
    previous_until: float = 0.0
    _stamp: tuple[int, int, int] | None = field(default=None, repr=False)
    _checked: float = field(default=0.0, repr=False)

    @staticmethod
    def from_file(path: str | Path, grace_s: float = DEFAULT_GRACE_S) -> TokenSource:
        """The token in `path` (TokenError when missing or empty), followed for rotation."""
        p = Path(path)
        stamp = _stamp(p)
        return TokenSource(read_token(p), p, grace_s, _stamp=stamp, _checked=time.monotonic())

    def refresh(self) -> None:
        """Read the file again if it changed; a new, non-empty token becomes current."""
        now = time.monotonic()
        if self.path is None or now - self._checked < self.recheck_s:
            return
        self._checked = now
        stamp = _stamp(self.path)
        if stamp is None or stamp == self._stamp:
            return
        try:
            token = read_token(self.path)
        except TokenError as exc:  # a half-written or emptied file: keep what works
            log.warning("keeping the current token: %s", exc)
            return
        self._stamp = stamp
        if token != self.current:
            self.previous, self.previous_until = self.current, now + self.grace_s
            self.current = token
            log.info(
                "token file %s changed: new token in use, the old one for %.0fs",
                self.path,
                self.grace_s,
            )

    def tokens(self) -> tuple[str, ...]:
        """The tokens to accept or present, the current one first."""
        self.refresh()
        if self.previous and time.monotonic() < self.previous_until:
            return (self.current, self.previous)
        return (self.current,)


def token_source(
    token: str | TokenSource | None,
    path: str | Path | None = None,
    grace_s: float = DEFAULT_GRACE_S,
) -> TokenSource | None:
    """A source from a file (followed for rotation), else from a fixed token; None for none."""
    if isinstance(token, TokenSource):
        return token
    if path:
        return TokenSource.from_file(path, grace_s)
    return TokenSource(token) if token else None


def call_metadata(token: str | TokenSource | None) -> Metadata | None:
    """What a client attaches to each call (None: no token configured)."""
    source = token_source(token)
    if source is None:
        return None
    return tuple(("authorization", f"Bearer {t}") for t in source.tokens())


def authorized(metadata: Any, accepted: Sequence[str | bytes]) -> bool:
    """Whether invocation metadata carries `Bearer <t>` for one of the `accepted` tokens
    (compared in constant time; at most two presented tokens are looked at)."""
    want = [t.encode() if isinstance(t, str) else t for t in accepted if t]
    presented: list[bytes] = []
    for key, value in metadata or ():
        if key == "authorization" and len(presented) < _MAX_PRESENTED:
            header = value if isinstance(value, str) else value.decode(errors="replace")
            scheme, _, token = header.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                presented.append(token.strip().encode())
    ok = False
    for p in presented:
        for t in want:
            ok |= hmac.compare_digest(p, t)  # no early exit: the time does not say which
    return ok


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but the open ones with UNAUTHENTICATED unless it carries the token."""

    def __init__(self, token: str | TokenSource, service: str = "") -> None:
        source = token_source(token)
        if source is None:
            raise TokenError(f"{service}: an empty token authenticates nobody")
        self._source = source
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
        if authorized(details.invocation_metadata, self._source.tokens()):
            return handler
        log.warning("%s: refused %s without a valid token", self._service, method)
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


def require(token: str | TokenSource | None, service: str, insecure_no_auth: bool) -> None:
    """Fail closed: TokenError when `service` has no token and was not told to run without."""
    if not token and not insecure_no_auth:
        raise TokenError(
            f"{service}: no token configured, so its gRPC calls would not be authenticated; set "
            f"a token file (${TOKEN_FILE_ENV} or the --*-token-file flag), or pass "
            "--insecure-no-auth to run without one"
        )


def interceptors(
    token: str | TokenSource | None, service: str, insecure_no_auth: bool = False
) -> list[grpc.aio.ServerInterceptor]:
    """The server interceptors for `token`; without one, TokenError unless `insecure_no_auth`
    (then none, and a warning)."""
    require(token, service, insecure_no_auth)
    if not token:
        log.warning("%s: --insecure-no-auth: gRPC calls are NOT authenticated", service)
        return []
    return [TokenInterceptor(token, service)]
