"""Router-side controllers of the policies of the groups it serves, by policy kind.

A policy whose decision needs every replica's view (SiDP's WaS/CaS mode, §4.3) registers a
controller here. ``WorkerGroup.poll`` feeds it each stats poll; a decision goes to the worker as
an ApplyPolicy call marked with ``DECISION_METADATA``: the worker hands it to the group (at one
step boundary on every replica) without changing its configured policy, so GetStatus still shows
what the operator asked for (e.g. ``mode: AUTO``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from gearshift.operator.router.sidp_controller import ServedGroupControl
from gearshift.operator.router.tetris_requests import TetrisRequestPlanner
from gearshift.v1 import policy_pb2, worker_pb2

DECISION_METADATA = ("gearshift-controller-decision", "1")


class GroupController(Protocol):
    def decide(
        self, policy: policy_pb2.Policy, policy_stats: Mapping[str, float]
    ) -> policy_pb2.Policy | None: ...


CONTROLLERS: dict[str, Callable[[], GroupController]] = {"sidp": ServedGroupControl}


class RequestPlanner(Protocol):
    """Per-request decisions a policy takes in the router (Tetris: each request's chunk plan
    and decode instance, §5.1); raises ValueError naming why a request cannot be planned."""

    def plan_into(
        self, stats: worker_pb2.WorkerStats, wire: worker_pb2.WorkerGenerateRequest, max_tokens: int
    ) -> None: ...


REQUEST_PLANNERS: dict[str, Callable[[], RequestPlanner]] = {"tetris": TetrisRequestPlanner}


@dataclass
class RequestPlanning:
    """One group's request planner, made anew when the group's policy kind changes."""

    kind: str = ""
    planner: RequestPlanner | None = None

    def plan_into(
        self,
        stats: worker_pb2.WorkerStats | None,
        wire: worker_pb2.WorkerGenerateRequest,
        max_tokens: int,
    ) -> None:
        kind = (stats.policy.WhichOneof("kind") if stats is not None else None) or ""
        if kind != self.kind:
            self.kind = kind
            factory = REQUEST_PLANNERS.get(kind)
            self.planner = factory() if factory is not None else None
        if self.planner is not None and stats is not None:
            self.planner.plan_into(stats, wire, max_tokens)


@dataclass
class PolicyControl:
    """One group's controller, made anew when the group's policy kind changes."""

    kind: str = ""
    controller: GroupController | None = None

    def decide(self, stats: worker_pb2.WorkerStats) -> policy_pb2.Policy | None:
        kind = stats.policy.WhichOneof("kind") or ""
        if kind != self.kind:
            self.kind = kind
            factory = CONTROLLERS.get(kind)
            self.controller = factory() if factory is not None else None
        if self.controller is None:
            return None
        return self.controller.decide(stats.policy, stats.policy_stats)
