"""Probes and metadata of the HTTP API: /health, /ready, /metrics and /version."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gearshift.operator.router.pool import GroupPool

VERSION = "0.1.0"


class ProbeRoutes:
    """Answers from the router's own state: no tokenizer, no worker call."""

    def __init__(
        self, pool: GroupPool, accepting: Callable[[], bool], registry: CollectorRegistry
    ) -> None:
        self.pool = pool
        self.accepting = accepting  # False while the router drains for shutdown
        self.registry = registry

    def api(self) -> APIRouter:
        """The routes, for ``FastAPI.include_router``."""
        api = APIRouter()
        api.add_api_route(
            "/health", self.health, response_class=Response, responses={200: {"content": None}}
        )
        api.add_api_route(
            "/ready",
            self.ready,
            responses={503: {"description": "Not serving (no group, or draining)."}},
        )
        api.add_api_route("/metrics", self.metrics, response_class=PlainTextResponse)
        api.add_api_route("/version", self.version)
        return api

    async def health(self) -> Response:
        return Response(status_code=200)

    async def ready(self) -> Response:
        serving = [g.name for g in self.pool.serving()]
        ok = bool(serving) and self.accepting()
        return JSONResponse({"ready": ok, "serving_groups": serving}, 200 if ok else 503)

    async def metrics(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def version(self) -> dict[str, str]:
        return {"version": VERSION}
