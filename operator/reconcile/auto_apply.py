"""Whether ``policy: auto`` applies a new plan (issue 30, item 4). Pure: the running plan, the new
one, the deployment's rules and the time in; a decision and its reason out.

A plan after the first is a proposal. Either mode takes it when the running layout no longer
runs on the group (spec.group was resized: there is nothing to keep). Otherwise ``apply:
Recommend`` never takes it, and ``apply: Auto`` takes it when the running layout is no longer a
candidate (nothing to keep), when it changes only live fields of the running layout (applied
through Admin without restarting a pod, so there is nothing to protect), or when its predicted
gain exceeds ``margin`` and the last change is older than ``cooldownSeconds``. The gain compares
the two layouts in the same plan (the same inputs, the same simulated trace), on the figure that
decided the plan (``planning.recommend``): the highest rate meeting the SLO, else p99 TTFT at the
declared rate.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import Any

from gearshift.operator.reconcile import restarts
from gearshift.v1 import policy_pb2

RECOMMEND = policy_pb2.AutoPolicy.Apply.Recommend


@dataclass(frozen=True)
class Rules:
    """The deployment's ``apply``, ``margin`` and ``cooldownSeconds`` (defaults filled in)."""

    recommend: bool
    margin: float
    cooldown_s: float

    @staticmethod
    def of(auto: policy_pb2.AutoPolicy) -> Rules:
        margin = auto.margin if auto.HasField("margin") else 0.1
        cooldown = auto.cooldown_seconds if auto.HasField("cooldown_seconds") else 1800
        return Rules(auto.apply == RECOMMEND, float(margin), float(cooldown))


@dataclass(frozen=True)
class Decision:
    apply: bool
    reason: str  # why it is applied, or why it waits
    gain: float | None = None  # predicted gain over the running layout (None: not comparable)


def _line(plan: dict[str, Any], name: str) -> dict[str, Any] | None:
    line = next((c for c in plan.get("considered") or [] if c.get("name") == name), None)
    return None if line is None or line.get("error") else line


def gain(plan: dict[str, Any], running: str) -> tuple[float | None, str]:
    """The predicted gain of ``plan``'s choice over layout ``running`` in the same plan, and
    the figure it is on; None with the reason when the two cannot be compared."""
    new, old = _line(plan, plan["choice"]), _line(plan, running)
    if old is None:
        return None, f"the running layout {running} is no longer a candidate"
    if new is None:
        return None, f"the plan has no figures for {plan['choice']}"
    if "meetsSlo" in new and new["meetsSlo"] and not old.get("meetsSlo"):
        return math.inf, f"{running} misses the SLO at the declared rate, {plan['choice']} meets it"
    new_rate, old_rate = new.get("maxRateMeetingSlo"), old.get("maxRateMeetingSlo")
    if new.get("meetsSlo") and new_rate and old_rate and new_rate != old_rate:
        return new_rate / old_rate - 1, "the highest rate meeting the SLO"
    new_ttft, old_ttft = new.get("ttftP99Seconds"), old.get("ttftP99Seconds")
    if not new_ttft or not old_ttft:
        return None, "the plan has no p99 TTFT for both layouts"
    return old_ttft / new_ttft - 1, "p99 TTFT at the declared rate"


def decide(
    running: dict[str, Any] | None,
    plan: dict[str, Any],
    rules: Rules,
    now: dt.datetime,
    misfit: str = "",
) -> Decision:
    """Apply ``plan`` over the ``running`` one (status.auto; None: nothing runs yet)?
    ``misfit``: why the running layout cannot run on the group as it is now (resized), in which
    case there is nothing to keep, in either mode."""
    if running is None or not isinstance(running.get("policy"), dict):
        return Decision(True, "the first plan")
    if plan["policy"] == running["policy"]:
        return Decision(True, "the plan keeps the running policy")
    if misfit:
        return Decision(True, f"the running layout no longer runs on the group: {misfit}")
    if rules.recommend:
        return Decision(False, "apply: Recommend")
    if plan["choice"] == running.get("choice"):
        return Decision(True, "only live fields change (applied without restarting pods)")
    value, figure = gain(plan, running["choice"])
    if value is None:
        return Decision(True, figure)
    shown = "∞" if math.isinf(value) else f"{value:+.1%}"
    stored = None if math.isinf(value) else round(value, 6)
    if value <= rules.margin:
        return Decision(
            False,
            f"predicted gain {shown} on {figure} is within the margin {rules.margin:.0%}",
            stored,
        )
    since = restarts.parse_time(running.get("appliedAt") or running.get("plannedAt"))
    if since is not None:
        until = since + dt.timedelta(seconds=rules.cooldown_s)
        if now < until:
            return Decision(
                False,
                f"predicted gain {shown} on {figure}, but the last change was at "
                f"{restarts.format_time(since)}: cooldown until {restarts.format_time(until)}",
                stored,
            )
    return Decision(True, f"predicted gain {shown} on {figure} exceeds the margin", stored)
