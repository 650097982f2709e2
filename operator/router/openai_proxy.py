"""Completions and chat through `openai-http` groups: the client's body, forwarded.

The backend (vLLM, another Gearshift) tokenises, applies its chat template, validates and
samples, so the router forwards the client's JSON body with only `model` rewritten to the name the
backend serves: the answer is the backend's own, byte for byte in content, and every field the
backend honours or refuses stays honoured or refused. What the router adds is what it adds for
worker groups: the API key, routing by load, a retry on another group before the first token,
draining, and the same request metrics. Token counts come from the answer's `usage`; a stream
whose client did not ask for usage is not changed to get it (vLLM then moves fields between
chunks), so its counts are estimates: our tokenizer's count of the prompt text, one token per
chunk with output.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gearshift.operator.router import errors
from gearshift.operator.router.core import Router
from gearshift.operator.router.group import Lease
from gearshift.operator.router.openai_backend import OpenAIGroup

log = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")
# Answers that mean "this server cannot take the request now": try another group.
_RETRY_STATUSES = {429, 500, 502, 503, 504}


class OpenAIProxy:
    """ASGI middleware: POST completions and chat go to an openai-http group; the rest passes.

    Installed inside the API key middleware, so keys are checked first; /v1/models, /tokenize,
    probes and /metrics stay the router's own.
    """

    def __init__(self, app: ASGIApp, router: Router) -> None:
        self.app = app
        self.router = router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ROUTES:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await ProxiedRequest.start(self.router, request)
        except errors.APIError as exc:
            response = JSONResponse(exc.body(), exc.status, headers=exc.headers())
        await response(scope, receive, send)


@dataclass
class _Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    has_counts: bool = False  # the backend sent usage


class _Retry(Exception):
    """The group failed before an answer; `error` is the answer if no group is left."""

    def __init__(self, error: errors.APIError) -> None:
        super().__init__(error.message)
        self.error = error


class ProxiedRequest:
    """One client request: parsed once, sent to groups until one answers, metrics kept."""

    def __init__(self, router: Router, path: str, body: dict[str, Any]) -> None:
        self.router = router
        self.path = path
        self.body = body
        self.stream = bool(body.get("stream"))
        self.arrival = time.monotonic()
        self.prompt_tokens = self._estimate_prompt_tokens()
        self.usage = _Usage()
        self.first: float | None = None
        self.last: float | None = None
        self.chunks = 0  # chunks with output so far
        self.recorded = False

    @classmethod
    async def start(cls, router: Router, request: Request) -> Response:
        router.check_accepting()
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            raise errors.bad_request(f"malformed JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise errors.bad_request("the body must be a JSON object")
        model = body.get("model")
        router.check_model(model if isinstance(model, str) else None)
        return await cls(router, request.url.path, body).respond(request)

    # ---- load estimate --------------------------------------------------------------------

    def _estimate_prompt_tokens(self) -> int:
        """Prompt tokens for routing only (the backend counts for real): text through our
        tokenizer, without the chat template."""
        prompt = self.body.get("prompt", self.body.get("messages"))
        texts: list[str] = []
        count = 0

        def walk(x: Any) -> None:
            nonlocal count
            if isinstance(x, str):
                texts.append(x)
            elif isinstance(x, int):
                count += 1
            elif isinstance(x, list):
                for y in x:
                    walk(y)
            elif isinstance(x, dict):
                for y in x.values():
                    walk(y)

        walk(prompt)
        text = "\n".join(texts)
        return count + (len(self.router.tokenizer.encode(text)) if text else 0)

    def _max_tokens(self) -> int:
        for key in ("max_completion_tokens", "max_tokens"):
            value = self.body.get(key)
            if isinstance(value, int) and value >= 0:
                return value
        limit = self.router.pool.max_model_len
        return max(0, limit - self.prompt_tokens) if limit else 0

    # ---- sending --------------------------------------------------------------------------

    async def respond(self, request: Request) -> Response:
        """Try groups until one answers; errors before that are plain HTTP errors."""
        tried: set[str] = set()
        metrics = self.router.metrics
        try:
            while True:
                lease = self.router.pool.acquire(self.prompt_tokens, self._max_tokens(), tried)
                tried.add(lease.group.name)
                try:
                    return await self._attempt(lease, request)
                except _Retry as retry:
                    metrics.retries.labels(metrics.model_name).inc()
                    log.warning("group %s failed before answering (%s)", lease.group.name, retry)
                    if not any(g.name not in tried for g in self.router.pool.serving()):
                        raise retry.error from None
        except errors.APIError as exc:
            self._reject(exc.status)
            raise

    def _reject(self, status: int) -> None:
        if not self.recorded:
            self.recorded = True
            metrics = self.router.metrics
            metrics.rejected.labels(metrics.model_name, str(status)).inc()

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
        body = dict(self.body, model=group.backend_model(self.router.model_name))
        wire = group.client.build_request("POST", self.path, json=body)
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
            self._reject(upstream.status_code)
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
        self.first = self.last = time.monotonic()
        if isinstance(answer, dict):
            answer["model"] = self.router.model_name
            self._read_usage(answer)
        self._record(self.usage.finish_reason or "stop", ttft=False)
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
                    f"group {lease.group.name} failed after {self.chunks} chunks: "
                    f"{type(exc).__name__}: {exc}"
                )
                yield _sse(error.body())
                yield "data: [DONE]\n\n"
                self._record("error")
            finally:
                await events.aclose()
                self._record("abort")  # no-op unless the client left mid-stream

        return StreamingResponse(body(), media_type="text/event-stream")

    async def _events(self, lease: Lease, upstream: httpx.Response) -> AsyncGenerator[str, None]:
        """The backend's SSE events, `model` rewritten, usage dropped if not asked for."""
        try:
            async for line in upstream.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    self._record(self.usage.finish_reason or "stop")
                    yield "data: [DONE]\n\n"
                    continue
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    continue
                self._on_chunk(lease, chunk)
                if "model" in chunk:
                    chunk["model"] = self.router.model_name
                yield _sse(chunk)
        finally:
            await upstream.aclose()
            lease.release()

    # ---- metrics --------------------------------------------------------------------------

    def _on_chunk(self, lease: Lease, chunk: dict[str, Any]) -> None:
        now = time.monotonic()
        self._read_usage(chunk)
        choices = chunk.get("choices") or []
        produced = sum(1 for c in choices if _has_output(c))
        if not produced:
            return
        lease.on_tokens(produced)
        self.chunks += 1
        metrics = self.router.metrics
        if self.first is None:
            self.first = now
        elif self.last is not None:
            metrics.itl.labels(metrics.model_name).observe(now - self.last)
        self.last = now

    def _read_usage(self, chunk: dict[str, Any]) -> None:
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage.has_counts = True
            self.usage.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.usage.completion_tokens = int(usage.get("completion_tokens") or 0)
        for c in chunk.get("choices") or []:
            if isinstance(c, dict) and c.get("finish_reason"):
                self.usage.finish_reason = str(c["finish_reason"])

    def _record(self, reason: str, ttft: bool = True) -> None:
        if self.recorded:
            return
        self.recorded = True
        now, first = time.monotonic(), self.first
        usage = self.usage
        if not usage.has_counts:  # a stream without usage: estimates (module docstring)
            usage.prompt_tokens, usage.completion_tokens = self.prompt_tokens, self.chunks
        self.router.metrics.observe_finished(
            finish_reason=reason,
            prompt_tokens=usage.prompt_tokens,
            output_tokens=usage.completion_tokens,
            e2e=now - self.arrival,
            ttft=first - self.arrival if first is not None and ttft else None,
            decode_time=self.last - first
            if ttft and first is not None and self.last is not None
            else None,
            queue_time=None,
        )


def _has_output(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(delta.get("content") or delta.get("tool_calls"))


def _sse(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _until_disconnect(request: Request, work: Any) -> Any:
    """Await `work`; if the client disconnects first, cancel it and answer 499."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise errors.APIError(499, "the client disconnected", "client_closed_request")
    return task.result()
