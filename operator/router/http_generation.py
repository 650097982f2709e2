"""Generation over HTTP: /v1/completions and /v1/chat/completions, whole or streamed."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gearshift.operator.router import chat_render, completion_render
from gearshift.operator.router.http_streaming import answer
from gearshift.operator.router.openapi import GENERATION_RESPONSES, json_body
from gearshift.operator.router.preparation import Preparation
from gearshift.operator.router.protocol import ChatCompletionRequest, CompletionRequest


class GenerationRoutes:
    """Each request is prepared (``preparation.py``), then answered as its body asks."""

    def __init__(self, preparation: Preparation) -> None:
        self.preparation = preparation

    def api(self) -> APIRouter:
        """The routes, for ``FastAPI.include_router``."""
        api = APIRouter()
        for path, endpoint, model in (
            ("/v1/completions", self.completions, CompletionRequest),
            ("/v1/chat/completions", self.chat_completions, ChatCompletionRequest),
        ):
            api.add_api_route(
                path,
                endpoint,
                methods=["POST"],
                responses=GENERATION_RESPONSES,
                openapi_extra=json_body(model),
            )
        return api

    # The body is read as bytes and parsed in a preparation lane (preparation.py), not by
    # FastAPI on the event loop; `openapi_extra` still documents its schema.
    async def completions(self, request: Request) -> Response:
        view, choices, stream = await self.preparation.completion(request)
        chunks = functools.partial(completion_render.chunks, view, choices)
        whole = functools.partial(completion_render.whole, view, choices)
        return await answer(request, choices, stream, chunks, whole)

    async def chat_completions(self, request: Request) -> Response:
        view, choices, stream = await self.preparation.chat(request)
        chunks = functools.partial(chat_render.chunks, view, choices)
        whole = functools.partial(chat_render.whole, view, choices)
        return await answer(request, choices, stream, chunks, whole)
