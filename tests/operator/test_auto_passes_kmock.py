"""``policy: auto`` over reconcile passes against kmock, run in this process one pass at a time
(as handlers.py runs them, without kopf), where the order of edits matters: a spec that turns
invalid and back, a group resized under a held plan or while calibrating, a bad input beside
``calibrate``, and a plan in flight when the spec turns invalid or the deployment goes.
kopf end to end: test_auto_apply_kmock.py, test_auto_calibrate_kmock.py."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cpu_profile import MODEL
from kmock_harness import Api, KmockApi, condition, cr_metadata
from kubernetes import client

from gearshift.operator.reconcile import handlers, names
from gearshift.operator.reconcile.auto_planner import Planner
from gearshift.operator.reconcile.kube import Kube
from gearshift.operator.reconcile.reconciler import Reconciler
from gearshift.operator.reconcile.settings import OperatorSettings
from gearshift.operator.reconcile.tokens import TokenKeeper

REPO = Path(__file__).resolve().parents[2]
CHAT = {"rate": 0.05, "prompt": {"fixed": 64}, "output": {"fixed": 200}}
LONG = {"rate": 20, "prompt": {"fixed": 8000}, "output": {"fixed": 16}}
T0 = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
H100 = "NVIDIA-H100-80GB-HBM3"


def _body(name: str, ns: str, **auto_fields: Any) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "docs/examples/auto.yaml").read_text())
    body["metadata"] = cr_metadata(name, ns)
    a = body["spec"]["policy"]["auto"]
    a.pop("goodput")
    a.update(gpu="H100", requests=10, policies=["static", "shift"], traffic=copy.deepcopy(CHAT))
    a.update(auto_fields)
    body["spec"]["model"]["source"] = "/models/llama"
    return body


def _kube(url: str) -> Kube:
    cfg = client.Configuration()
    cfg.host = url
    return Kube(client.ApiClient(cfg))


def _reconciler(kube: Kube, planner: Planner | None = None) -> Reconciler:
    """A fresh one is an operator restarted: nothing remembered but what status holds."""
    settings = OperatorSettings(admin_address="127.0.0.1:1", admin_timeout_seconds=0.3)
    return Reconciler(
        kube, settings, logging.getLogger("test"), TokenKeeper(kube, None), {}, planner=planner
    )


def _merge(obj: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return patch
    out = dict(obj) if isinstance(obj, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v)
    return out


def _replacing(old: Any, new: Any) -> Any:
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    out = {k: _replacing(old.get(k), v) for k, v in new.items()}
    out.update({k: None for k in old if k not in new})
    return out


def _pass(r: Reconciler, body: dict[str, Any], now: dt.datetime) -> dict[str, Any]:
    """One pass; the body with the status it writes, merged as the API server would."""
    new = asyncio.run(r.reconcile(copy.deepcopy(body), now))
    old = dict(body.get("status") or {})
    out = copy.deepcopy(body)
    out["status"] = _merge(old, {k: _replacing(old.get(k), v) for k, v in new.items()})
    return out


def _auto(body: dict[str, Any]) -> dict[str, Any]:
    return dict(body["status"].get("auto") or {})


@pytest.fixture()
def kube(kmock_api: KmockApi) -> Iterator[Kube]:
    yield _kube(kmock_api.url)


@pytest.fixture()
def planner() -> Iterator[Planner]:
    p = Planner(timeout_s=120, retry_s=600)
    try:
        yield p
    finally:
        p.close()


def _gpu_node(api: Api, name: str) -> None:
    node = {"metadata": {"name": name, "labels": {"nvidia.com/gpu.product": H100}}}
    api.call("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", **node})


def test_an_invalid_spec_keeps_auto_and_recommend_still_holds_after_a_restart(
    kube: Kube, api: Api
) -> None:
    ns = "auto-invalid"
    body = _pass(_reconciler(kube), _body("rec", ns, apply="Recommend"), T0)
    first = _auto(body)
    assert first["applied"] == "the first plan"
    # A typo (a profile ConfigMap that does not exist): refused, and status.auto stays.
    bad = copy.deepcopy(body)
    bad["spec"]["policy"]["auto"]["profile"] = "no-such-cm"
    bad = _pass(_reconciler(kube), bad, T0 + dt.timedelta(seconds=10))
    assert condition(bad, "InvalidSpec")["status"] == "True"
    assert _auto(bad) == first
    # The operator restarts; the typo goes and the traffic changes: a new plan, held.
    fixed = copy.deepcopy(bad)
    del fixed["spec"]["policy"]["auto"]["profile"]
    fixed["spec"]["policy"]["auto"]["traffic"] = copy.deepcopy(LONG)
    fixed = _pass(_reconciler(kube), fixed, T0 + dt.timedelta(seconds=20))
    assert condition(fixed, "InvalidSpec")["status"] == "False"
    now = _auto(fixed)
    assert now["policy"] == first["policy"] and now["appliedAt"] == first["appliedAt"]
    assert now["recommendation"]["held"] == "apply: Recommend"
    assert now["recommendation"]["policy"] != first["policy"]
    engine = yaml.safe_load(
        api.get(f"/api/v1/namespaces/{ns}/configmaps/rec-config")["data"]["engine.json"]
    )
    ((kind, fields),) = first["policy"].items()
    assert engine["policy"][kind] == {**engine["policy"][kind], **fields}  # defaults filled in


def _until_planned(r: Reconciler, body: dict[str, Any], at: dt.datetime) -> dict[str, Any]:
    for i in range(120):  # the planner's child: seconds (bounded at 60 s)
        body = _pass(r, body, at + dt.timedelta(seconds=i))
        if "policy" in _auto(body) and not _auto(body).get("planning"):
            return body
        time.sleep(0.5)
    raise AssertionError(f"no plan: {_auto(body)}")


def test_recommend_takes_the_new_plan_when_the_group_is_resized(
    kube: Kube, planner: Planner
) -> None:
    r = _reconciler(kube, planner)
    body = _until_planned(r, _body("resized", "auto-resized", apply="Recommend"), T0)
    old = _auto(body)
    # The group goes from 8 GPUs to 4: the held layout cannot run on it, so there is nothing
    # to keep, even under Recommend.
    body["spec"]["group"] = {"nodes": 1, "gpusPerNode": 4}
    body = _until_planned(r, body, T0 + dt.timedelta(seconds=100))
    assert condition(body, "InvalidSpec")["status"] == "False", condition(body, "InvalidSpec")
    now = _auto(body)
    assert "policy" in now, body["status"]
    assert now["policy"] != old["policy"] and "recommendation" not in now
    assert now["applied"].startswith("the running layout no longer runs on the group")
    assert condition(body, "Ready")["reason"] != "InvalidSpec"


def test_calibrating_beside_a_resize_waits_and_keeps_the_running_choice(
    kube: Kube, api: Api
) -> None:
    _gpu_node(api, "holder")
    r = _reconciler(kube)
    body = _pass(r, _body("held", "auto-held"), T0)
    running = _auto(body)
    # One edit: measure a profile, on a 4-GPU group. The running choice (8 GPUs) cannot run
    # there, and no plan comes before the profile: the deployment waits, changing nothing.
    body["spec"]["group"] = {"nodes": 1, "gpusPerNode": 4}
    body["spec"]["policy"]["auto"].update(calibrate=True, model=dict(MODEL))
    body = _pass(r, body, T0 + dt.timedelta(seconds=30))
    assert condition(body, "InvalidSpec")["status"] == "False", condition(body, "InvalidSpec")
    assert condition(body, "Ready")["reason"] == "Calibrating"
    assert _auto(body)["policy"] == running["policy"] and "calibrating" in _auto(body)
    jobs = api.items("/apis/batch/v1/namespaces/auto-held/jobs")
    assert len(jobs) == 1


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"goodput": "garbage"}, "spec.policy.auto.goodput"),
        ({"policies": ["bogus"]}, "spec.policy.auto.policies"),
        ({"traffic": {"rate": 1, "prompt": {"preset": "nope"}}}, "spec.policy.auto.traffic"),
    ],
    ids=["goodput", "policies", "preset"],
)
def test_calibrate_refuses_a_bad_input_before_it_starts_a_job(
    kube: Kube, api: Api, bad: dict[str, Any], field: str
) -> None:
    ns = f"calib-bad-{next(iter(bad))}"
    _gpu_node(api, f"n-{ns}")
    body = _body("cb", ns, model=dict(MODEL), calibrate=True, **bad)
    body["spec"]["group"] = {"nodes": 1, "gpusPerNode": 2}
    body = _pass(_reconciler(kube), body, T0)
    invalid = condition(body, "InvalidSpec")
    assert invalid["status"] == "True" and invalid["message"].startswith(field), invalid
    assert api.items(f"/apis/batch/v1/namespaces/{ns}/jobs") == []


def test_a_plan_in_flight_stops_when_the_spec_turns_invalid_and_the_deployment_goes(
    kube: Kube,
) -> None:
    ns = "auto-leak"
    body = _pass(_reconciler(kube), _body("slow", ns), T0)  # planned in this process: running
    assert _children(kube, ns), "the first pass rendered nothing"
    planner = Planner(timeout_s=300, retry_s=600)
    try:
        r = _reconciler(kube, planner)
        body["spec"]["policy"]["auto"].update(requests=5000, traffic=copy.deepcopy(LONG))
        body["spec"]["policy"]["auto"].pop("policies")  # every kind, many requests: minutes
        body = _pass(r, body, T0 + dt.timedelta(seconds=1))
        assert planner.running() == 1 and _auto(body).get("planning")
        child = next(iter(planner._jobs.values())).process
        # A value the CRD's type admits and the operator refuses: no pass polls the plan now,
        # so nothing would enforce its timeout. It is stopped.
        bad = copy.deepcopy(body)
        bad["spec"]["policy"]["auto"]["cooldownSeconds"] = 5_000_000_000
        bad = _pass(r, bad, T0 + dt.timedelta(seconds=2))
        assert condition(bad, "InvalidSpec")["status"] == "True"
        assert planner.running() == 0
        child.join(10)
        assert not child.is_alive()
        # The invalid deployment is deleted: the children it rendered while valid go too.
        memo = {"planner": planner, "plans": {}, "kube": kube, "tokens": r.tokens}
        asyncio.run(handlers.on_delete(body=bad, memo=memo, logger=logging.getLogger("test")))
        assert _children(kube, ns) == []
    finally:
        planner.close()


def _children(kube: Kube, ns: str) -> list[str]:
    """The deployment's StatefulSets and ConfigMaps."""
    out = []
    for api_version, kind in (("apps/v1", "StatefulSet"), ("v1", "ConfigMap")):
        items = asyncio.run(kube.select(api_version, kind, ns, {names.LABEL_DEPLOYMENT: "slow"}))
        out += [f"{kind}/{o['metadata']['name']}" for o in items]
    return out
