"""The model and its tokenizer over HTTP: /v1/models, /tokenize and /detokenize."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gearshift.operator.router import openai_format
from gearshift.operator.router.config import RouterConfig
from gearshift.operator.router.openapi import ERROR_RESPONSES, json_body
from gearshift.operator.router.pool import GroupPool
from gearshift.operator.router.preparation import Preparation
from gearshift.operator.router.protocol import DetokenizeRequest, TokenizeRequest


class ModelRoutes:
    """The served model's card and its tokenizer (vLLM's /tokenize and /detokenize)."""

    def __init__(
        self, config: RouterConfig, created: int, pool: GroupPool, preparation: Preparation
    ) -> None:
        self.config = config
        self.created = created  # the model card's creation time: the router's start
        self.pool = pool  # for the context length its workers report
        self.preparation = preparation

    def api(self) -> APIRouter:
        """The routes, for ``FastAPI.include_router``."""
        api = APIRouter()
        api.add_api_route("/v1/models", self.models)
        for path, endpoint, model in (
            ("/tokenize", self.tokenize, TokenizeRequest),
            ("/detokenize", self.detokenize, DetokenizeRequest),
        ):
            api.add_api_route(
                path,
                endpoint,
                methods=["POST"],
                responses=ERROR_RESPONSES,
                response_model=dict[str, Any],  # documented; the answer is encoded JSON
                openapi_extra=json_body(model),
            )
        return api

    async def models(self) -> dict[str, Any]:
        cfg = self.config
        return openai_format.model_list(
            cfg.model_name, cfg.model_path, self.created, self.pool.max_model_len
        )

    # Bodies are parsed, and answers encoded, in a preparation lane (preparation.py).
    async def tokenize(self, request: Request) -> Response:
        return Response(await self.preparation.tokenize(request), media_type="application/json")

    async def detokenize(self, request: Request) -> Response:
        answer = await self.preparation.detokenize(request)
        return Response(answer, media_type="application/json")
