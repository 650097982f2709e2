"""A stuck `policy: auto` planner (issue 30, item 4): kopf against kmock with a 2 s plan timeout.
A plan that runs past it is stopped (its child process killed), the deployment says so in a
condition naming the field, and the operator keeps reconciling other deployments meanwhile."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from kmock_harness import (
    Api,
    KmockApi,
    OperatorProcess,
    StandInAdmin,
    condition,
    cr_metadata,
    running_operator,
    wait_for,
)

from gearshift.operator.reconcile import names

NS = "auto-timeout"
STS = f"/apis/apps/v1/namespaces/{NS}/statefulsets"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def operator_process(
    kmock_api: KmockApi, admin: StandInAdmin, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    tmp = tmp_path_factory.mktemp("operator-timeout")
    env = {"GEARSHIFT_PLAN_TIMEOUT_SECONDS": "2", "GEARSHIFT_PLAN_RETRY_SECONDS": "3600"}
    with running_operator(kmock_api, admin, tmp, env) as op:
        yield op


def _example(name: str, example: str) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "docs/examples" / example).read_text())
    body["metadata"] = cr_metadata(name, NS)
    return body


def _planners(op: OperatorProcess) -> list[psutil.Process]:
    assert op._proc is not None
    return [
        p
        for p in psutil.Process(op._proc.pid).children(recursive=True)
        if "spawn_main" in " ".join(p.cmdline())  # not the resource tracker
    ]


def test_a_plan_past_the_timeout_is_stopped_with_a_condition_and_nothing_hangs(
    api: Api, admin: StandInAdmin, operator_process: OperatorProcess
) -> None:
    slow = _example("slow", "auto.yaml")
    a = slow["spec"]["policy"]["auto"]
    # Every policy the simulator runs, 5000 requests per rate point: minutes of simulation.
    a.update(gpu="H100", requests=5000, traffic=copy.deepcopy(a["traffic"]))
    api.create_cr(NS, slow)
    wait_for(lambda: _planners(operator_process), 30, what="the planner's child process")
    # Meanwhile another deployment is reconciled: the pass never waits on a plan.
    api.create_cr(NS, _example("plain", "static.yaml"))
    wait_for(lambda: api.names(STS, {names.LABEL_DEPLOYMENT: "plain"}), 30, what="plain's group")

    wait_for(
        lambda: condition(api.cr(NS, "slow"), "Degraded").get("reason") == "PlannerTimedOut",
        60,
        what="PlannerTimedOut",
    )
    degraded = condition(api.cr(NS, "slow"), "Degraded")
    assert degraded["status"] == "True"
    assert "spec.policy.auto" in degraded["message"] and "2 s" in degraded["message"]
    ready = condition(api.cr(NS, "slow"), "Ready")
    assert ready["status"] == "False" and ready["reason"] == "PlannerTimedOut"
    assert api.names(STS, {names.LABEL_DEPLOYMENT: "slow"}) == set()  # nothing to run yet
    wait_for(lambda: not _planners(operator_process), 10, what="the planner killed")
    assert operator_process.alive()
    api.delete_all_crs(NS)
