"""`gearshift worker`: the gRPC server of one group leader (health only on other pods).

Health (grpc.health.v1, service "gearshift.v1.Worker") answers NOT_SERVING while the model loads
and SERVING once every rank has joined. The bound port goes to `--ready-file` (JSON, written
atomically) so `gearshift serve` can run workers on OS-picked ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gearshift.v1 import worker_pb2, worker_pb2_grpc
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.server import auth
from gearshift.worker.server.engine_process import EngineStartError
from gearshift.worker.server.handle import EngineHandle
from gearshift.worker.server.runtimes import GroupEndpoint, run_follower_node, runtime_for
from gearshift.worker.server.service import WorkerInfo, WorkerService
from gearshift.worker.server.settings import WorkerSettings
from gearshift.worker.server.undecodable import RefuseUndecodable

log = logging.getLogger(__name__)

# The worker's health status is reported under its gRPC service's full name.
HEALTH_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
# Keepalive pings let the router notice a dead or unreachable worker during a long stream.
GRPC_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


def write_ready_file(path: Path, payload: dict[str, object]) -> None:
    """Write JSON atomically: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload), encoding="utf-8")
    tmp.replace(path)


class WorkerProcess:
    """The server, the engine loop and the signals of one worker process."""

    def __init__(self, settings: WorkerSettings, endpoint: GroupEndpoint | None = None) -> None:
        self.settings = settings
        self.endpoint = endpoint  # a group leader's, made (and maybe started) by run_worker
        self.stop = asyncio.Event()
        self.exit_code = 0
        self.health = health.aio.HealthServicer()
        self.service = WorkerService()
        self.server = grpc.aio.server(
            options=GRPC_OPTIONS,
            interceptors=[
                *auth.interceptors(
                    auth.token_source(settings.control_token, settings.control_token_file),
                    f"worker {settings.group_name}",
                    settings.insecure_no_auth,
                ),
                RefuseUndecodable(),  # after the token check: strangers are refused unparsed
            ],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if settings.is_leader:
            worker_pb2_grpc.add_WorkerServicer_to_server(self.service, self.server)
        self.port = 0
        self._parent_watch: asyncio.Task[None] | None = None
        self._admission_task: asyncio.Future[None] | None = None

    def _on_stop_admission(self) -> None:
        self._admission_task = asyncio.ensure_future(self._stop_admission())

    async def _stop_admission(self) -> None:
        if self.service.admitting:
            log.info("worker %s: no longer admitting requests", self.settings.group_name)
        self.service.admitting = False
        await self._set_health(False)

    async def _drain(self, engine: EngineHandle) -> None:
        """Wait (bounded) for running requests; the router drains first when it stops a group."""
        await self._stop_admission()
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.service.active and engine.dead is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.service.active:
            log.warning("stopping with %d requests still running", len(self.service.active))

    async def _set_health(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", HEALTH_SERVICE):
            await self.health.set(name, status)

    async def run(self) -> int:
        s = self.settings
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        # preStop: stop admission first (the router sees NOT_SERVING and routes elsewhere).
        loop.add_signal_handler(
            signal.SIGUSR1, lambda: asyncio.ensure_future(self._stop_admission())
        )
        if s.exit_with_parent:
            self._parent_watch = loop.create_task(self._watch_parent(os.getppid()))
        self.port = self.server.add_insecure_port(f"{s.host}:{s.port}")
        await self._set_health(False)
        await self.server.start()
        log.info("worker %s: gRPC on %s:%d, loading %s", s.group_name, s.host, self.port, s.model)
        try:
            if s.is_leader:
                await self._serve_leader()
            else:
                await self._serve_follower()
        finally:
            await self._set_health(False)
            await self.server.stop(grace=5)
        return self.exit_code

    async def _serve_leader(self) -> None:
        s = self.settings
        engine = self.endpoint or leader_endpoint(s)
        load = asyncio.ensure_future(engine.start())
        stopped = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait([load, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not load.done():
            log.warning("stopped while loading the model")
            load.cancel()
            await engine.stop(timeout_s=5)
            return
        try:
            load.result()
        except EngineStartError as exc:
            log.error("cannot start the engine: %s", exc)
            self.exit_code = 2
            await engine.stop(timeout_s=5)
            return
        info = WorkerInfo(
            model=s.served_model_name,
            max_model_len=engine.max_model_len,
            ranks=s.ranks,
            revision=s.revision,
            max_requests=s.engine.max_num_seqs + s.max_waiting,
        )
        self.service.attach(engine, info)
        await self._set_health(True)
        self._ready()
        watch = asyncio.ensure_future(self._watch_engine(engine))
        try:
            await self.stop.wait()
            await self._drain(engine)
        finally:
            watch.cancel()
            await self._set_health(False)
            # Streams still running end with FINISH_REASON_ABORT.
            await engine.stop()

    async def _serve_follower(self) -> None:
        await self._set_health(True)
        self._ready()
        node = asyncio.ensure_future(asyncio.to_thread(run_follower_node, self.settings))
        stopped = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait([node, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if node.done():
            self.exit_code = node.result()
        else:
            os._exit(0)  # the ranks die with this process (their parent-death signal)

    async def _watch_engine(self, engine: EngineHandle) -> None:
        """A dead group makes the process exit non-zero, so the operator restarts the group."""
        while True:
            await asyncio.sleep(0.2)  # part of the 5 s in which a hung rank turns /ready 503
            if engine.dead is not None or not engine.alive:
                log.error("worker group failed: %s", engine.dead or "the engine stopped")
                await self._set_health(False)
                await asyncio.sleep(1.0)  # let in-flight streams deliver their errors
                self.exit_code = 1
                self.stop.set()
                return

    async def _watch_parent(self, parent: int) -> None:
        while True:
            await asyncio.sleep(0.5)
            if os.getppid() != parent:
                log.warning("parent process %d is gone; stopping", parent)
                self.stop.set()
                return

    def _ready(self) -> None:
        s = self.settings
        if s.ready_file is not None:
            write_ready_file(
                s.ready_file,
                {"port": self.port, "pid": os.getpid(), "group": s.group_name, "time": time.time()},
            )
        log.info("worker %s serving on port %d", s.group_name, self.port)


def leader_endpoint(settings: WorkerSettings) -> GroupEndpoint:
    """The group leader's endpoint for the policy's runtime (not started)."""
    return runtime_for(make_policy(settings.policy, settings.ranks)).endpoint(settings)


def run_worker(settings: WorkerSettings) -> int:
    """Run until SIGTERM/SIGINT (or parent death with exit_with_parent); the exit code."""
    # First thing, before gRPC, asyncio or the engine loop start a thread: an endpoint whose
    # engine process can be forked from this one (ProcessEngine.fork_now) starts it now.
    endpoint = leader_endpoint(settings) if settings.is_leader else None
    fork_now = getattr(endpoint, "fork_now", None)
    forked = fork_now is not None and fork_now()

    async def main() -> int:
        # grpc.aio objects bind to the running loop: build them inside it.
        return await WorkerProcess(settings, endpoint).run()

    try:
        with contextlib.suppress(KeyboardInterrupt):
            return asyncio.run(main())
        return 130
    finally:
        if forked:  # a worker that failed before serving (e.g. its port is taken) leaves none
            endpoint.kill()  # type: ignore[union-attr]
