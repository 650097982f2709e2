"""One backend group as the router sees it: health, last stats and load; the gRPC worker kind."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gearshift.operator.router.config import GroupSpec
from gearshift.operator.router.policy_control import (
    DECISION_METADATA,
    PolicyControl,
    RequestPlanning,
)
from gearshift.operator.router.room_queue import RoomQueue
from gearshift.v1 import policy_pb2, worker_pb2, worker_pb2_grpc
from gearshift.worker.server import auth

log = logging.getLogger(__name__)

# The worker's health status is reported under its gRPC service's full name.
HEALTH_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
# Keepalive pings notice a worker that died without closing its connections (a lost node),
# so no stream waits forever on it.
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 << 20),
]


@dataclass
class GroupLoad:
    """Tokens this router has sent to the group and not yet seen finish.

    The outstanding tokens of a request are its prompt until the first token comes back,
    plus what is left of its max_tokens (DESIGN.md: routing by load).
    """

    in_flight: int = 0
    outstanding_tokens: int = 0
    # What the worker reported beyond this router's own requests at the last poll (other
    # router replicas, requests the worker still counts): added to the local figure.
    others: int = 0


class Group(ABC):
    """One backend group as the router sees it: health, last stats and load.

    Subclasses own the transport (WorkerGroup: gearshift.v1.Worker over gRPC; OpenAIGroup in
    openai_backend.py: an OpenAI-compatible HTTP server) and fill `healthy`, `stats` and
    `message` in `poll`.
    """

    def __init__(
        self, spec: GroupSpec, rpc_timeout_s: float, token: auth.TokenSource | None = None
    ) -> None:
        self.spec = spec
        self.rpc_timeout_s = rpc_timeout_s
        # The control token (worker/server/auth.py), for subclasses' calls; read per call so a
        # rotated Secret is picked up.
        self.token = token
        self.load = GroupLoad()
        # The engine replicas behind the endpoint when it reports several (WorkerStats.replicas:
        # a SiDP group): each is routed to on its own load; the group stays one failure domain.
        self.replicas: list[GroupLoad] = []
        self.healthy = False
        self.draining = False
        self.removed = False  # gone from the configuration; closed once idle
        self.stats: worker_pb2.WorkerStats | None = None
        self.message = "not polled yet"
        self.last_poll = 0.0
        self.finished = asyncio.Event()  # set whenever in_flight drops to 0
        # Requests waiting for room on the group (Tetris: decode KV), planned again each poll.
        self.room = RoomQueue()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def serving(self) -> bool:
        """New requests may go here: healthy, answering its stats poll, not drained or removed."""
        return self.healthy and not self.draining and not self.removed

    @property
    def score(self) -> int:
        return self.load.outstanding_tokens + self.load.others

    def replica_score(self, replica: int) -> int:
        load = self.replicas[replica]
        return load.outstanding_tokens + load.others

    def _track_replicas(self, stats: worker_pb2.WorkerStats) -> None:
        """Follow the replicas the worker reports: their count (a restarted group may differ)
        and what each holds beyond this router's own requests."""
        if len(self.replicas) != len(stats.replicas):
            self.replicas = [GroupLoad() for _ in stats.replicas]
        for load, reported in zip(self.replicas, stats.replicas, strict=True):
            load.others = max(0, reported.outstanding_tokens - load.outstanding_tokens)

    def _replica(self, replica: int | None) -> GroupLoad | None:
        if replica is None or replica >= len(self.replicas):
            return None
        return self.replicas[replica]

    @abstractmethod
    async def poll(self) -> None:
        """Refresh `healthy`, `stats` and `message` from the backend."""

    async def close(self) -> None:
        self.removed = True

    def _set_up(self) -> None:
        if not self.healthy:
            log.info("group %s at %s is serving", self.name, self.spec.address)
        self.healthy, self.message, self.last_poll = True, "", time.monotonic()

    def _set_down(self, message: str) -> None:
        if self.healthy:
            log.warning("group %s at %s is down: %s", self.name, self.spec.address, message)
        self.healthy, self.message, self.last_poll = False, message, time.monotonic()

    def mark_failed(self, message: str) -> None:
        """A request saw the group fail: stop routing to it until a poll says otherwise."""
        self._set_down(message)

    async def run_poller(self, interval_s: float) -> None:
        while not self.removed:
            await self.poll()
            self.polled()
            await asyncio.sleep(interval_s)

    def polled(self) -> None:
        """After each stats poll: plan the requests waiting for room again, oldest first; a
        group that stopped serving sends them to another group (or an error)."""
        if self.serving:
            self.room.pump()
        elif self.room:
            self.room.fail_all(
                f"group {self.name} stopped serving while the request waited for room "
                f"({self.message or 'draining or removed'})"
            )

    def add(self, tokens: int, replica: int | None = None) -> None:
        for load in (self.load, self._replica(replica)):
            if load is not None:
                load.in_flight += 1
                load.outstanding_tokens += tokens
        self.finished.clear()

    def consume(self, tokens: int, replica: int | None = None) -> None:
        for load in (self.load, self._replica(replica)):
            if load is not None:
                load.outstanding_tokens = max(0, load.outstanding_tokens - tokens)

    def done(self, tokens_left: int, replica: int | None = None) -> None:
        self.consume(tokens_left, replica)
        for load in (self.load, self._replica(replica)):
            if load is not None:
                load.in_flight = max(0, load.in_flight - 1)
        if self.load.in_flight == 0:
            self.finished.set()


class WorkerGroup(Group):
    """A client of one group leader's Worker service, polled for health and stats."""

    def __init__(
        self, spec: GroupSpec, rpc_timeout_s: float, token: auth.TokenSource | None = None
    ) -> None:
        super().__init__(spec, rpc_timeout_s, token)
        self.channel = grpc.aio.insecure_channel(spec.address, options=CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.control = PolicyControl()  # the policy's router-side controller, if it has one
        self.planning = RequestPlanning()  # the policy's per-request planner, if it has one

    @property
    def metadata(self) -> auth.Metadata | None:
        """The control token on every Worker call (health checks are open)."""
        return auth.call_metadata(self.token)

    async def poll(self) -> None:
        """One health check and GetStats, each bounded by rpc_timeout_s."""
        try:
            health = await self._health.Check(
                health_pb2.HealthCheckRequest(service=HEALTH_SERVICE), timeout=self.rpc_timeout_s
            )
            if health.status != health_pb2.HealthCheckResponse.SERVING:
                self._set_down("the worker reports NOT_SERVING (loading or stopping)")
                return
            stats = await self.stub.GetStats(
                worker_pb2.GetStatsRequest(), timeout=self.rpc_timeout_s, metadata=self.metadata
            )
        except grpc.aio.AioRpcError as exc:
            self._set_down(f"{exc.code().name}: {exc.details()}")
            return
        self.stats = stats
        self.load.others = max(0, stats.outstanding_tokens - self.load.outstanding_tokens)
        self._track_replicas(stats)
        self._set_up()
        decision = self.control.decide(stats)
        if decision is not None:
            await self._send_decision(decision)

    async def _send_decision(self, policy: policy_pb2.Policy) -> None:
        """A controller's decision to the worker (not a configuration change: see
        policy_control.py); if it does not arrive, a new controller starts from the mode the
        group reports at the next poll."""
        try:
            reply = await self.stub.ApplyPolicy(
                worker_pb2.ApplyPolicyRequest(policy=policy),
                timeout=self.rpc_timeout_s,
                metadata=(*(self.metadata or ()), DECISION_METADATA),
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("group %s: controller decision not sent: %s", self.name, exc.details())
            self.control = PolicyControl()  # start again from the mode the group reports
            return
        if reply.applied:
            log.info("group %s: controller decision applied: %s", self.name, policy)
        else:
            log.warning("group %s: controller decision refused: %s", self.name, reply.message)
            self.control = PolicyControl()

    async def close(self) -> None:
        self.removed = True
        with contextlib.suppress(Exception):
            await self.channel.close()


@dataclass
class Lease:
    """One request's claim on a group; its outstanding tokens shrink as tokens arrive."""

    group: Group
    prompt_tokens: int
    max_tokens: int
    replica: int | None = None  # the engine replica it runs on, in a replica group
    remaining: int = field(init=False)
    first: bool = field(default=True, init=False)
    released: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.remaining = self.prompt_tokens + self.max_tokens
        self.group.add(self.remaining, self.replica)

    def on_tokens(self, n: int) -> None:
        # The first token also means the prompt is computed.
        used = min(self.remaining, n + (self.prompt_tokens if self.first else 0))
        self.first = False
        self.remaining -= used
        self.group.consume(used, self.replica)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.group.done(self.remaining, self.replica)
            self.remaining = 0
