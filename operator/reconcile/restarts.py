"""When a failing pod restarts its whole group, with bounded exponential back-off. Pure.

One rank that crashes (or that the kubelet restarts alone) leaves the other ranks of its engine
waiting in a collective forever, so the operator replaces all of the group's pods together. The
attempts are spaced by the spec's back-off and stop at maxRestarts, which status reports.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from gearshift.operator.reconcile.spec import RestartPolicy

# Waiting reasons that a restart does not cure; they are reported, not acted on.
_NOT_CURED_BY_RESTART = {"ImagePullBackOff", "ErrImagePull", "InvalidImageName"}


@dataclass(frozen=True)
class GroupRestartState:
    """What status.groups[] remembers about a group's restarts."""

    restarts: int = 0
    last_restart: dt.datetime | None = None


@dataclass(frozen=True)
class RestartDecision:
    action: str  # "none" | "restart" | "wait" | "give-up"
    reason: str = ""
    wait_seconds: float = 0.0


def pod_failure(pod: dict[str, Any]) -> str:
    """Why this pod counts as failed ("" when it does not)."""
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        return f"pod {name} failed ({status.get('reason') or 'phase Failed'})"
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in _NOT_CURED_BY_RESTART:
            continue
        if int(cs.get("restartCount") or 0) > 0:
            return f"pod {name}: container {cs.get('name')} restarted {cs['restartCount']} times"
        terminated = (cs.get("state") or {}).get("terminated") or {}
        if terminated and int(terminated.get("exitCode") or 0) != 0:
            return f"pod {name}: container {cs.get('name')} exited {terminated['exitCode']}"
    return ""


def decide(
    pods: list[dict[str, Any]],
    state: GroupRestartState,
    policy: RestartPolicy,
    now: dt.datetime,
) -> RestartDecision:
    """Whether to replace the group's pods now, later, or never."""
    if policy.type == "None":
        return RestartDecision("none")
    reasons = [r for r in (pod_failure(p) for p in pods if not _terminating(p)) if r]
    if not reasons:
        return RestartDecision("none")
    reason = reasons[0]
    if state.restarts >= policy.max_restarts:
        return RestartDecision("give-up", f"{reason}; gave up after {state.restarts} restarts")
    if state.restarts > 0 and state.last_restart is not None:
        due = state.last_restart + dt.timedelta(seconds=policy.backoff(state.restarts - 1))
        if now < due:
            return RestartDecision("wait", reason, (due - now).total_seconds())
    return RestartDecision("restart", reason)


def settled(state: GroupRestartState, policy: RestartPolicy, now: dt.datetime) -> bool:
    """A group that has run since its last restart for the longest back-off starts over at 0."""
    if state.last_restart is None:
        return state.restarts == 0
    return (now - state.last_restart).total_seconds() >= policy.max_backoff_seconds


def _terminating(pod: dict[str, Any]) -> bool:
    return bool(pod.get("metadata", {}).get("deletionTimestamp"))


def parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def format_time(value: dt.datetime) -> str:
    return value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
