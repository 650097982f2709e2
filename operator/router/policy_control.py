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
from gearshift.v1 import policy_pb2, worker_pb2

DECISION_METADATA = ("gearshift-controller-decision", "1")


class GroupController(Protocol):
    def decide(
        self, policy: policy_pb2.Policy, policy_stats: Mapping[str, float]
    ) -> policy_pb2.Policy | None: ...


CONTROLLERS: dict[str, Callable[[], GroupController]] = {"sidp": ServedGroupControl}


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
