"""Completions and chat through `openai-http` groups: the client's body, forwarded.

The backend (vLLM, another Gearshift) tokenises, applies its chat template, validates and
samples, so the router forwards the client's JSON body with only `model` rewritten to the name the
backend serves: the answer is the backend's own, byte for byte in content, and every field the
backend honours or refuses stays honoured or refused. What the router adds is what it adds for
worker groups: the API key, routing by load, a retry on another group before the first token,
draining, and the same request metrics (openai_accounting.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gearshift.operator.router import errors
from gearshift.operator.router.core import Router
from gearshift.operator.router.group import Lease
from gearshift.operator.router.http_streaming import ClientDisconnected, sse, until_disconnect
from gearshift.operator.router.openai_accounting import ProxyAccount, requested_max_tokens
from gearshift.operator.router.openai_backend import OpenAIGroup
from gearshift.operator.router.preparation import Preparation
from gearshift.operator.router.request_prep import ProxyPlan

log = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")
# Answers that mean "this server cannot take the request now": try another group.
_RETRY_STATUSES = {429, 500, 502, 503, 504}


class OpenAIProxy:
    """ASGI middleware: POST completions and chat go to an openai-http group; the rest passes.

    Installed inside the API key and body size middlewares, so keys and the body's size are
    checked first; /v1/models, /tokenize, probes and /metrics stay the router's own. The body
    is checked (JSON, nesting, surrogates, size caps) and counted in a preparation lane.
    """

    def __init__(self, app: ASGIApp, preparation: Preparation) -> None:
        self.app = app
        self.preparation = preparation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ROUTES:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            plan = await self.preparation.proxied(request)
            proxied = ProxiedRequest(self.preparation.router, request.url.path, plan)
            response = await proxied.respond(request)
        except errors.APIError as exc:
            response = JSONResponse(exc.body(), exc.status, headers=exc.headers())
        await response(scope, receive, send)


class _Retry(Exception):
    """The group failed before an answer; `error` is the answer if no group is left."""

    def __init__(self, error: errors.APIError) -> None:
        super().__init__(error.message)
        self.error = error


class ProxiedRequest:
    """One client request: parsed once, sent to groups until one answers, metrics kept."""

    def __init__(self, router: Router, path: str, plan: ProxyPlan) -> None:
        self.router = router
        self.path = path
        self.plan = plan  # checked and counted in a preparation lane (preparation.py)
        self.stream = plan.stream
        self.account = ProxyAccount(router.metrics, plan.prompt_estimate)

    # ---- sending --------------------------------------------------------------------------

    async def respond(self, request: Request) -> Response:
        """Try groups until one answers; errors before that are plain HTTP errors."""
        tried: set[str] = set()
        metrics = self.router.metrics
        try:
            while True:
                estimate = self.account.prompt_estimate
                max_tokens = requested_max_tokens(
                    self.plan.output_limits, estimate, self.router.pool.max_model_len
                )
                lease = self.router.pool.acquire(estimate, max_tokens, tried)
                tried.add(lease.group.name)
                try:
                    return await self._attempt(lease, request)
                except _Retry as retry:
                    metrics.retries.labels(metrics.model_name).inc()
                    log.warning("group %s failed before answering (%s)", lease.group.name, retry)
                    if not any(g.name not in tried for g in self.router.pool.serving()):
                        raise retry.error from None
        except errors.APIError as exc:
            self.account.reject(exc.status)
            raise

    async def _attempt(self, lease: Lease, request: Request) -> Response:
        """One group's answer. Until it starts (headers, and a stream's first event) a client
        that disconnects cancels the backend request; the lease is released on every exit
        except a stream handed to the client, whose events release it at their end."""
        try:
            return await _until_disconnect(request, self._answer(lease))
        except BaseException:
            lease.release()  # idempotent
            raise

    async def _answer(self, lease: Lease) -> Response:
        group = lease.group
        assert isinstance(group, OpenAIGroup)
        content = self.plan.content(group.backend_model(self.router.model_name))
        headers = {"content-type": "application/json"}
        wire = group.client.build_request("POST", self.path, content=content, headers=headers)
        try:
            upstream = await group.client.send(wire, stream=True)
        except httpx.HTTPError as exc:
            group.mark_failed(f"{type(exc).__name__}: {exc}")
            raise _Retry(errors.unavailable(f"group {group.name}: {exc}")) from None
        if upstream.status_code != 200:
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
            if upstream.status_code in _RETRY_STATUSES:
                raise _Retry(
                    errors.APIError(
                        upstream.status_code,
                        f"group {group.name} answered {upstream.status_code}: "
                        f"{content[:300].decode(errors='replace')}",
                        "service_unavailable",
                    )
                )
            # The backend refused the request itself (400, 404, 422...): its answer is ours.
            lease.release()
            self.account.reject(upstream.status_code)
            return Response(
                content,
                upstream.status_code,
                media_type=upstream.headers.get("content-type", "application/json"),
            )
        if not self.stream:
            return await self._whole(lease, upstream)
        return await self._streamed(lease, upstream)

    async def _whole(self, lease: Lease, upstream: httpx.Response) -> Response:
        try:
            answer = json.loads(await upstream.aread())
        except httpx.HTTPError as exc:
            lease.group.mark_failed(f"{type(exc).__name__}: {exc}")
            raise _Retry(errors.unavailable(f"group {lease.group.name}: {exc}")) from None
        except ValueError as exc:
            raise errors.worker_failed(f"group {lease.group.name}: not JSON: {exc}") from None
        finally:
            await upstream.aclose()
            lease.release()
        if isinstance(answer, dict):
            answer["model"] = self.router.model_name
            self.account.read_usage(answer)
        self.account.record(self.account.finish_reason or "stop", streamed=False)
        return JSONResponse(answer)

    async def _streamed(self, lease: Lease, upstream: httpx.Response) -> Response:
        events = self._events(lease, upstream)
        try:
            first = await anext(events, None)
        except httpx.HTTPError as exc:
            await events.aclose()
            lease.group.mark_failed(f"{type(exc).__name__}: {exc}")
            raise _Retry(errors.unavailable(f"group {lease.group.name}: {exc}")) from None
        except BaseException:
            await events.aclose()
            raise

        async def body() -> AsyncIterator[str]:
            try:
                if first is not None:
                    yield first
                async for event in events:
                    yield event
            except httpx.HTTPError as exc:
                error = errors.worker_failed(
                    f"group {lease.group.name} failed after {self.account.chunks} chunks: "
                    f"{type(exc).__name__}: {exc}"
                )
                yield sse(error.body())
                yield "data: [DONE]\n\n"
                self.account.record("error")
            finally:
                await events.aclose()
                self.account.record("abort")  # no-op unless the client left mid-stream

        return StreamingResponse(body(), media_type="text/event-stream")

    async def _events(self, lease: Lease, upstream: httpx.Response) -> AsyncGenerator[str, None]:
        """The backend's SSE events, `model` rewritten, usage dropped if not asked for."""
        try:
            async for line in upstream.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    self.account.record(self.account.finish_reason or "stop")
                    yield "data: [DONE]\n\n"
                    continue
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    continue
                self.account.on_chunk(lease, chunk)
                if "model" in chunk:
                    chunk["model"] = self.router.model_name
                yield sse(chunk)
        finally:
            await upstream.aclose()
            lease.release()


async def _until_disconnect(request: Request, work: Any) -> Any:
    """Await `work`; if the client disconnects first, cancel it and answer 499."""
    try:
        return await until_disconnect(request, work)
    except ClientDisconnected as exc:
        raise errors.APIError(499, "the client disconnected", "client_closed_request") from exc
