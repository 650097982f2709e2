"""A scripted OpenAI-compatible HTTP server on loopback, for the router's openai-http tests.

Real HTTP (uvicorn on an OS-picked port); what it answers is scripted per test: a status for
generation requests, a list of text pieces to stream, a gate that holds the stream open, or a
connection dropped mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class OpenAIScript:
    status: int = 200  # answer generation requests with this status
    pieces: list[str] = field(default_factory=lambda: ["Hel", "lo"])
    gate: asyncio.Event | None = None  # the answer waits on this (streams: before any piece)
    drop_after: int | None = None  # close the connection after this many pieces


class FakeOpenAI:
    """Serves /v1/models (as `model`), /metrics, and scripted completions and chat."""

    def __init__(self, model: str = "backend-model") -> None:
        self.model = model
        self.script = OpenAIScript()
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.healthy = True
        # Set: /v1 routes want `Authorization: Bearer <api_key>` and answer 401 otherwise, as
        # `vllm serve --api-key` (VLLM_API_KEY) does; /metrics stays open, as in vLLM.
        self.api_key: str | None = None
        self.model_headers: list[dict[str, str]] = []
        app = Starlette(
            routes=[
                Route("/v1/models", self._models),
                Route("/metrics", self._metrics),
                Route("/v1/completions", self._generate, methods=["POST"]),
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
            ]
        )
        self._server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        )
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> FakeOpenAI:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        for _ in range(200):
            if self._server.started:
                return self
            await asyncio.sleep(0.025)
        raise RuntimeError("the fake OpenAI server did not start")

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await asyncio.wait_for(self._task, 10)
        self._sock.close()

    def _refused(self, request: Request) -> Response | None:
        if self.api_key is None:
            return None
        if request.headers.get("authorization") == f"Bearer {self.api_key}":
            return None
        return JSONResponse({"error": "Unauthorized"}, 401)

    async def _models(self, request: Request) -> Response:
        self.model_headers.append(dict(request.headers))
        if not self.healthy:
            return Response(status_code=503)
        if (refused := self._refused(request)) is not None:
            return refused
        return JSONResponse({"object": "list", "data": [{"id": self.model, "max_model_len": 4096}]})

    async def _metrics(self, request: Request) -> Response:
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{model_name="m"} 3.0\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{model_name="m"} 1.0\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
        )
        return Response(text, media_type="text/plain")

    async def _generate(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if (refused := self._refused(request)) is not None:
            return refused
        s = self.script
        if s.status != 200:
            return JSONResponse({"error": {"message": f"scripted {s.status}"}}, s.status)
        chat = request.url.path.endswith("/chat/completions")
        if not body.get("stream"):
            if s.gate is not None:
                await asyncio.wait_for(s.gate.wait(), 30)
            text = "".join(s.pieces)
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            choice |= (
                {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            )
            return JSONResponse(
                {
                    "id": "x",
                    "object": "chat.completion" if chat else "text_completion",
                    "model": body.get("model"),
                    "choices": [choice],
                    "usage": {"prompt_tokens": 5, "completion_tokens": len(s.pieces)},
                }
            )
        return StreamingResponse(self._stream(body, chat), media_type="text/event-stream")

    async def _stream(self, body: dict[str, Any], chat: bool) -> AsyncIterator[str]:
        s = self.script
        if s.gate is not None:
            await asyncio.wait_for(s.gate.wait(), 30)
        for i, piece in enumerate(s.pieces):
            if s.drop_after is not None and i == s.drop_after:
                raise ConnectionError("scripted drop")  # uvicorn closes the connection
            last = i == len(s.pieces) - 1
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
            choice |= {"delta": {"content": piece}} if chat else {"text": piece}
            yield _sse({"id": "x", "model": body.get("model"), "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 5, "completion_tokens": len(s.pieces)}
            yield _sse({"id": "x", "model": body.get("model"), "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"


def _sse(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk)}\n\n"
