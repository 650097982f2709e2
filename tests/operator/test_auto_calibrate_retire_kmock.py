"""A calibration a deployment no longer uses is let go (calibration_run.retire), end to end: kopf
against kmock. When a deployment's calibration key changes (here a typo in the worker image's tag
fixed), or it turns ``calibrate`` off, its reference goes from the old calibration's objects and a
calibration no deployment references any more is deleted, running Job and hand-off alike (kmock,
like a cluster whose garbage collector lags, deletes nothing by itself); one another deployment
still references keeps running for it. No kubelet: the Jobs never finish, as on a node still
profiling."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cpu_profile import MODEL
from kmock_harness import (
    CR_PATH,
    Api,
    KmockApi,
    OperatorProcess,
    StandInAdmin,
    cr_metadata,
    running_operator,
    wait_for,
)

from gearshift.operator.reconcile import names

NS = "auto-calibrate-retire"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
CMS = f"/api/v1/namespaces/{NS}/configmaps"
SAS = f"/api/v1/namespaces/{NS}/serviceaccounts"
RBAC = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}"
# Every kind of a calibration's objects, by the path they are listed at.
KINDS = (JOBS, CMS, SAS, f"{RBAC}/roles", f"{RBAC}/rolebindings")
REPO = Path(__file__).resolve().parents[2]
CALIBRATION = {names.LABEL_COMPONENT: "calibration"}
TYPO = "ghcr.io/gearshift/worker:0.1.O"  # the letter O: an image that never pulls
FIXED = "ghcr.io/gearshift/worker:0.1.0"
WAIT = 30


def _body(name: str, image: str = FIXED) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "docs/examples/auto.yaml").read_text())
    body["metadata"] = cr_metadata(name, NS)
    body["spec"]["group"] = {"nodes": 1, "gpusPerNode": 2}
    body["spec"]["images"]["worker"] = image
    a = body["spec"]["policy"]["auto"]
    a.pop("goodput")
    traffic = {"rate": 2, "prompt": {"fixed": 64}, "output": {"fixed": 16}}
    a.update(model=dict(MODEL), requests=20, traffic=copy.deepcopy(traffic), calibrate=True)
    return body


@pytest.fixture(scope="module")
def operator_process(
    kmock_api: KmockApi, admin: StandInAdmin, hub: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    tmp = tmp_path_factory.mktemp("operator-calibrate-retire")
    env = {"HF_ENDPOINT": hub.url, "GEARSHIFT_CALIBRATION_ATTEMPTS": "1"}
    with running_operator(kmock_api, admin, tmp, env) as op:
        yield op


@pytest.fixture(scope="module")
def h100_node(api: Api) -> Iterator[None]:
    labels = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "retire-node", "labels": labels},
    }
    code, data = api.call("POST", "/api/v1/nodes", node)
    assert code in (200, 201), data
    yield
    api.call("DELETE", "/api/v1/nodes/retire-node")


@pytest.fixture()
def one_at_a_time(api: Api, operator_process: OperatorProcess, h100_node: None) -> Iterator[None]:
    """Each test starts with no deployment and no calibration object in the namespace."""
    yield
    api.delete_all_crs(NS)
    for path in KINDS:  # what a failed test left behind
        for obj in api.items(path, CALIBRATION):
            api.call("DELETE", f"{path}/{obj['metadata']['name']}")


def _jobs(api: Api) -> dict[str, dict[str, Any]]:
    return {j["metadata"]["name"]: j for j in api.items(JOBS, CALIBRATION)}


def _image(job: dict[str, Any]) -> str:
    return str(job["spec"]["template"]["spec"]["containers"][0]["image"])


def _owners(obj: dict[str, Any] | None) -> set[str]:
    return {r["name"] for r in (obj or {}).get("metadata", {}).get("ownerReferences") or []}


def _calibration_objects(api: Api, name: str) -> list[str]:
    """The paths of calibration ``name``'s objects that exist."""
    return [f"{path}/{name}" for path in KINDS if api.get(f"{path}/{name}") is not None]


def _job_of(api: Api, image: str) -> dict[str, Any] | None:
    return next((j for j in _jobs(api).values() if _image(j) == image), None)


def test_a_changed_key_deletes_the_old_running_job_and_runs_the_new_one(
    api: Api, one_at_a_time: None
) -> None:
    api.create_cr(NS, _body("retire-key", TYPO))
    old = wait_for(lambda: _job_of(api, TYPO), WAIT, what="the Job of the mistyped image")
    old_name = old["metadata"]["name"]
    assert len(_calibration_objects(api, old_name)) == 5

    api.patch_spec(NS, "retire-key", {"images": {"worker": FIXED}})
    new = wait_for(lambda: _job_of(api, FIXED), WAIT, what="the Job of the fixed image")
    assert _owners(new) == {"retire-key"}
    # The old Job was still running (no Complete/Failed condition): deleted with its hand-off.
    wait_for(
        lambda: not _calibration_objects(api, old_name),
        WAIT,
        what=f"the objects of the old calibration {old_name} deleted",
    )
    assert list(_jobs(api)) == [new["metadata"]["name"]]


def test_calibrate_false_leaves_no_job(api: Api, one_at_a_time: None) -> None:
    api.create_cr(NS, _body("retire-off"))
    (name,) = wait_for(lambda: list(_jobs(api)), WAIT, what="the profiling Job")

    api.patch_spec(NS, "retire-off", {"policy": {"auto": {"calibrate": False}}})
    wait_for(lambda: not _jobs(api), WAIT, what="no calibration Job left")
    wait_for(lambda: not _calibration_objects(api, name), WAIT, what="its hand-off deleted")


def test_a_calibration_another_deployment_uses_keeps_running_for_it(
    api: Api, one_at_a_time: None
) -> None:
    api.create_cr(NS, _body("retire-a"))
    (name,) = wait_for(lambda: list(_jobs(api)), WAIT, what="the profiling Job")
    api.create_cr(NS, _body("retire-b"))
    wait_for(
        lambda: _owners(api.get(f"{JOBS}/{name}")) == {"retire-a", "retire-b"},
        WAIT,
        what="the second deployment on the shared Job",
    )

    api.patch_spec(NS, "retire-a", {"policy": {"auto": {"calibrate": False}}})
    wait_for(
        lambda: _owners(api.get(f"{JOBS}/{name}")) == {"retire-b"},
        WAIT,
        what="retire-a's reference removed from the Job",
    )
    for path in _calibration_objects(api, name):
        assert _owners(api.get(path)) == {"retire-b"}, path
    assert len(_calibration_objects(api, name)) == 5 and list(_jobs(api)) == [name]

    # Its last user deleted: the calibration goes with it.
    code, data = api.call("DELETE", f"{CR_PATH.format(ns=NS)}/retire-b")
    assert code in (200, 202), data
    wait_for(lambda: not _calibration_objects(api, name), WAIT, what="the calibration deleted")
