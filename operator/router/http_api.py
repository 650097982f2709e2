"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, models, tokenizer, probes."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from gearshift.operator.router import (
    cache_salt,
    chat_render,
    completion_render,
    errors,
    openai_format,
)
from gearshift.operator.router.choices import Choices
from gearshift.operator.router.core import Router
from gearshift.operator.router.openapi import ERROR_RESPONSES, GENERATION_RESPONSES, openapi_400
from gearshift.operator.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from gearshift.operator.router.structured_request import structured_spec

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

    def __init__(
        self,
        app: ASGIApp,
        keys: tuple[str, ...],
        protect_metrics: bool = False,
        salt_by_key: bool = False,
    ) -> None:
        self.app = app
        if any(not k.strip() for k in keys):
            raise ValueError("an empty or blank API key would let anyone in")
        self.keys = [k.encode() for k in keys]
        self.prefixes = PROTECTED_PREFIXES + (("/metrics",) if protect_metrics else ())
        # Each key's prefix-cache salt, left in request.state for the routes (cache_salt.py).
        self.salts = [cache_salt.key_salt(k) if salt_by_key else "" for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.keys and scope["path"].startswith(self.prefixes):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            token = token.strip()
            # Every key is compared (no early exit): the time does not say which one matched.
            matches = [hmac.compare_digest(token, k) for k in self.keys]
            if scheme.lower() != b"bearer" or not token or not any(matches):
                exc = errors.unauthorized()
                await JSONResponse(exc.body(), exc.status)(scope, receive, send)
                return
            scope.setdefault("state", {})[cache_salt.STATE_KEY] = self.salts[matches.index(True)]
        await self.app(scope, receive, send)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
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
    request: Request, deltas: AsyncIterator[T], render: Callable[[AsyncIterator[T]], Chunks]
) -> Response:
    """Wait for the first token (errors before it are plain HTTP errors), then stream SSE."""
    try:
        first = await until_disconnect(request, anext(deltas, None))
    except BaseException:
        await deltas.aclose()  # type: ignore[attr-defined]
        raise

    async def all_deltas() -> AsyncIterator[T]:
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
            await deltas.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def _answer_stream(
    request: Request, choices: Choices, render: Callable[[AsyncIterator[Any]], Chunks]
) -> Response:
    try:
        return await _start_stream(request, choices.stream(), render)
    except BaseException:
        choices.close()  # the stream may never have started: free the request id here
        raise


async def _answer_whole(
    request: Request, choices: Choices, work: Awaitable[dict[str, Any]]
) -> Response:
    try:
        return JSONResponse(await until_disconnect(request, work))
    finally:
        choices.close()


def _error_response(error: errors.APIError) -> Response:
    # ASCII-escaped: an error may quote input, and no input may make the answer unencodable.
    body = json.dumps(error.body(), ensure_ascii=True).encode()
    return Response(body, error.status, error.headers(), media_type="application/json")


def build_app(router: Router) -> FastAPI:
    """The HTTP app of one router."""
    app = FastAPI(title="Gearshift", version=VERSION, docs_url=None, redoc_url=None)
    app.openapi = openapi_400(app)  # type: ignore[method-assign]
    tokenizer = router.tokenizer

    @app.exception_handler(errors.APIError)
    async def api_error(request: Request, exc: errors.APIError) -> Response:
        return _error_response(exc)

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
        return _error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        error = errors.APIError(exc.status_code, str(exc.detail), "invalid_request_error")
        # Keeps e.g. the Allow header of a 405.
        response = _error_response(error)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        # The details (a traceback, maybe internal addresses) go to the log only.
        log.exception("unexpected error answering %s %s", request.method, request.url.path)
        return _error_response(
            errors.internal(f"internal error ({type(exc).__name__}); see the router log")
        )

    # ---- probes and metadata ---------------------------------------------------------------

    @app.get("/health", response_class=Response, responses={200: {"content": None}})
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready", responses={503: {"description": "Not serving (no group, or draining)."}})
    async def ready() -> Response:
        serving = [g.name for g in router.pool.serving()]
        ok = bool(serving) and router.accepting
        return JSONResponse({"ready": ok, "serving_groups": serving}, 200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
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

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        router.check_text(body)
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

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        router.check_text(body)
        router.check_model(body.model)
        if any(t < 0 or t >= tokenizer.vocab_size for t in body.tokens):
            raise errors.bad_request("a token id is outside the vocabulary", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    # ---- generation -----------------------------------------------------------------------

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        router.check_text(body)
        router.check_accepting()
        router.check_model(body.model)
        if body.suffix:
            raise errors.bad_request("suffix is not supported", "suffix")
        prompts = router.completion_prompts(body)
        salt = getattr(request.state, cache_salt.STATE_KEY, "")
        rid, choices = router.start(
            body, prompts, body.max_tokens, body.logprobs, "prompt", "cmpl", salt
        )
        view = completion_render.CompletionView(
            rid,
            int(time.time()),
            router.model_name,
            body.n,
            tuple(tokenizer.decode(ids) if body.echo else "" for ids in prompts),
            body.logprobs is not None,
            body.include_usage,
            body.continuous_usage,
            body.prompt_logprobs is not None,
            tuple(tokenizer.decode(ids[:1], skip_special_tokens=False) for ids in prompts),
        )
        if body.stream:
            render = lambda s: completion_render.chunks(view, choices, s)
            return await _answer_stream(request, choices, render)
        return await _answer_whole(request, choices, completion_render.whole(view, choices))

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        router.check_text(body)
        router.check_accepting()
        router.check_model(body.model)
        _, tools = structured_spec(body)  # 400s about tools before the template sees them
        if body.stream and body.prompt_logprobs is not None:
            # Whole chat responses carry them (on the response, as vLLM does); streams do not.
            raise errors.bad_request(
                "prompt_logprobs: not available on streamed chat completions; drop stream or "
                "prompt_logprobs",
                "prompt_logprobs",
            )
        ids = router.chat_prompt(body)
        salt = getattr(request.state, cache_salt.STATE_KEY, "")
        rid, choices = router.start(
            body, [ids], body.output_limit, body.num_logprobs, "messages", "chatcmpl", salt
        )
        view = chat_render.ChatView(
            rid,
            int(time.time()),
            router.model_name,
            body.logprobs,
            body.include_usage,
            body.continuous_usage,
            tools,
            body.prompt_logprobs is not None,
        )
        if body.stream:
            render = lambda s: chat_render.chunks(view, choices, s)
            return await _answer_stream(request, choices, render)
        return await _answer_whole(request, choices, chat_render.whole(view, choices))

    return app
