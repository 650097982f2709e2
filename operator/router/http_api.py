"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, models, tokenizer, probes.

The app is put together here from its route groups, each a module with its dependencies
passed in: ``http_probes.py``, ``http_models.py``, ``http_generation.py`` (requests prepared by
``preparation.py``), errors answered by ``http_errors.py``.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gearshift.operator.router import cache_salt, errors
from gearshift.operator.router.core import Router
from gearshift.operator.router.http_errors import install_error_handlers
from gearshift.operator.router.http_generation import GenerationRoutes
from gearshift.operator.router.http_models import ModelRoutes
from gearshift.operator.router.http_probes import VERSION, ProbeRoutes
from gearshift.operator.router.openapi import openapi_400
from gearshift.operator.router.preparation import Preparation

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


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


def build_app(router: Router, preparation: Preparation) -> FastAPI:
    """The HTTP app of one router."""
    app = FastAPI(title="Gearshift", version=VERSION, docs_url=None, redoc_url=None)
    app.openapi = openapi_400(app)  # type: ignore[method-assign]
    install_error_handlers(app)
    probes = ProbeRoutes(router.pool, lambda: router.accepting, router.metrics.registry)
    app.include_router(probes.api())
    app.include_router(ModelRoutes(router.config, router.created, router.pool, preparation).api())
    app.include_router(GenerationRoutes(preparation).api())
    return app
