"""`policy: auto`'s apply rules and planner, without a cluster (issue 30, item 4): Recommend holds,
a gain within the margin holds, a change within the cooldown holds until it ends, live-only
changes and a layout that is no longer a candidate go through; a plan runs in a child process
that is stopped at the timeout."""

from __future__ import annotations

import copy
import datetime as dt
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from gearshift.operator.reconcile import auto, auto_apply, auto_planner
from gearshift.operator.reconcile.spec import parse
from gearshift.v1 import policy_pb2

REPO = Path(__file__).resolve().parents[2]
NOW = dt.datetime(2026, 11, 24, tzinfo=dt.UTC)
AUTO = auto_apply.Rules(recommend=False, margin=0.1, cooldown_s=1800)


def _plan(choice: str, policy: dict[str, Any], **ttft: float) -> dict[str, Any]:
    return {
        "choice": choice,
        "policy": policy,
        "reason": "test",
        "considered": [{"name": n, "ttftP99Seconds": v} for n, v in ttft.items()],
        "plannedAt": "2026-11-24T00:00:00Z",
    }


TP8 = {"static": {"tp": 8}}
SP8 = {"static": {"sp": 8}}


def _running(at: dt.datetime) -> dict[str, Any]:
    return {**_plan("tp8", TP8, tp8=1.0, sp8=1.0), "appliedAt": at.isoformat()}


def test_the_first_plan_runs_in_either_mode() -> None:
    plan = _plan("tp8", TP8, tp8=1.0)
    assert auto_apply.decide(None, plan, AUTO, NOW).apply
    recommend = auto_apply.Rules(True, 0.1, 1800)
    assert auto_apply.decide(None, plan, recommend, NOW).apply


def test_recommend_holds_every_later_change() -> None:
    running = _running(NOW - dt.timedelta(days=1))
    plan = _plan("sp8", SP8, tp8=1.0, sp8=0.1)  # ten times better
    d = auto_apply.decide(running, plan, auto_apply.Rules(True, 0.1, 0), NOW)
    assert not d.apply and d.reason == "apply: Recommend"


def test_a_gain_within_the_margin_holds_and_one_above_it_applies() -> None:
    running = _running(NOW - dt.timedelta(days=1))
    small = auto_apply.decide(running, _plan("sp8", SP8, tp8=1.0, sp8=0.95), AUTO, NOW)
    assert not small.apply and "within the margin 10%" in small.reason
    assert small.gain == pytest.approx(1 / 0.95 - 1, rel=1e-5)
    large = auto_apply.decide(running, _plan("sp8", SP8, tp8=1.0, sp8=0.5), AUTO, NOW)
    assert large.apply and large.gain == pytest.approx(1.0)


def test_a_change_within_the_cooldown_holds_until_it_ends() -> None:
    applied = NOW - dt.timedelta(minutes=10)
    plan = _plan("sp8", SP8, tp8=1.0, sp8=0.5)
    held = auto_apply.decide(_running(applied), plan, AUTO, NOW)
    assert not held.apply and "cooldown until 2026-11-24T00:20:00Z" in held.reason
    later = auto_apply.decide(_running(applied), plan, AUTO, NOW + dt.timedelta(minutes=21))
    assert later.apply


def test_live_only_changes_and_a_layout_no_longer_planned_go_through_the_cooldown() -> None:
    running = {**_running(NOW), "choice": "shift8", "policy": {"shift": {"sp": 8, "threshold": 64}}}
    live = _plan("shift8", {"shift": {"sp": 8, "threshold": 1024}}, shift8=1.0)
    assert auto_apply.decide(running, live, AUTO, NOW).apply
    gone = auto_apply.decide(running, _plan("tp8", TP8, tp8=1.0), AUTO, NOW)
    assert gone.apply and "no longer a candidate" in gone.reason


def test_meeting_the_slo_where_the_running_layout_misses_it_is_an_unbounded_gain() -> None:
    running = _running(NOW - dt.timedelta(days=1))
    plan = _plan("sp8", SP8)
    plan["considered"] = [
        {"name": "tp8", "ttftP99Seconds": 0.5, "meetsSlo": False},
        {"name": "sp8", "ttftP99Seconds": 0.49, "meetsSlo": True, "maxRateMeetingSlo": 2.0},
    ]
    d = auto_apply.decide(running, plan, AUTO, NOW)
    assert d.apply and d.gain is None and "misses the SLO" in d.reason


def _spec(**fields: Any) -> Any:
    body = yaml.safe_load((REPO / "docs/examples/auto.yaml").read_text())
    body["metadata"].update(namespace="ns", uid="u", generation=1)
    body["spec"]["policy"]["auto"].update(fields)
    return parse(body)


def test_a_held_plan_is_kept_as_the_recommendation_and_applied_once_the_cooldown_ends() -> None:
    spec = _spec(cooldownSeconds=600)
    first = auto.resolve(spec, {}, "H100", "k1", NOW, _plan("tp8", TP8, tp8=1.0))
    assert first.event is not None and first.event.reason == "PolicyPlanned"
    assert first.status["appliedAt"] == "2026-11-24T00:00:00Z"
    fresh = _plan("sp8", SP8, tp8=1.0, sp8=0.5)
    held = auto.resolve(spec, first.status, "H100", "k2", NOW + dt.timedelta(minutes=1), fresh)
    assert held.event is not None and held.event.reason == "PolicyRecommended"
    assert held.spec.policy.static.tp == 8  # the running layout stays
    assert held.status["choice"] == "tp8" and held.status["inputs"] == "k1"
    rec = held.status["recommendation"]
    assert rec["choice"] == "sp8" and rec["inputs"] == "k2" and "cooldown" in rec["held"]
    assert not auto.needs_plan(held.status, "k2")  # no second plan of the same inputs
    # A pass before the cooldown ends changes nothing and says nothing.
    again = auto.resolve(spec, held.status, "H100", "k2", NOW + dt.timedelta(minutes=5))
    assert again.status == held.status and again.event is None
    # After it: the stored recommendation is applied without planning again.
    after = auto.resolve(spec, held.status, "H100", "k2", NOW + dt.timedelta(minutes=11))
    assert after.spec.policy.static.sp == 8 and not after.planned
    assert after.event is not None and after.event.reason == "PolicyPlanned"
    assert after.status["inputs"] == "k2" and "recommendation" not in after.status
    assert after.status["appliedAt"] == "2026-11-24T00:11:00Z"


def test_apply_margin_and_cooldown_do_not_change_the_plans_inputs() -> None:
    base = auto.digest(_spec(), "H100")
    assert auto.digest(_spec(apply="Recommend", margin=0.5, cooldownSeconds=5), "H100") == base
    assert auto.digest(_spec(requests=20), "H100") != base


def _request(**fields: Any) -> auto_planner.PlanRequest:
    msg = policy_pb2.AutoPolicy()
    body = yaml.safe_load((REPO / "docs/examples/auto.yaml").read_text())
    from google.protobuf import json_format

    a = copy.deepcopy(body["spec"]["policy"]["auto"])
    a.update(fields)
    json_format.ParseDict(a, msg)
    return auto_planner.PlanRequest(msg.SerializeToString(), "H100", 8, 8, 1, 32768)


def _wait(planner: auto_planner.Planner, key: str, req: auto_planner.PlanRequest) -> Any:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        outcome = planner.poll(("ns", "x", "u"), key, req)
        if not isinstance(outcome, auto_planner.Pending):
            return outcome
        time.sleep(0.1)
    raise AssertionError("the planner never answered")


def test_a_plan_past_the_timeout_is_stopped_and_retried_only_after_the_back_off() -> None:
    planner = auto_planner.Planner(timeout_s=1.0, retry_s=3600)
    # Every policy at 5000 requests per point: minutes of simulation.
    slow = _request(requests=5000, policies=[])
    try:
        outcome = _wait(planner, "slow", slow)
        assert isinstance(outcome, auto_planner.TimedOut) and outcome.seconds == 1.0
        assert planner.running() == 0  # the child was killed and reaped
        again = planner.poll(("ns", "x", "u"), "slow", slow)
        assert isinstance(again, auto_planner.TimedOut) and planner.running() == 0
    finally:
        planner.close()


def test_the_child_answers_a_plan_or_the_field_at_fault() -> None:
    planner = auto_planner.Planner(timeout_s=120, retry_s=60)
    try:
        quick = _request(requests=10, policies=["static"])
        done = _wait(planner, "quick", quick)
        assert isinstance(done, auto_planner.Planned), done
        assert done.plan["choice"].startswith(("tp", "sp", "pp")) and done.plan["considered"]
        bad = auto_planner.PlanRequest(quick.auto, "A100", 8, 8, 1, None)
        failed = _wait(planner, "bad", bad)
        assert isinstance(failed, auto_planner.Failed) and failed.field == "spec.policy.auto.gpu"
    finally:
        planner.close()


@pytest.mark.parametrize(
    ("fields", "path", "says"),
    [
        ({"margin": -0.5}, "spec.policy.auto.margin", "must be at least 0, got -0.5"),
        ({"margin": "x"}, "spec.policy.auto.margin", "Couldn't parse float"),
        ({"cooldownSeconds": -5}, "spec.policy.auto.cooldownSeconds", "out of range"),
        ({"cooldownSeconds": "abc"}, "spec.policy.auto.cooldownSeconds", "invalid literal"),
        ({"cooldownSeconds": 1.5}, "spec.policy.auto.cooldownSeconds", "parse integer"),
        ({"apply": "Sometimes"}, "spec.policy.auto.apply", "Invalid enum value"),
    ],
)
def test_a_bad_margin_cooldown_or_apply_is_refused_naming_the_field(
    fields: dict[str, Any], path: str, says: str
) -> None:
    """The CRD's schema refuses these at admission; a spec that reached the operator another
    way (applied before a rule, or an API server without the schema) is refused the same,
    with the field's path: a negative margin was taken as given, and a cooldown out of range
    named only spec.policy."""
    from gearshift.operator.reconcile.spec import SpecError

    with pytest.raises(SpecError) as err:
        _spec(**fields)
    assert err.value.field == path and str(err.value).startswith(f"{path}: "), err.value
    assert says in str(err.value)
