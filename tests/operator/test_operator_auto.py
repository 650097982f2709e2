"""`policy: auto` end to end: kopf against kmock plans the policy from the nodes' GPU label and the
declared traffic, renders the chosen layout's children, reports the choice in status and an event,
plans again when the traffic changes (rolling to the new layout), and refuses what it cannot plan
naming the field (issue 16, item 4)."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf import json_format
from kmock_harness import (
    Api,
    OperatorProcess,
    StandInAdmin,
    condition,
    cr_metadata,
    events,
    wait_for,
)

from gearshift.operator.reconcile import names
from gearshift.v1 import policy_pb2

NS = "auto"
STS = f"/apis/apps/v1/namespaces/{NS}/statefulsets"
REPO = Path(__file__).resolve().parents[2]
CHAT = {"rate": 0.05, "prompt": {"fixed": 64}, "output": {"fixed": 200}}
LONG = {"rate": 20, "prompt": {"fixed": 8000}, "output": {"fixed": 16}}
# Planning runs in the operator; 10 requests per point keeps one plan to seconds on CI.
PLAN_WAIT = 120


def _body(name: str, traffic: dict[str, Any]) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "docs/examples/auto.yaml").read_text())
    body["metadata"] = cr_metadata(name, NS)
    a = body["spec"]["policy"]["auto"]
    a.pop("goodput")
    a["requests"] = 10
    # Every new plan is taken at once: these tests are about planning; the apply rules (margin,
    # cooldown, Recommend) have their own tests (test_auto_apply*.py).
    a["cooldownSeconds"] = 0
    a["margin"] = 0
    # The Shift paper's directions (TP for lone decodes, SP for long prompts at a high rate)
    # between static and Shift; SiDP joins by default (test_sidp_cost.py, the refusals below).
    a["policies"] = ["static", "shift"]
    a["traffic"] = copy.deepcopy(traffic)
    return body


def _status(api: Api, name: str) -> dict[str, Any]:
    return (api.cr(NS, name) or {}).get("status") or {}


def _engine_policy(api: Api, name: str) -> dict[str, Any]:
    cm = api.get(f"/api/v1/namespaces/{NS}/configmaps/{name}-config") or {}
    data = cm.get("data") or {}
    return dict(yaml.safe_load(data.get("engine.json") or "{}").get("policy", {}))


def _refused(api: Api, body: dict[str, Any]) -> dict[str, Any]:
    """Create ``body``; its InvalidSpec condition once True."""
    name = body["metadata"]["name"]
    api.create_cr(NS, body)
    wait_for(
        lambda: condition(api.cr(NS, name), "InvalidSpec").get("status") == "True",
        PLAN_WAIT,
        what="InvalidSpec",
    )
    return condition(api.cr(NS, name), "InvalidSpec")


def _events(api: Api, name: str) -> list[dict[str, Any]]:
    return events(api, NS, name, "PolicyPlanned")


@pytest.fixture()
def gpu_node(api: Api) -> Iterator[None]:
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": "gpu-node-1",
            "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        },
    }
    code, data = api.call("POST", "/api/v1/nodes", node)
    assert code in (200, 201), data
    yield
    api.call("DELETE", "/api/v1/nodes/gpu-node-1")


@pytest.fixture()
def one_at_a_time(api: Api, operator_process: OperatorProcess) -> Iterator[None]:
    yield
    api.delete_all_crs(NS)


def test_auto_plans_renders_reports_and_replans_on_a_traffic_change(
    api: Api,
    admin: StandInAdmin,
    operator_process: OperatorProcess,
    gpu_node: None,
    one_at_a_time: None,
) -> None:
    name = "chat"
    api.create_cr(NS, _body(name, CHAT))
    wait_for(lambda: _status(api, name).get("auto"), PLAN_WAIT, what="status.auto")
    first = _status(api, name)["auto"]
    # One request at a time with long answers: TP 8 decodes fastest (Shift §2).
    assert first["choice"] == "tp8" and first["policy"] == {"static": {"tp": 8}}
    assert first["gpu"] == "H100" and "lowest p99 TTFT" in first["reason"]
    assert first["predicted"]["ttftP99Seconds"] > 0 and first["predicted"]["kvTokens"] > 0
    assert {c["name"] for c in first["considered"]} == {"tp8", "sp8", "pp8", "shift8"}
    wait_for(lambda: _status(api, name).get("policy") == "auto:static", 30, what="status.policy")
    assert condition(api.cr(NS, name), "InvalidSpec")["status"] == "False"
    # The children run the chosen policy, never `auto`.
    wait_for(lambda: api.names(STS, {names.LABEL_DEPLOYMENT: name}) == {f"{name}-g0"}, 30)
    wait_for(lambda: _engine_policy(api, name).get("static", {}).get("tp") == 8, 30)
    wait_for(lambda: _events(api, name), 30, what="a PolicyPlanned event")
    assert "auto chose tp8" in _events(api, name)[0]["message"]
    revision = api.get(f"{STS}/{name}-g0")["metadata"]["labels"][names.LABEL_REVISION]  # type: ignore[index]

    # Resyncs (every 0.5 s here) reuse the stored choice: nothing is planned again.
    time.sleep(3)
    assert _status(api, name)["auto"]["plannedAt"] == first["plannedAt"]
    assert len(_events(api, name)) == 1

    # Long prompts at a high rate: the plan moves to a sequence-parallel layout and the group rolls.
    api.patch_spec(NS, name, {"policy": {"auto": {"traffic": LONG}}})
    wait_for(
        lambda: (_status(api, name).get("auto") or {}).get("inputs") != first["inputs"],
        PLAN_WAIT,
        what="a new plan",
    )
    second = _status(api, name)["auto"]
    assert second["choice"] in ("shift8", "sp8"), second
    assert second["policy"] != first["policy"]
    wait_for(lambda: len(_events(api, name)) == 2, 30, what="a second PolicyPlanned event")
    wait_for(
        lambda: (
            (api.get(f"{STS}/{name}-g0") or {})["metadata"]["labels"][names.LABEL_REVISION]
            != revision
        ),
        60,
        what="the group rolled to the new layout",
    )
    kind = next(iter(second["policy"]))
    wait_for(
        lambda: kind in _engine_policy(api, name),
        30,
        what=f"{kind} in engine.json: {_engine_policy(api, name)}",
    )

    # Back to an explicit policy: status.auto goes away.
    api.patch_spec(NS, name, {"policy": {"auto": None, "shift": {"sp": 8, "tp": 1}}})
    wait_for(lambda: _status(api, name).get("policy") == "shift", 60, what="status.policy shift")
    assert "auto" not in _status(api, name)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"policies": ["bogus"]}, "SpecPolicyAutoPolicies"),
        ({"gpu": "A100"}, "SpecPolicyAutoGpu"),
    ],
)
def test_what_auto_cannot_plan_is_refused_naming_the_field(
    api: Api,
    admin: StandInAdmin,
    operator_process: OperatorProcess,
    gpu_node: None,
    one_at_a_time: None,
    change: dict[str, Any],
    reason: str,
) -> None:
    name = "bad-" + reason.lower()[-8:]
    body = _body(name, CHAT)
    body["spec"]["policy"]["auto"].update(change)
    invalid = _refused(api, body)
    assert invalid["reason"] == reason, invalid
    assert api.names(STS, {names.LABEL_DEPLOYMENT: name}) == set()
    assert "auto" not in _status(api, name)


def test_without_a_gpu_label_on_the_selected_nodes_auto_names_gpu(
    api: Api, admin: StandInAdmin, operator_process: OperatorProcess, one_at_a_time: None
) -> None:
    name = "no-label"
    body = _body(name, CHAT)
    body["spec"]["scheduling"]["nodeSelector"] = {"pool": "nowhere"}
    invalid = _refused(api, body)
    assert invalid["reason"] == "SpecPolicyAutoGpu" and "pool" in invalid["message"], invalid


def test_a_traffic_change_that_moves_only_the_shift_threshold_applies_live(
    api: Api,
    admin: StandInAdmin,
    operator_process: OperatorProcess,
    gpu_node: None,
    one_at_a_time: None,
) -> None:
    name = "live"
    body = _body(name, CHAT)
    body["spec"]["policy"]["auto"]["policies"] = ["shift"]
    api.create_cr(NS, body)
    wait_for(lambda: _status(api, name).get("auto"), PLAN_WAIT, what="status.auto")
    first = _status(api, name)["auto"]
    assert first["policy"] == {"shift": {"sp": 8, "tp": 1, "threshold": 256}}, first
    group = f"{name}-g0"
    wait_for(lambda: api.get(f"{STS}/{group}"), 30, what="the group")
    revision = api.get(f"{STS}/{group}")["metadata"]["labels"][names.LABEL_REVISION]  # type: ignore[index]
    policy = json_format.ParseDict(first["policy"], policy_pb2.Policy())
    admin.serve(group, policy, revision)
    wait_for(lambda: condition(api.cr(NS, name), "Ready").get("status") == "True", 30)

    medium = {"rate": 30, "prompt": {"fixed": 300}, "output": {"fixed": 100}}
    api.patch_spec(NS, name, {"policy": {"auto": {"traffic": medium}}})
    wait_for(
        lambda: (
            (_status(api, name).get("auto") or {})
            .get("policy", {})
            .get("shift", {})
            .get("threshold")
            == 1024
        ),
        PLAN_WAIT,
        what="the new threshold planned",
    )
    # Applied through Admin, without rolling the group.
    wait_for(lambda: any(p.shift.threshold == 1024 for p in admin.applied), 30, what="ApplyPolicy")
    labels = api.get(f"{STS}/{group}")["metadata"]["labels"]  # type: ignore[index]
    assert labels[names.LABEL_REVISION] == revision
    assert condition(api.cr(NS, name), "Degraded")["status"] == "False"
