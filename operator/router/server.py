"""One router process: HTTP (uvicorn) and gRPC (Generation, Admin) on one asyncio loop.

Shutdown drains: new requests get 503, those in flight finish (bounded), then the servers stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import uvicorn

from gearshift.operator.router import config as config_mod
from gearshift.operator.router.admin import AdminService
from gearshift.operator.router.body_limit import BodyLimit
from gearshift.operator.router.config import RouterConfig
from gearshift.operator.router.core import Router
from gearshift.operator.router.grpc_api import GenerationService
from gearshift.operator.router.http_api import ApiKeyMiddleware, build_app
from gearshift.operator.router.lanes import PreparationLanes
from gearshift.operator.router.metrics import RouterMetrics
from gearshift.operator.router.openai_proxy import OpenAIProxy
from gearshift.operator.router.pool import GROUP_KINDS, GroupPool
from gearshift.operator.router.preparation import Preparation
from gearshift.operator.router.rejections import RejectionCounter
from gearshift.operator.router.trace_recorder import TraceRecorder
from gearshift.v1 import router_pb2_grpc
from gearshift.worker.model.registry import resolve_model_path
from gearshift.worker.policies import kinds
from gearshift.worker.server import auth
from gearshift.worker.server.undecodable import RefuseUndecodable
from gearshift.worker.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The process owner handles SIGTERM (drain first); uvicorn must not stop on its own.
        yield


@dataclass(frozen=True)
class BoundPorts:
    http: int
    grpc: int | None
    admin: int | None

    def as_ready(self) -> dict[str, object]:
        """The ready file's fields (--ready-file)."""
        return {
            "http_port": self.http,
            "grpc_port": self.grpc,
            "admin_port": self.admin,
            "pid": os.getpid(),
        }


def load_tokenizer(model_path: str) -> Tokenizer:
    """The tokenizer of the served model: a folder, a .gguf, or an embedded model's name."""
    return Tokenizer.from_path(resolve_model_path(model_path))


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class RouterServer:
    """Starts, reconfigures and drains one router."""

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self.router: Router | None = None
        self._http: _Uvicorn | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._grpc: list[grpc.aio.Server] = []
        self._reload_task: asyncio.Task[None] | None = None
        self._lanes: PreparationLanes | None = None
        self.ports: BoundPorts | None = None

    async def start(self) -> BoundPorts:
        cfg = self.config
        # The policy packages (entry points, GEARSHIFT_POLICY_PACKAGES), before any group's
        # stats or an Admin call carries one of their policies.
        kinds.specs()
        if cfg.backend not in GROUP_KINDS:
            raise config_mod.ConfigError(
                f"backend {cfg.backend!r} is not one of {', '.join(GROUP_KINDS)}"
            )
        if cfg.protect_metrics and not cfg.api_keys:
            raise config_mod.ConfigError(
                "protect metrics: /metrics can only be protected by an API key, and none is set"
            )
        if cfg.cache_salt_by_api_key and not cfg.api_keys:
            raise config_mod.ConfigError("cache salt by API key: needs API keys, and none is set")
        if any(not k.strip() for k in cfg.api_keys):
            raise config_mod.ConfigError("api keys: an empty or blank key would let anyone in")
        if not cfg.queue_timeout_s >= 0:
            raise config_mod.ConfigError(
                f"queue timeout (--queue-timeout) must be >= 0, got {cfg.queue_timeout_s}"
            )
        worker_token, admin_token = self._tokens()
        tokenizer = self._tokenizer
        if tokenizer is None:
            tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model_path)
        pool = GroupPool(
            cfg.max_requests_per_group,
            cfg.poll_interval_s,
            cfg.rpc_timeout_s,
            cfg.backend,
            worker_token,
            cfg.queue_timeout_s,
        )
        metrics = RouterMetrics(cfg.model_name, lambda: list(pool.groups.values()))
        if cfg.record_trace is not None:
            try:
                metrics.trace = TraceRecorder(cfg.record_trace)
            except OSError as exc:
                raise config_mod.ConfigError(
                    f"--record-trace: cannot write {cfg.record_trace}: {exc}"
                ) from exc
        router = self.router = Router(cfg, tokenizer, pool, metrics)
        await pool.configure(cfg.groups)

        # Shared by HTTP and gRPC; its processes start on the first large request.
        self._lanes = PreparationLanes(cfg.lanes, tokenizer, cfg.model_path)
        preparation = Preparation(router, self._lanes)
        app = build_app(router, preparation)
        if cfg.backend == "openai-http":  # generation is the backend's; see openai_proxy.py
            app.add_middleware(OpenAIProxy, preparation=preparation)
        app.add_middleware(BodyLimit, max_bytes=cfg.limits.max_body_bytes)
        app.add_middleware(
            ApiKeyMiddleware,
            keys=cfg.api_keys,
            protect_metrics=cfg.protect_metrics,
            salt_by_key=cfg.cache_salt_by_api_key,
        )
        # Added last, so outermost: it also sees the API-key middleware's 401s.
        app.add_middleware(RejectionCounter, metrics=metrics)
        sock = _listen(cfg.host, cfg.http_port)
        http_port = int(sock.getsockname()[1])
        self._http = _Uvicorn(
            uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        )
        self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]))
        for _ in range(200):
            if self._http.started or self._http_task.done():
                break
            await asyncio.sleep(0.025)
        if not self._http.started:
            raise RuntimeError(f"the HTTP server did not start on {cfg.host}:{http_port}")

        grpc_port = admin_port = None
        if cfg.grpc_port is not None:
            # The HTTP body cap is the gRPC message cap (RESOURCE_EXHAUSTED beyond it).
            size = cfg.limits.max_body_bytes
            server = grpc.aio.server(
                options=[("grpc.max_receive_message_length", size)],
                interceptors=[RefuseUndecodable()],  # bytes that are not the message: 400-like
            )
            router_pb2_grpc.add_GenerationServicer_to_server(
                GenerationService(router, preparation), server
            )
            grpc_port = server.add_insecure_port(f"{cfg.host}:{cfg.grpc_port}")
            await server.start()
            self._grpc.append(server)
        if cfg.admin_port is not None:
            server = grpc.aio.server(
                interceptors=[
                    *auth.interceptors(admin_token, "admin", cfg.insecure_no_auth),
                    RefuseUndecodable(),
                ]
            )
            router_pb2_grpc.add_AdminServicer_to_server(AdminService(router), server)
            admin_port = server.add_insecure_port(f"{cfg.admin_host}:{cfg.admin_port}")
            await server.start()
            self._grpc.append(server)
        if cfg.config_path is not None:
            self._reload_task = asyncio.create_task(self._reload_loop())
        self.ports = BoundPorts(http_port, grpc_port, admin_port)
        log.info(
            "router for %s: http %s:%d, grpc %s, admin %s, %d groups",
            cfg.model_name,
            cfg.host,
            http_port,
            grpc_port,
            admin_port,
            len(cfg.groups),
        )
        return self.ports

    def _tokens(self) -> tuple[auth.TokenSource | None, auth.TokenSource | None]:
        """The worker and admin token sources (files followed for rotation); fail closed."""
        cfg = self.config
        try:
            worker = auth.token_source(cfg.control_token, cfg.control_token_file)
            admin = auth.token_source(cfg.admin_token, cfg.admin_token_file)
            # openai-http groups may be servers that take no key (another gateway).
            if cfg.backend == "worker-grpc":
                auth.require(worker, "router → workers", cfg.insecure_no_auth)
            if cfg.admin_port is not None:
                auth.require(admin, "admin", cfg.insecure_no_auth)
        except auth.TokenError as exc:
            raise config_mod.ConfigError(str(exc)) from exc
        if worker is None and cfg.backend == "worker-grpc":
            log.warning("--insecure-no-auth: worker calls carry no control token")
        return worker, admin

    async def _reload_loop(self) -> None:
        """Follow router.json: the operator rewrites it when groups are added or removed."""
        assert self.config.config_path is not None and self.router is not None
        path, last = self.config.config_path, self.config.groups
        while True:
            await asyncio.sleep(self.config.reload_interval_s)
            try:
                groups = config_mod.parse_groups(config_mod.read_file(path).get("groups") or [])
            except config_mod.ConfigError as exc:
                log.warning("keeping the current groups: %s", exc)
                continue
            if groups != last:
                log.info("router.json changed: %d groups", len(groups))
                await self.router.pool.configure(groups)
            last = groups

    def stop_admission(self) -> None:
        """New requests get 503 and /ready turns false; those in flight go on."""
        if self.router is not None and self.router.accepting:
            log.info("no longer admitting requests")
            self.router.accepting = False

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Drain (bounded), then stop every server; safe to call twice."""
        timeout = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        if self.router is not None:
            left = await self.router.drain(timeout)
            if left:
                log.warning("stopping with %d requests still in flight", left)
        if self._reload_task is not None:
            self._reload_task.cancel()
        if self._http is not None and self._http_task is not None:
            self._http.should_exit = True
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._http_task, 10)
        for server in self._grpc:
            await server.stop(grace=1)
        self._grpc.clear()
        if self._lanes is not None:
            await asyncio.to_thread(self._lanes.close)
            self._lanes = None
        if self.router is not None:
            await self.router.pool.close()
            if self.router.metrics.trace is not None:
                self.router.metrics.trace.close()
