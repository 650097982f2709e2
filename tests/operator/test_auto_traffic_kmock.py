"""`traffic.source: Observed` end to end (issue 30, item 4): kopf against kmock, the stand-in
router reporting its traffic window. The first plan comes from the declared traffic while the
window is short; the router's busier traffic then plans another layout, held by the cooldown like
any other plan; jitter within the quantisation plans nothing; an unreachable router keeps the
running choice and says why."""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import json_format
from kmock_harness import Api, OperatorProcess, StandInAdmin, condition, cr_metadata, wait_for

from gearshift.operator.reconcile import auto_traffic, names
from gearshift.v1 import policy_pb2, router_pb2

NS = "auto-traffic"
STS = f"/apis/apps/v1/namespaces/{NS}/statefulsets"
REPO = Path(__file__).resolve().parents[2]
# Declared: one chat request at a time plans TP 8; observed: long prompts at 20 req/s plan a
# sequence-parallel layout (as test_auto_apply_kmock.py's LONG does when declared).
CHAT = {"rate": 0.05, "prompt": {"fixed": 64}, "output": {"fixed": 200}, "source": "Observed"}
PLAN_WAIT = 120


def _body(name: str) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "docs/examples/auto.yaml").read_text())
    body["metadata"] = cr_metadata(name, NS)
    a = body["spec"]["policy"]["auto"]
    a.pop("goodput")
    a.update(gpu="H100", requests=10, policies=["static", "shift"], traffic=copy.deepcopy(CHAT))
    a["margin"] = 0  # the default cooldown (30 min) is what holds the second plan
    return body


def _busy(rate: float) -> router_pb2.ObservedTraffic:
    fixed = {"median": 8000, "p90": 8000, "min": 8000, "max": 8000}
    return router_pb2.ObservedTraffic(
        requests=400,
        window_seconds=400 / rate,
        rate=rate,
        burstiness=1.0,
        prompt_tokens=router_pb2.LengthSummary(**fixed),
        output_tokens=router_pb2.LengthSummary(median=16, p90=16, min=16, max=16),
        max_requests=2000,
        max_age_seconds=900,
    )


def _auto(api: Api, name: str) -> dict[str, Any]:
    return ((api.cr(NS, name) or {}).get("status") or {}).get("auto") or {}


def _revision(api: Api, sts: str) -> str:
    meta = (api.get(f"{STS}/{sts}") or {}).get("metadata") or {}
    return str((meta.get("labels") or {}).get(names.LABEL_REVISION, ""))


def test_observed_traffic_plans_through_the_cooldown_and_a_lost_router_keeps_the_choice(
    api: Api, admin: StandInAdmin, operator_process: OperatorProcess
) -> None:
    name, group = "observed", "observed-g0"
    admin.traffic = router_pb2.ObservedTraffic(requests=3, window_seconds=2, rate=1)
    try:
        api.create_cr(NS, _body(name))
        wait_for(lambda: _auto(api, name).get("choice"), PLAN_WAIT, what="the first plan")
        first = _auto(api, name)
        assert first["choice"] == "tp8", first
        assert first["traffic"]["source"] == "Declared"
        assert f"fewer than {auto_traffic.MIN_REQUESTS}" in first["traffic"]["message"]
        wait_for(lambda: _revision(api, group), 30, what="the group")
        revision = _revision(api, group)
        tp8 = json_format.ParseDict({"static": {"tp": 8}}, policy_pb2.Policy())
        admin.serve(group, tp8, revision)
        wait_for(lambda: condition(api.cr(NS, name), "Ready").get("status") == "True", 30)

        admin.traffic = _busy(20.3)
        rec = wait_for(
            lambda: _auto(api, name).get("recommendation"), PLAN_WAIT, what="a recommendation"
        )
        assert rec["choice"] in ("sp8", "shift8") and "cooldown until" in rec["held"], rec
        assert rec["traffic"]["source"] == "Observed" and rec["traffic"]["requests"] == 400
        assert rec["traffic"]["figures"]["rate"] == 20.0  # 20.3 to 2 significant figures
        assert rec["predicted"]["rate"] == 20.0  # planned at the observed rate

        admin.traffic = _busy(21.5)  # within 10% of the plan's 20: no new plan
        for _ in range(6):
            threading.Event().wait(0.5)
            now = _auto(api, name)
            assert now["recommendation"]["plannedAt"] == rec["plannedAt"]
            assert now["recommendation"]["inputs"] == rec["inputs"]
            assert now["choice"] == "tp8" and _revision(api, group) == revision

        admin.unavailable = True
        wait_for(lambda: _auto(api, name).get("observing"), 30, what="status.auto.observing")
        lost = _auto(api, name)
        assert "cannot be reached" in lost["observing"]["message"], lost
        assert "UNAVAILABLE" in lost["observing"]["message"]
        assert lost["choice"] == "tp8" and lost["recommendation"]["inputs"] == rec["inputs"]
        ready = condition(api.cr(NS, name), "Ready")
        assert ready["status"] == "False" and ready["reason"] == "RouterUnavailable", ready
        assert api.names(STS, {names.LABEL_DEPLOYMENT: name}) == {group}  # nothing torn down
        assert _revision(api, group) == revision
    finally:
        admin.unavailable = False
        admin.traffic = router_pb2.ObservedTraffic()
        api.delete_all_crs(NS)
