"""Generation over HTTP: /v1/completions and /v1/chat/completions, whole or streamed."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gearshift.operator.router import chat_render, completion_render
from gearshift.operator.router.http_streaming import answer
from gearshift.operator.router.openapi import GENERATION_RESPONSES
from gearshift.operator.router.preparation import Preparation
from gearshift.operator.router.protocol import ChatCompletionRequest, CompletionRequest


class GenerationRoutes:
    """Each request is prepared (``preparation.py``), then answered as its body asks."""

    def __init__(self, preparation: Preparation) -> None:
        self.preparation = preparation

    def api(self) -> APIRouter:
        """The routes, for ``FastAPI.include_router``."""
        api = APIRouter()
        for path, endpoint in (
            ("/v1/completions", self.completions),
            ("/v1/chat/completions", self.chat_completions),
        ):
            api.add_api_route(path, endpoint, methods=["POST"], responses=GENERATION_RESPONSES)
        return api

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        view, choices = await self.preparation.completion(body)
        chunks = functools.partial(completion_render.chunks, view, choices)
        whole = functools.partial(completion_render.whole, view, choices)
        return await answer(request, choices, body.stream, chunks, whole)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        view, choices = await self.preparation.chat(body)
        chunks = functools.partial(chat_render.chunks, view, choices)
        whole = functools.partial(chat_render.whole, view, choices)
        return await answer(request, choices, body.stream, chunks, whole)
