"""What a policy package says about its kind without torch: its message, its layout and its
rules (DESIGN.md: step contract). Each package's ``spec.py`` holds one ``PolicySpec`` named
``SPEC``; the registry reads it.

One spec is the source of the proto validation (``checks.py``), the worker's refusals, the CRD's
CEL rules (``operator/reconcile/crd_rules.py``), the router's per-kind behaviour (the classes it
names) and the flags. Its rules are ``rules.Expr``: Python evaluates them, CEL renders them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf.message import Message

from gearshift.worker.policies.rules import Expr


@dataclass(frozen=True)
class Check:
    """A rule the policy must satisfy (true: fine), with what it says when it does not.

    ``field`` is the proto path of the sub-field it is about ("decode", "was_cache_slots"), ""
    for the whole message; errors read ``policy.<kind>[.field]: message``."""

    rule: Expr
    message: str
    field: str = ""


@dataclass(frozen=True)
class ProtoSource:
    """Where a policy message's .proto lies (``root``-relative ``file``), so the CRD's field
    descriptions can quote its comments; gearshift.v1's own messages need none."""

    root: Path
    file: str


NodeCheck = Callable[[Any, int, int], str]


@dataclass(frozen=True)
class PolicySpec:
    """A policy kind: its message, layout, defaults and rules, and the classes that run it."""

    kind: str  # its key in spec.policy / --policy-config, and --policy's value
    message: type[Message]  # its proto message: built-in ones sit in gearshift.v1.Policy's oneof
    runtime: str  # "module:Class" of its worker-side ``Policy`` (imported only to run it)
    gpus: Expr  # the GPUs (ranks) its layout occupies, which must equal the group's
    gpus_field: str = ""  # the sub-message the layout rule names (seesaw: "prefill")
    # Defaults that depend on G or on other fields, by proto path, filled in this order after
    # the constant ``default_value`` options.
    derived: Mapping[str, Expr] = field(default_factory=dict)
    # Cross-field rules, reported together (the CRD rejects, the operator reports InvalidSpec).
    checks: tuple[Check, ...] = ()
    # What the gearshift engine cannot run although the schema allows it (`engine: vllm` may):
    # each refused on its own, naming its field.
    refusals: tuple[Check, ...] = ()
    # Why every rank of a group must share one node ("" when a group may span nodes).
    single_node: str = ""
    # With nodes > 1 (and not ``single_node``): why this layout cannot be spread over
    # ``f(message, ranks, nodes)`` nodes, "" when it can.
    node_check: NodeCheck | None = None
    world_field: str = "tp"  # the field a bare ``--world-size`` fills (flags.py)
    # Router-side classes, "module:Class", torch-free, made once per group that runs this kind:
    # a controller fed each stats poll (operator/router/policy_control.py: GroupController) and
    # a per-request planner (RequestPlanner).
    router_controller: str = ""
    request_planner: str = ""
    proto_source: ProtoSource | None = None

    def nodes_error(self, message: Any, ranks: int, nodes: int) -> str:
        """Why a group of ``ranks`` over ``nodes`` nodes cannot run; "" when it can."""
        if nodes <= 1:
            return ""
        if self.single_node:
            return (
                f"the {self.kind} policy keeps its groups on one node ({self.single_node}); "
                f"use nodes: 1, got {nodes}"
            )
        return self.node_check(message, ranks, nodes) if self.node_check is not None else ""
