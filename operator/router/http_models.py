"""The model and its tokenizer over HTTP: /v1/models, /tokenize and /detokenize."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from gearshift.operator.router import openai_format
from gearshift.operator.router.config import RouterConfig
from gearshift.operator.router.openapi import ERROR_RESPONSES
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
        api.add_api_route("/tokenize", self.tokenize, methods=["POST"], responses=ERROR_RESPONSES)
        api.add_api_route(
            "/detokenize", self.detokenize, methods=["POST"], responses=ERROR_RESPONSES
        )
        return api

    async def models(self) -> dict[str, Any]:
        cfg = self.config
        return openai_format.model_list(
            cfg.model_name, cfg.model_path, self.created, self.pool.max_model_len
        )

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        return await self.preparation.tokenize(body)

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        return await self.preparation.detokenize(body)
