"""``spec.policy.auto.profile`` end to end (issue 30, item 1): kopf against kmock reads the
ConfigMap holding a profile measured by ``gearshift profile --layouts`` (on this CPU, relabelled
as the group's GPU: cpu_profile.py), plans from it and names it in status and the event; a
rewritten profile plans again; a missing or malformed one is refused naming the field and changes
no workload."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cpu_profile import DTYPE, H100_NAME, LAYOUTS, MODEL, as_measured_on
from kmock_harness import Api, OperatorProcess, condition, cr_metadata, events, wait_for

from gearshift.operator.reconcile import names
from gearshift.operator.sim import calibration

NS = "auto-profile"
STS = f"/apis/apps/v1/namespaces/{NS}/statefulsets"
CMS = f"/api/v1/namespaces/{NS}/configmaps"
REPO = Path(__file__).resolve().parents[2]
FIELD = "spec.policy.auto.profile"
TRAFFIC = {"rate": 2, "prompt": {"fixed": 64}, "output": {"fixed": 16}}
PLAN_WAIT = 120


def _body(name: str, profile: str) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "docs/examples/auto.yaml").read_text())
    body["metadata"] = cr_metadata(name, NS)
    body["spec"]["group"] = {"nodes": 1, "gpusPerNode": 2}
    body["spec"]["model"]["dtype"] = DTYPE  # the profile's: it must have measured this dtype
    a = body["spec"]["policy"]["auto"]
    a.pop("goodput")
    a.update(model=dict(MODEL), gpu="H100", requests=20, traffic=copy.deepcopy(TRAFFIC))
    a.update(profile=profile, cooldownSeconds=0, margin=0)
    return body


def _put_profile(api: Api, name: str, text: str) -> None:
    body = {"metadata": {"name": name, "namespace": NS}, "data": {"profile.json": text}}
    code, _ = api.call("PATCH", f"{CMS}/{name}", {"data": body["data"]})
    if code == 404:
        code, data = api.call("POST", CMS, body)
        assert code in (200, 201), data
    else:
        assert code == 200


def _auto(api: Api, name: str) -> dict[str, Any]:
    return ((api.cr(NS, name) or {}).get("status") or {}).get("auto") or {}


def _invalid(api: Api, name: str) -> dict[str, Any]:
    return condition(api.cr(NS, name), "InvalidSpec")


def _events(api: Api, name: str) -> list[dict[str, Any]]:
    return events(api, NS, name, "PolicyPlanned")


def _workload(api: Api, name: str) -> tuple[set[str], str, str]:
    """The deployment's StatefulSets, its group's revision and its engine config."""
    sts = api.get(f"{STS}/{name}-g0") or {}
    revision = ((sts.get("metadata") or {}).get("labels") or {}).get(names.LABEL_REVISION, "")
    config = ((api.get(f"{CMS}/{name}-config") or {}).get("data") or {}).get("engine.json", "")
    return api.names(STS, {names.LABEL_DEPLOYMENT: name}), str(revision), str(config)


@pytest.fixture()
def one_at_a_time(api: Api, operator_process: OperatorProcess) -> Iterator[None]:
    yield
    api.delete_all_crs(NS)


def test_the_plan_comes_from_the_profile_and_a_rewritten_one_plans_again(
    api: Api, operator_process: OperatorProcess, one_at_a_time: None, cpu_profile: str
) -> None:
    text = as_measured_on(cpu_profile, H100_NAME)
    _put_profile(api, "h100-profile", text)
    api.create_cr(NS, _body("priced", "h100-profile"))
    first = wait_for(lambda: _auto(api, "priced").get("choice") and _auto(api, "priced"), PLAN_WAIT)
    described = calibration.parse(text).describe()
    assert first["profile"] == {"configMap": "h100-profile", "describe": described}, first
    assert first["pricing"] == f"the profile in ConfigMap h100-profile: {described}"
    # Only what the profile measured competes: the preset would price sp2 and shift2 as well.
    assert {line["name"] for line in first["considered"]} == set(LAYOUTS), first["considered"]
    assert first["choice"] in LAYOUTS
    wait_for(lambda: _events(api, "priced"), 30, what="PolicyPlanned")
    message = _events(api, "priced")[0]["message"]
    assert "ConfigMap h100-profile" in message and described in message, message
    wait_for(lambda: _workload(api, "priced")[1], 30, what="the group")
    assert _invalid(api, "priced")["status"] == "False"

    # A rewritten profile (another KV capacity) is a new input: the operator plans again.
    data = json.loads(text)
    for layout in data["layouts"].values():
        layout["kv_blocks"] //= 2
    _put_profile(api, "h100-profile", json.dumps(data))
    second = wait_for(
        lambda: _auto(api, "priced").get("inputs") != first["inputs"] and _auto(api, "priced"),
        PLAN_WAIT,
        what="a plan from the rewritten profile",
    )
    assert second["plannedAt"] >= first["plannedAt"] and second["profile"]["configMap"] == (
        "h100-profile"
    )


def test_a_missing_or_malformed_profile_is_refused_and_changes_no_workload(
    api: Api, operator_process: OperatorProcess, one_at_a_time: None, cpu_profile: str
) -> None:
    # A deployment whose profile ConfigMap does not exist renders nothing.
    api.create_cr(NS, _body("absent", "no-such-profile"))
    wait_for(lambda: _invalid(api, "absent").get("status") == "True", PLAN_WAIT, "InvalidSpec")
    invalid = _invalid(api, "absent")
    assert invalid["reason"] == "SpecPolicyAutoProfile", invalid
    assert invalid["message"].startswith(f"{FIELD}: ConfigMap no-such-profile not found"), invalid
    assert not api.names(STS, {names.LABEL_DEPLOYMENT: "absent"})

    # A running deployment whose profile turns malformed, then disappears: refused naming the
    # field, and its workload stays as it was.
    _put_profile(api, "turns-bad", as_measured_on(cpu_profile, H100_NAME))
    api.create_cr(NS, _body("running", "turns-bad"))
    wait_for(lambda: _auto(api, "running").get("choice"), PLAN_WAIT, what="the first plan")
    wait_for(lambda: _workload(api, "running")[1], 30, what="the group")
    before = _workload(api, "running")
    for text, says in (
        ("{not json", "key profile.json: not JSON"),
        (cpu_profile, "was measured on"),  # this CPU's own device: not the group's H100
    ):
        _put_profile(api, "turns-bad", text)
        wait_for(
            lambda says=says: says in _invalid(api, "running").get("message", ""),  # type: ignore[misc]
            30,
            what=says,
        )
        assert _invalid(api, "running")["reason"] == "SpecPolicyAutoProfile"
        for _ in range(4):  # and over further passes (every 0.5 s here)
            assert _workload(api, "running") == before
            threading.Event().wait(0.5)
    api.call("DELETE", f"{CMS}/turns-bad")
    wait_for(lambda: "not found" in _invalid(api, "running").get("message", ""), 30, "not found")
    assert _workload(api, "running") == before
