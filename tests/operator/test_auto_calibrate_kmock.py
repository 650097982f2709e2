"""``spec.policy.auto.calibrate`` end to end (issue 30, item 1): kopf against kmock creates the
profiling Job on a node of the group's GPU type with its least-privilege hand-off (ServiceAccount,
Role, RoleBinding, ConfigMap), waits, and once the Job has written its profile plans from it. There
is no kubelet: the test plays it, writing a profile measured by ``gearshift profile --layouts`` on
this CPU (relabelled as the H100 the node carries, cpu_profile.py) into the ConfigMap, as the Job's
``--configmap`` does, and marking the Job complete or failed."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cpu_profile import DTYPE, H100_NAME, LAYOUTS, MODEL, as_measured_on
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

from gearshift.operator.reconcile import names, render_config
from gearshift.operator.reconcile.spec import parse

NS = "auto-calibrate"
STS = f"/apis/apps/v1/namespaces/{NS}/statefulsets"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
CMS = f"/api/v1/namespaces/{NS}/configmaps"
RBAC = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}"
REPO = Path(__file__).resolve().parents[2]
FIELD = "spec.policy.auto.calibrate"
PRODUCT = "NVIDIA-H100-80GB-HBM3"
TRAFFIC = {"rate": 2, "prompt": {"fixed": 64}, "output": {"fixed": 16}}
PLAN_WAIT = 120
CALIBRATION = {names.LABEL_COMPONENT: "calibration"}


def _body(name: str, image: str = "ghcr.io/gearshift/worker:0.1.0", **auto: Any) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "docs/examples/auto.yaml").read_text())
    body["metadata"] = cr_metadata(name, NS)
    body["spec"]["group"] = {"nodes": 1, "gpusPerNode": 2}
    body["spec"]["model"]["dtype"] = DTYPE  # the profile's: it must have measured this dtype
    body["spec"]["images"]["worker"] = image
    a = body["spec"]["policy"]["auto"]
    a.pop("goodput")
    a.update(model=dict(MODEL), requests=20, traffic=copy.deepcopy(TRAFFIC), calibrate=True)
    a.update(auto)
    return body


@pytest.fixture(scope="module")
def operator_process(
    kmock_api: KmockApi, admin: StandInAdmin, hub: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """One attempt per calibration here: a failed Job is given up at once (its retries have
    their own test, test_auto_calibrate_retry_kmock.py)."""
    tmp = tmp_path_factory.mktemp("operator-calibrate")
    env = {"HF_ENDPOINT": hub.url, "GEARSHIFT_CALIBRATION_ATTEMPTS": "1"}
    with running_operator(kmock_api, admin, tmp, env) as op:
        yield op


@pytest.fixture(scope="module")
def h100_node(api: Api) -> Iterator[None]:
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "calibrate-node", "labels": {"nvidia.com/gpu.product": PRODUCT}},
    }
    code, data = api.call("POST", "/api/v1/nodes", node)
    assert code in (200, 201), data
    yield
    api.call("DELETE", "/api/v1/nodes/calibrate-node")


@pytest.fixture()
def one_at_a_time(api: Api, operator_process: OperatorProcess, h100_node: None) -> Iterator[None]:
    yield
    api.delete_all_crs(NS)


def _auto(api: Api, name: str) -> dict[str, Any]:
    return ((api.cr(NS, name) or {}).get("status") or {}).get("auto") or {}


def _jobs(api: Api) -> list[dict[str, Any]]:
    return api.items(JOBS, CALIBRATION)


def _owners(obj: dict[str, Any] | None) -> dict[str, bool]:
    refs = (obj or {}).get("metadata", {}).get("ownerReferences") or []
    return {r["name"]: bool(r.get("controller")) for r in refs}


def _job_status(api: Api, name: str, kind: str, reason: str, message: str) -> None:
    """What the Job controller writes when the pod ends."""
    cond = {"type": kind, "status": "True", "reason": reason, "message": message}
    status = {"conditions": [cond], ("succeeded" if kind == "Complete" else "failed"): 1}
    code, data = api.call("PATCH", f"{JOBS}/{name}", {"status": status})
    assert code == 200, data


def test_calibrate_runs_one_job_per_key_and_plans_from_its_profile(
    api: Api, operator_process: OperatorProcess, one_at_a_time: None, cpu_profile: str
) -> None:
    api.create_cr(NS, _body("calib-a"))
    (job,) = wait_for(lambda: _jobs(api), 30, what="the profiling Job")
    name = job["metadata"]["name"]
    assert name.startswith("gearshift-calibration-")
    # Waiting, not planning from the preset: nothing is rendered and the conditions say why.
    wait_for(lambda: condition(api.cr(NS, "calib-a"), "Ready").get("reason") == "Calibrating", 30)
    ready = condition(api.cr(NS, "calib-a"), "Ready")
    assert ready["status"] == "False" and f"Job {name}" in ready["message"], ready
    assert condition(api.cr(NS, "calib-a"), "Progressing")["reason"] == "Calibrating"
    assert not api.names(STS, {names.LABEL_DEPLOYMENT: "calib-a"}) and not _auto(api, "calib-a")

    # The Job: one node of the group's GPU type, that node's GPUs, hardened as a worker pod.
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": PRODUCT}
    (box,) = pod["containers"]
    assert box["resources"] == {
        "limits": {"nvidia.com/gpu": "2"},
        "requests": {"nvidia.com/gpu": "2"},
    }
    assert box["image"] == "ghcr.io/gearshift/worker:0.1.0" and box["command"] == ["gearshift"]
    args = box["args"]
    assert args[0] == "profile" and args[args.index("--layouts") + 1] == "tp2,sp2,pp2,shift2"
    assert (
        args[args.index("--configmap") + 1] == name and args[args.index("--device") + 1] == "cuda"
    )
    # The deployment's own model, fetched as a worker pod fetches it (hf:// source).
    assert args[args.index("--model") + 1] == render_config.model_path(parse(_body("calib-a")))
    assert pod["serviceAccountName"] == name and pod["automountServiceAccountToken"] is True
    assert pod["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] == 0
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert box["securityContext"]["readOnlyRootFilesystem"] is True
    assert box["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert [c["name"] for c in pod.get("initContainers", [])] == ["fetch-model"]  # hf:// source
    # The hand-off: the Job's own ServiceAccount may get and patch its one ConfigMap, no more.
    role = api.get(f"{RBAC}/roles/{name}")
    assert role is not None and role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": [name],
            "verbs": ["get", "patch"],
        }
    ]
    binding = api.get(f"{RBAC}/rolebindings/{name}")
    assert binding is not None and binding["roleRef"]["name"] == name
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": NS}]
    account = api.get(f"/api/v1/namespaces/{NS}/serviceaccounts/{name}")
    result = api.get(f"{CMS}/{name}")
    assert account is not None and result is not None and not result.get("data")
    for obj in (job, role, binding, account, result):  # garbage-collected with their last user
        assert _owners(obj) == {"calib-a": False}, obj["metadata"]
        assert names.LABEL_DEPLOYMENT not in obj["metadata"]["labels"]  # no one's child alone

    # The kubelet's part: the Job writes its profile (--configmap) and completes.
    text = as_measured_on(cpu_profile, H100_NAME)
    code, data = api.call("PATCH", f"{CMS}/{name}", {"data": {"profile.json": text}})
    assert code == 200, data
    _job_status(api, name, "Complete", "Completed", "")
    planned = wait_for(
        lambda: _auto(api, "calib-a").get("choice") and _auto(api, "calib-a"), PLAN_WAIT
    )
    assert planned["profile"]["configMap"] == name, planned
    assert planned["pricing"].startswith(f"the profile in ConfigMap {name}: profile of ")
    assert {line["name"] for line in planned["considered"]} == set(LAYOUTS)
    wait_for(lambda: api.names(STS, {names.LABEL_DEPLOYMENT: "calib-a"}), 30, what="the group")
    assert condition(api.cr(NS, "calib-a"), "InvalidSpec")["status"] == "False"

    # A second deployment with the same key reuses the Job and its profile: no second Job.
    api.create_cr(NS, _body("calib-b"))
    second = wait_for(
        lambda: _auto(api, "calib-b").get("choice") and _auto(api, "calib-b"), PLAN_WAIT
    )
    assert second["profile"]["configMap"] == name
    assert [j["metadata"]["name"] for j in _jobs(api)] == [name]
    wait_for(lambda: len(_owners(api.get(f"{JOBS}/{name}"))) == 2, 30, what="a second owner")
    assert _owners(api.get(f"{JOBS}/{name}")) == {"calib-a": False, "calib-b": False}
    assert _owners(api.get(f"{CMS}/{name}")) == {"calib-a": False, "calib-b": False}


def test_a_failed_job_and_calibrate_with_profile_are_refused_naming_the_field(
    api: Api, operator_process: OperatorProcess, one_at_a_time: None
) -> None:
    # Another worker image is another key: a Job of its own, which fails.
    api.create_cr(NS, _body("calib-fail", image="ghcr.io/gearshift/worker:0.1.1"))
    wait_for(
        lambda: any(
            "0.1.1" in j["spec"]["template"]["spec"]["containers"][0]["image"] for j in _jobs(api)
        ),
        30,
        what="the Job of the second image",
    )
    (job,) = [
        j for j in _jobs(api) if "0.1.1" in j["spec"]["template"]["spec"]["containers"][0]["image"]
    ]
    name = job["metadata"]["name"]
    _job_status(
        api, name, "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit"
    )
    wait_for(lambda: condition(api.cr(NS, "calib-fail"), "InvalidSpec").get("status") == "True", 30)
    invalid = condition(api.cr(NS, "calib-fail"), "InvalidSpec")
    assert invalid["reason"] == "SpecPolicyAutoCalibrate", invalid
    assert invalid["message"].startswith(f"{FIELD}: the profiling Job {name} failed"), invalid
    assert "BackoffLimitExceeded" in invalid["message"]
    assert not api.names(STS, {names.LABEL_DEPLOYMENT: "calib-fail"})

    jobs = len(_jobs(api))
    api.create_cr(NS, _body("calib-both", profile="some-profile"))
    wait_for(lambda: condition(api.cr(NS, "calib-both"), "InvalidSpec").get("status") == "True", 30)
    invalid = condition(api.cr(NS, "calib-both"), "InvalidSpec")
    assert invalid["message"].startswith(f"{FIELD}, spec.policy.auto.profile: set one"), invalid
    assert len(_jobs(api)) == jobs  # nothing was created for it
