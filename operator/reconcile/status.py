"""The InferenceDeployment's status from one reconcile pass. Pure.

`Ready` means requests are being served: the router's GetStatus reports enough groups serving.
Pods merely running do not make a deployment Ready.
"""

from __future__ import annotations

import datetime as dt
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gearshift.operator.reconcile import names, restarts


@dataclass(frozen=True)
class GroupReport:
    name: str
    index: int
    ready: bool
    gear: str = ""
    revision: str = ""
    current: bool = True
    surge: bool = False
    restarts: int = 0
    last_restart: dt.datetime | None = None
    message: str = ""

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "index": self.index,
            "ready": self.ready,
            "gear": self.gear,
            "revision": self.revision,
            "restarts": self.restarts,
        }
        if self.surge:
            out["surge"] = True
        if self.last_restart is not None:
            out["lastRestartTime"] = restarts.format_time(self.last_restart)
        if self.message:
            out["message"] = self.message
        return out


@dataclass(frozen=True)
class PassResult:
    """What one pass saw and did, for the conditions."""

    replicas: int
    max_unavailable: int
    groups: list[GroupReport]
    router_error: str = ""  # "" when the router's Admin API answered
    scaling: bool = False
    rolling: bool = False
    gave_up: list[str] = field(default_factory=list)  # group messages at the restart cap
    restarting: list[str] = field(default_factory=list)  # groups restarting or in back-off
    policy_error: str = ""  # live policy apply failure
    spec_error: str = ""  # the spec is invalid or not runnable: nothing is rendered
    spec_field: str = ""  # the field spec_error is about, e.g. "spec.policy.static.pp"
    plan_waiting: str = ""  # policy: auto has no plan to run yet (planning, or timed out)
    plan_error: str = ""  # policy: auto's planner ran past its timeout or died; retried later
    plan_error_reason: str = "PlannerTimedOut"  # why plan_error: PlannerTimedOut, PlannerCrashed
    plan_reason: str = "Planning"  # why plan_waiting: Planning, or Calibrating (auto.calibrate)


def condition(
    previous: list[dict[str, Any]],
    type_: str,
    ok: bool,
    reason: str,
    message: str,
    now: dt.datetime,
    generation: int,
) -> dict[str, Any]:
    """A condition whose lastTransitionTime moves only when its status flips."""
    status = "True" if ok else "False"
    before = next((c for c in previous if c.get("type") == type_), None)
    since = (
        before["lastTransitionTime"]
        if before and before.get("status") == status and before.get("lastTransitionTime")
        else restarts.format_time(now)
    )
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def field_reason(field: str) -> str:
    """A condition reason naming a spec field: "spec.policy.static.pp" -> "SpecPolicyStaticPp".

    Kubernetes reasons are CamelCase words (no dots); the message carries the field verbatim.
    """
    words = [w for w in re.split(r"[^A-Za-z0-9]+", field) if w]
    return "".join(w[0].upper() + w[1:] for w in words) or "InvalidSpec"


def _gear(groups: list[GroupReport]) -> str:
    gears = Counter(g.gear for g in groups if g.ready and g.gear)
    if not gears:
        return ""
    return next(iter(gears)) if len(gears) == 1 else ",".join(sorted(gears))


def build(
    result: PassResult,
    *,
    name: str,
    policy_kind: str,
    endpoint: str,
    generation: int,
    previous: dict[str, Any],
    now: dt.datetime,
    auto: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole status object for this pass (``auto``: policy: auto's choice; ``model``: the
    hf:// commit every pod downloads; None removes either)."""
    prev = list(previous.get("conditions") or [])
    base = [g for g in result.groups if not g.surge]
    serving = sum(g.ready for g in result.groups)
    need = max(1, result.replicas - result.max_unavailable)

    if result.spec_error:
        ready = (False, "InvalidSpec", result.spec_error)
    elif result.plan_waiting:
        why = result.plan_error_reason if result.plan_error else result.plan_reason
        ready = (False, why, result.plan_waiting)
    elif result.replicas == 0:
        ready = (False, "ScaledToZero", "spec.replicas is 0")
    elif result.router_error:
        ready = (False, "RouterUnavailable", f"router Admin API: {result.router_error}")
    elif serving >= need:
        ready = (True, "Serving", f"{serving}/{result.replicas} groups serving")
    else:
        ready = (
            False,
            "GroupsNotServing",
            f"{serving}/{result.replicas} groups serving, {need} needed",
        )

    settled = (
        len(base) == result.replicas
        and all(g.current and g.ready for g in base)
        and not any(g.surge for g in result.groups)
    )
    if result.spec_error:
        progressing = (False, "InvalidSpec", result.spec_error)
    elif result.plan_waiting:
        progressing = (
            (False, result.plan_error_reason, result.plan_waiting)
            if result.plan_error
            else (True, result.plan_reason, result.plan_waiting)
        )
    elif result.scaling:
        progressing = (True, "Scaling", f"{len(base)} groups, {result.replicas} desired")
    elif result.rolling or any(not g.current for g in base):
        outdated = sum(not g.current for g in base)
        progressing = (True, "RollingOut", f"{outdated} groups on an old revision")
    elif not settled:
        progressing = (True, "WaitingForGroups", f"{serving}/{result.replicas} groups serving")
    else:
        progressing = (False, "Complete", "every group runs the current revision and serves")

    if result.spec_error:
        degraded = (True, "InvalidSpec", result.spec_error)
    elif result.plan_error:
        degraded = (True, result.plan_error_reason, result.plan_error)
    elif result.gave_up:
        degraded = (True, "GroupRestartLimit", "; ".join(result.gave_up))
    elif result.restarting:
        degraded = (True, "GroupRestarting", "; ".join(result.restarting))
    elif result.policy_error:
        degraded = (True, "PolicyNotApplied", result.policy_error)
    else:
        degraded = (False, "AsExpected", "")

    # InvalidSpec (KServe's and LWS's way to say "this resource cannot be run as written"):
    # True names the field in its reason and says why in its message.
    if result.spec_error:
        invalid = (True, field_reason(result.spec_field or "spec"), result.spec_error)
    else:
        invalid = (False, "SpecAccepted", "")

    conditions = [
        condition(prev, "Ready", *ready, now=now, generation=generation),
        condition(prev, "Progressing", *progressing, now=now, generation=generation),
        condition(prev, "Degraded", *degraded, now=now, generation=generation),
        condition(prev, "InvalidSpec", *invalid, now=now, generation=generation),
    ]
    return {
        "observedGeneration": generation,
        "replicas": len(base),
        "readyReplicas": serving,
        "readyGroups": f"{serving}/{result.replicas}",
        "selector": names.scale_selector(name),
        "policy": policy_kind,
        "gear": _gear(result.groups),
        "endpoint": endpoint,
        "groups": [g.to_status() for g in sorted(result.groups, key=lambda g: g.index)],
        "conditions": conditions,
        "auto": auto,
        "model": model,
    }


def previous_restarts(previous: dict[str, Any]) -> dict[str, restarts.GroupRestartState]:
    """Restart counters per group name, as the last pass left them in status."""
    out = {}
    for g in previous.get("groups") or []:
        out[g.get("name", "")] = restarts.GroupRestartState(
            restarts=int(g.get("restarts") or 0),
            last_restart=restarts.parse_time(g.get("lastRestartTime")),
        )
    return out
