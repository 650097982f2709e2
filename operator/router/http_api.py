"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, models, tokenizer, probes."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from gearshift.operator.router import errors, openai_format
from gearshift.operator.router.core import Router
from gearshift.operator.router.generate import RequestRun, TokenDelta
from gearshift.operator.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

T = TypeVar("T")
log = logging.getLogger(__name__)
VERSION = "0.1.0"
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
Chunks = AsyncIterator[dict[str, Any]]


class ClientDisconnected(Exception):
    """The HTTP client went away before the answer was ready."""


class ApiKeyMiddleware:
    """Bearer API keys on the API routes; probes and /metrics stay open (vLLM does the same).

    A middleware, not a dependency: the key is checked before the body is even parsed, so a
    wrong key is always 401, never a 400 about the body.
    """

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], protect_metrics: bool = False) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.prefixes = PROTECTED_PREFIXES + (("/metrics",) if protect_metrics else ())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.keys and scope["path"].startswith(self.prefixes):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            token = token.strip()
            if scheme.lower() != b"bearer" or not any(
                hmac.compare_digest(token, k) for k in self.keys
            ):
                exc = errors.unauthorized()
                await JSONResponse(exc.body(), exc.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (vLLM's with_cancellation)."""
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
        raise ClientDisconnected()
    return task.result()


def _sse(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _start_stream(
    request: Request, run: RequestRun, render: Callable[[AsyncIterator[TokenDelta]], Chunks]
) -> Response:
    """Wait for the first token (errors before it are plain HTTP errors), then stream SSE."""
    deltas = run.deltas()
    try:
        first = await _until_disconnect(request, anext(deltas, None))
    except BaseException:
        await deltas.aclose()
        raise

    async def all_deltas() -> AsyncIterator[TokenDelta]:
        if first is not None:
            yield first
        async for delta in deltas:
            yield delta

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in render(all_deltas()):
                yield _sse(chunk)
        except errors.APIError as exc:  # failed or cut off mid-stream: say so, then end
            yield _sse(exc.body())
        finally:
            await deltas.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def build_app(router: Router) -> FastAPI:
    """The HTTP app of one router."""
    app = FastAPI(title="Gearshift", version=VERSION, docs_url=None, redoc_url=None)
    tokenizer = router.tokenizer

    @app.exception_handler(errors.APIError)
    async def api_error(request: Request, exc: errors.APIError) -> Response:
        return JSONResponse(exc.body(), exc.status, headers=exc.headers())

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            error = errors.bad_request(f"malformed JSON body: {first.get('msg')}")
        else:
            param = ".".join(loc) or None
            msg = first.get("msg", "invalid request")
            error = errors.bad_request(f"{param}: {msg}" if param else msg, param)
        return JSONResponse(error.body(), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        error = errors.APIError(exc.status_code, str(exc.detail), "invalid_request_error")
        # Keeps e.g. the Allow header of a 405.
        return JSONResponse(error.body(), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        # The details (a traceback, maybe internal addresses) go to the log only.
        log.exception("unexpected error answering %s %s", request.method, request.url.path)
        error = errors.internal(f"internal error ({type(exc).__name__}); see the router log")
        return JSONResponse(error.body(), 500)

    # ---- probes and metadata ---------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        serving = [g.name for g in router.pool.serving()]
        ok = bool(serving) and router.accepting
        return JSONResponse({"ready": ok, "serving_groups": serving}, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        cfg = router.config
        return openai_format.model_list(
            cfg.model_name, cfg.model_path, router.created, router.pool.max_model_len
        )

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        router.check_model(body.model)
        if body.messages is not None:
            chat = ChatCompletionRequest.model_validate(
                {"messages": body.messages, "add_generation_prompt": body.add_generation_prompt}
            )
            ids = router.chat_prompt(chat)
        elif body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise errors.bad_request("one of prompt and messages is required", "prompt")
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": router.pool.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        router.check_model(body.model)
        if any(t < 0 or t >= tokenizer.vocab_size for t in body.tokens):
            raise errors.bad_request("a token id is outside the vocabulary", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    # ---- generation -----------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        router.check_accepting()
        router.check_model(body.model)
        if body.suffix:
            raise errors.bad_request("suffix is not supported", "suffix")
        ids = router.completion_prompt(body)
        prepared = router.prepare(body, ids, body.max_tokens, body.logprobs, "prompt", "cmpl")
        run = router.run(prepared)
        rid, created, model = prepared.request_id, int(time.time()), router.model_name
        echo = tokenizer.decode(ids) if body.echo else ""
        want_lp = body.logprobs is not None

        async def render(deltas: AsyncIterator[TokenDelta]) -> Chunks:
            offset, text_so_far = 0, echo
            first = True
            async for d in deltas:
                text = (echo if first else "") + d.text
                first = False
                lp = None
                if want_lp and d.logprob is not None:
                    acc = openai_format.CompletionLogprobs()
                    acc.add(d.logprob, len(text_so_far))
                    lp = acc.to_dict()
                text_so_far += d.text
                offset += 1
                stop_reason = run.result.stop_reason if d.finish_reason else None
                yield openai_format.completion_chunk(
                    rid, created, model, text, lp, d.finish_reason, stop_reason, body.include_usage
                )
            if body.include_usage:
                yield openai_format.usage_chunk(rid, created, model, "text_completion", run.result)

        if body.stream:
            return await _start_stream(request, run, render)

        async def collect() -> dict[str, Any]:
            text, acc = echo, openai_format.CompletionLogprobs()
            async with contextlib.aclosing(run.deltas()) as deltas:
                async for d in deltas:
                    if want_lp and d.logprob is not None:
                        acc.add(d.logprob, len(text))
                    text += d.text
            lp = acc.to_dict() if want_lp else None
            return openai_format.completion(rid, created, model, text, lp, run.result)

        return JSONResponse(await _until_disconnect(request, collect()))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        router.check_accepting()
        router.check_model(body.model)
        ids = router.chat_prompt(body)
        prepared = router.prepare(
            body, ids, body.output_limit, body.num_logprobs, "messages", "chatcmpl"
        )
        run = router.run(prepared)
        rid, created, model = prepared.request_id, int(time.time()), router.model_name
        want_lp = body.logprobs

        async def render(deltas: AsyncIterator[TokenDelta]) -> Chunks:
            yield openai_format.chat_chunk(
                rid,
                created,
                model,
                {"role": "assistant", "content": ""},
                include_usage=body.include_usage,
            )
            async for d in deltas:
                delta = {"content": d.text} if d.token_id is not None or d.text else {}
                lp = (
                    [openai_format.chat_logprob(d.logprob)]
                    if want_lp and d.logprob is not None
                    else None
                )
                stop_reason = run.result.stop_reason if d.finish_reason else None
                yield openai_format.chat_chunk(
                    rid,
                    created,
                    model,
                    delta,
                    lp,
                    d.finish_reason,
                    stop_reason,
                    body.include_usage,
                )
            if body.include_usage:
                yield openai_format.usage_chunk(
                    rid, created, model, "chat.completion.chunk", run.result
                )

        if body.stream:
            return await _start_stream(request, run, render)

        async def collect() -> dict[str, Any]:
            text, lps = "", []
            async with contextlib.aclosing(run.deltas()) as deltas:
                async for d in deltas:
                    text += d.text
                    if want_lp and d.logprob is not None:
                        lps.append(openai_format.chat_logprob(d.logprob))
            return openai_format.chat_completion(
                rid, created, model, text, lps if want_lp else None, run.result
            )

        return JSONResponse(await _until_disconnect(request, collect()))

    return app
