"""Answering a generation over HTTP: one JSON body or SSE chunks, cancelled if the client leaves."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gearshift.operator.router import errors
from gearshift.operator.router.choices import Choices

T = TypeVar("T")
Chunks = AsyncIterator[dict[str, Any]]


class ClientDisconnected(Exception):
    """The HTTP client went away before the answer was ready."""


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


def sse(chunk: dict[str, Any]) -> str:
    """One server-sent event carrying ``chunk`` as compact JSON."""
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
                yield sse(chunk)
        except errors.APIError as exc:  # failed or cut off mid-stream: say so, then end
            yield sse(exc.body())
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def answer_stream(
    request: Request, choices: Choices, render: Callable[[AsyncIterator[Any]], Chunks]
) -> Response:
    """Stream the running choices as SSE chunks of ``render``."""
    try:
        return await _start_stream(request, choices.stream(), render)
    except BaseException:
        choices.close()  # the stream may never have started: free the request id here
        raise


async def answer_whole(
    request: Request, choices: Choices, work: Awaitable[dict[str, Any]]
) -> Response:
    """Answer with the one JSON body ``work`` builds from the running choices."""
    try:
        return JSONResponse(await until_disconnect(request, work))
    finally:
        choices.close()


async def answer(
    request: Request,
    choices: Choices,
    stream: bool,
    chunks: Callable[[AsyncIterator[Any]], Chunks],
    whole: Callable[[], Awaitable[dict[str, Any]]],
) -> Response:
    """SSE chunks of ``chunks`` when the body asked to ``stream``, else ``whole()``'s body."""
    if stream:
        return await answer_stream(request, choices, chunks)
    return await answer_whole(request, choices, whole())
