"""Router-side controllers of the policies of the groups it serves, as each kind's spec names
them (``PolicySpec.router_controller`` / ``request_planner``, torch-free classes).

A policy whose decision needs every replica's view (SiDP's WaS/CaS mode, §4.3) names a
controller. ``WorkerGroup.poll`` feeds it each stats poll; a decision goes to the worker as
an ApplyPolicy call marked with ``DECISION_METADATA``: the worker hands it to the group (at one
step boundary on every replica) without changing its configured policy, so GetStatus still shows
what the operator asked for (e.g. ``mode: AUTO``). A policy that decides per request (Tetris: a
chunk plan and a decode instance, §5.1) names a request planner.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gearshift.v1 import policy_fields, policy_pb2, worker_pb2
from gearshift.worker.policies import kinds

DECISION_METADATA = ("gearshift-controller-decision", "1")


class GroupController(Protocol):
    def decide(
        self, policy: policy_pb2.Policy, policy_stats: Mapping[str, float]
    ) -> policy_pb2.Policy | None: ...


class NoRoomYet(ValueError):
    """The group has no room for the request now but would once it frees some (Tetris: no
    decode instance has the KV slots free): the router queues it (``room_queue.py``)."""


class NeverFits(ValueError):
    """The request needs more than the group holds even when empty (Tetris: more KV slots than
    any decode instance has): the router refuses it at once with a 400."""


class RequestPlanner(Protocol):
    """Per-request decisions a policy takes in the router (Tetris: each request's chunk plan
    and decode instance, §5.1); raises ValueError naming why a request cannot be planned
    (``NoRoomYet``: not now, it waits; ``NeverFits``: never)."""

    def plan_into(
        self, stats: worker_pb2.WorkerStats, wire: worker_pb2.WorkerGenerateRequest, max_tokens: int
    ) -> None: ...


def _made(kind: str, hook: str) -> Any:
    """A new instance of the class ``kind``'s spec names for ``hook``, or None."""
    spec = kinds.spec_of(kind)
    ref = getattr(spec, hook) if spec is not None else ""
    return kinds.load_ref(ref)() if ref else None


def _kind(stats: worker_pb2.WorkerStats | None) -> str:
    return policy_fields.kind_of(stats.policy) if stats is not None else ""


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
        kind = _kind(stats)
        if kind != self.kind:
            self.kind = kind
            self.planner = _made(kind, "request_planner")
        if self.planner is not None and stats is not None:
            self.planner.plan_into(stats, wire, max_tokens)


@dataclass
class PolicyControl:
    """One group's controller, made anew when the group's policy kind changes."""

    kind: str = ""
    controller: GroupController | None = None

    def decide(self, stats: worker_pb2.WorkerStats) -> policy_pb2.Policy | None:
        kind = _kind(stats)
        if kind != self.kind:
            self.kind = kind
            self.controller = _made(kind, "router_controller")
        if self.controller is None:
            return None
        return self.controller.decide(stats.policy, stats.policy_stats)
