"""`policy: auto`'s apply rules end to end (issue 30, item 4): kopf against kmock. A new plan that
Recommend, the cooldown or the margin holds changes no workload and is reported; an accepted
layout change rolls with surge, so the groups serving never drop below the replica count."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf import json_format
from kmock_harness import Api, OperatorProcess, StandInAdmin, condition, cr_metadata, wait_for

from gearshift.operator.reconcile import names
from gearshift.v1 import policy_pb2

NS = "auto-apply"
STS = f"/apis/apps/v1/namespaces/{NS}/statefulsets"
REPO = Path(__file__).resolve().parents[2]
# One request at a time with long answers plans TP 8; long prompts at a high rate plan a
# sequence-parallel layout (test_operator_auto.py).
CHAT = {"rate": 0.05, "prompt": {"fixed": 64}, "output": {"fixed": 200}}
LONG = {"rate": 20, "prompt": {"fixed": 8000}, "output": {"fixed": 16}}
PLAN_WAIT = 120


def _body(name: str, **auto_fields: Any) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "docs/examples/auto.yaml").read_text())
    body["metadata"] = cr_metadata(name, NS)
    a = body["spec"]["policy"]["auto"]
    a.pop("goodput")
    a.update(gpu="H100", requests=10, policies=["static", "shift"], traffic=copy.deepcopy(CHAT))
    a.update(auto_fields)
    return body


def _status(api: Api, name: str) -> dict[str, Any]:
    return (api.cr(NS, name) or {}).get("status") or {}


def _auto(api: Api, name: str) -> dict[str, Any]:
    return _status(api, name).get("auto") or {}


def _engine_policy(api: Api, name: str) -> dict[str, Any]:
    cm = api.get(f"/api/v1/namespaces/{NS}/configmaps/{name}-config") or {}
    return dict(yaml.safe_load((cm.get("data") or {}).get("engine.json") or "{}").get("policy", {}))


def _events(api: Api, name: str, reason: str) -> list[dict[str, Any]]:
    return [
        e
        for e in api.items(f"/api/v1/namespaces/{NS}/events")
        if (e.get("involvedObject") or {}).get("name") == name and e.get("reason") == reason
    ]


def _revision(api: Api, sts: str) -> str:
    return str(
        ((api.get(f"{STS}/{sts}") or {}).get("metadata") or {})
        .get("labels", {})
        .get(names.LABEL_REVISION, "")
    )


@pytest.fixture()
def one_at_a_time(api: Api, operator_process: OperatorProcess) -> Iterator[None]:
    yield
    api.delete_all_crs(NS)


def _running_tp8(api: Api, admin: StandInAdmin, name: str, body: dict[str, Any]) -> str:
    """Create ``body``; once it runs TP 8 and its group serves, the group's revision."""
    api.create_cr(NS, body)
    wait_for(lambda: _auto(api, name).get("choice"), PLAN_WAIT, what="the first plan")
    assert _auto(api, name)["policy"] == {"static": {"tp": 8}}, _auto(api, name)
    group = f"{name}-g0"
    wait_for(lambda: _revision(api, group), 30, what="the group")
    revision = _revision(api, group)
    admin.serve(group, json_format.ParseDict({"static": {"tp": 8}}, policy_pb2.Policy()), revision)
    wait_for(lambda: condition(api.cr(NS, name), "Ready").get("status") == "True", 30)
    return revision


@pytest.mark.parametrize(
    ("fields", "held"),
    [
        ({"apply": "Recommend", "cooldownSeconds": 0, "margin": 0}, "apply: Recommend"),
        ({"margin": 0}, "cooldown until"),  # the default cooldown, 30 minutes
        ({"cooldownSeconds": 0, "margin": 1000}, "within the margin"),
    ],
    ids=["recommend", "cooldown", "margin"],
)
def test_a_held_plan_changes_no_workload_and_is_reported(
    api: Api,
    admin: StandInAdmin,
    operator_process: OperatorProcess,
    one_at_a_time: None,
    fields: dict[str, Any],
    held: str,
) -> None:
    name = "held-" + next(iter(fields))[:5].lower()
    revision = _running_tp8(api, admin, name, _body(name, **fields))
    first = _auto(api, name)
    engine = _engine_policy(api, name)
    assert engine["static"]["tp"] == 8
    applied = len(admin.applied)

    api.patch_spec(NS, name, {"policy": {"auto": {"traffic": LONG}}})
    rec = wait_for(
        lambda: _auto(api, name).get("recommendation"), PLAN_WAIT, what="a recommendation"
    )
    assert rec["choice"] in ("sp8", "shift8") and rec["inputs"] != first["inputs"], rec
    assert held in rec["held"], rec
    wait_for(lambda: _events(api, name, "PolicyRecommended"), 30, what="PolicyRecommended")
    assert held in _events(api, name, "PolicyRecommended")[0]["message"]
    # Nothing changed, and nothing changes over further passes (every 0.5 s here).
    for _ in range(6):
        assert _auto(api, name)["choice"] == "tp8" and _auto(api, name)["inputs"] == first["inputs"]
        assert _revision(api, f"{name}-g0") == revision
        assert api.names(STS, {names.LABEL_DEPLOYMENT: name}) == {f"{name}-g0"}
        assert _engine_policy(api, name) == engine
        assert condition(api.cr(NS, name), "Ready")["status"] == "True"
        threading.Event().wait(0.5)
    assert len(admin.applied) == applied and f"{name}-g0" not in admin.drained
    assert _auto(api, name)["plannedAt"] == first["plannedAt"]
    assert len(_events(api, name, "PolicyPlanned")) == 1


class _Watch:
    """Samples status.readyReplicas and the groups every 50 ms until stopped."""

    def __init__(self, api: Api, name: str) -> None:
        self.api, self.name = api, name
        self.ready: list[int] = []
        self.serving: list[set[str]] = []  # the groups status says are ready, per sample
        self.groups: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            st = _status(self.api, self.name)
            if "readyReplicas" in st:
                self.ready.append(int(st["readyReplicas"]))
                self.serving.append({g["name"] for g in st.get("groups") or [] if g.get("ready")})
            self.groups |= self.api.names(STS, {names.LABEL_DEPLOYMENT: self.name})
            self._stop.wait(0.05)

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def test_an_accepted_layout_change_rolls_with_surge_and_never_drops_below_the_replicas(
    api: Api,
    admin: StandInAdmin,
    operator_process: OperatorProcess,
    one_at_a_time: None,
) -> None:
    name = "surge"
    old = _running_tp8(api, admin, name, _body(name, cooldownSeconds=0, margin=0))
    g0, g1 = f"{name}-g0", f"{name}-g1"
    engine = _engine_policy(api, name)
    with _Watch(api, name) as watch:
        api.patch_spec(NS, name, {"policy": {"auto": {"traffic": LONG}}})
        wait_for(lambda: _auto(api, name).get("choice") != "tp8", PLAN_WAIT, what="applied")
        new_policy = json_format.ParseDict(_auto(api, name)["policy"], policy_pb2.Policy())
        # The surge group comes first, at the new revision; g0 keeps serving meanwhile.
        wait_for(lambda: _revision(api, g1), 30, what="the surge group")
        assert _revision(api, g1) != old and _revision(api, g0) == old
        assert g0 not in admin.drained
        admin.serve(g1, new_policy, _revision(api, g1))  # its pods came up and serve
        # Then g0 rolls: its pods are replaced (the router sees it stop serving) ...
        wait_for(lambda: _revision(api, g0) != old, 30, what="g0 rolled")
        # The operator writes the StatefulSet first, then drains, then deletes the pods: the
        # drain may land just after the new revision is seen.
        wait_for(lambda: g0 in admin.drained, 30, what="g0 drained at the router")
        admin.stop_serving(g0)
        # While g0's new pods start (several passes, every 0.5 s here), the surge group is
        # all that serves: it stays.
        for _ in range(6):
            threading.Event().wait(0.5)
            assert api.get(f"{STS}/{g1}"), "the surge group went before g0 served again"
        admin.serve(g0, new_policy, _revision(api, g0))  # ... and serve the new layout
        # ... and the surge group goes once g0 serves.
        wait_for(lambda: not api.get(f"{STS}/{g1}"), 30, what="the surge group deleted")
        wait_for(lambda: condition(api.cr(NS, name), "Ready").get("status") == "True", 30)
    assert g1 in watch.groups and watch.ready, watch.groups
    assert min(watch.ready) >= 1, watch.ready  # spec.replicas is 1
    # The watch saw the roll: the surge group alone served while g0's pods were replaced.
    assert {g1} in watch.serving, watch.serving
    assert next(iter(_engine_policy(api, name))) in ("static", "shift")
    assert _engine_policy(api, name) != engine
