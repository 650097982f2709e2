"""kopf runs for real against kmock: children, scaling, restarts, live policy, rolls, deletion."""

from __future__ import annotations

import base64
import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf import json_format
from kmock_harness import Api, OperatorProcess, StandInAdmin, condition, wait_for

from gearshift.operator.reconcile import names
from gearshift.v1 import policy_fields, policy_pb2

NS = "ml"
STS = f"/apis/apps/v1/namespaces/{NS}/statefulsets"
SVC = f"/api/v1/namespaces/{NS}/services"
PODS = f"/api/v1/namespaces/{NS}/pods"


def _resource(repo: Path, name: str, **spec: Any) -> dict[str, Any]:
    body = yaml.safe_load((repo / "docs/examples/shift.yaml").read_text())
    # kmock sets none of uid, generation, resourceVersion; kopf's finalizer JSON-patch tests the
    # resourceVersion, which kmock then never changes.
    body["metadata"] = {
        "name": name,
        "namespace": NS,
        "uid": f"uid-{name}",
        "generation": 1,
        "resourceVersion": "1",
    }
    body["spec"].update(copy.deepcopy(spec))
    return body


def _groups(api: Api, name: str) -> set[str]:
    return api.names(STS, {names.LABEL_DEPLOYMENT: name})


def _revision(api: Api, group: str) -> str:
    sts = api.get(f"{STS}/{group}")
    assert sts is not None
    return str(sts["metadata"]["labels"][names.LABEL_REVISION])


def _serve_all(admin: StandInAdmin, api: Api, name: str, policy: dict[str, Any]) -> None:
    """The stand-in router reports every group serving the revision its StatefulSet has."""
    for group in _groups(api, name):
        admin.serve(
            group, json_format.ParseDict(policy, policy_pb2.Policy()), _revision(api, group)
        )


def _make_pods(api: Api, name: str, group: str, nodes: int) -> None:
    for rank in range(nodes):
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{group}-{rank}",
                "namespace": NS,
                "labels": {names.LABEL_DEPLOYMENT: name, names.LABEL_GROUP: group},
            },
            "spec": {"containers": [{"name": "worker", "image": "w"}]},
            "status": {
                "phase": "Running",
                "containerStatuses": [{"name": "worker", "restartCount": 0}],
            },
        }
        code, data = api.call("POST", PODS, pod)
        assert code == 200, data


def _status(api: Api, name: str) -> dict[str, Any]:
    return (api.cr(NS, name) or {}).get("status") or {}


def test_example_creates_owned_children_and_is_ready_only_once_the_router_serves(
    api: Api, admin: StandInAdmin, operator_process: OperatorProcess, repo: Path
) -> None:
    name = "llama"
    api.create_cr(NS, _resource(repo, name, replicas=2))
    wait_for(lambda: _groups(api, name) == {"llama-g0", "llama-g1"}, what="two group StatefulSets")
    wait_for(
        lambda: condition(api.cr(NS, name), "Progressing").get("status") == "True",
        what="Progressing",
    )

    sts = api.get(f"{STS}/llama-g1")
    assert sts is not None
    assert sts["metadata"]["ownerReferences"][0] == {
        "apiVersion": "gearshift.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "name": name,
        "uid": "uid-llama",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:3] == ["worker", "--config", "/etc/gearshift/engine.json"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["GEARSHIFT_GROUP_ADDR"] == "llama-g1-0.llama-g1.ml.svc.cluster.local"
    assert env["GEARSHIFT_GROUP_SIZE"] == "8" and env["GEARSHIFT_RANKS_PER_NODE"] == "8"
    assert env["GEARSHIFT_NODE_RANK"] == {
        "fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}
    }
    assert (
        env["GEARSHIFT_GROUP_NAME"] == "llama-g1" and env["GEARSHIFT_CONFIG"] == names.ENGINE_CONFIG
    )
    assert {"llama-g0", "llama-g1", "llama-router", "llama-router-admin"} <= api.names(SVC)
    for path in (
        f"/apis/apps/v1/namespaces/{NS}/deployments/llama-router",
        f"/api/v1/namespaces/{NS}/configmaps/llama-config",
        f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/llama-workers",
    ):
        child = api.get(path)
        assert child is not None, path
        assert child["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"

    # The admin token: a Secret owned by the deployment, mounted into pods, presented to Admin.
    secret = api.get(f"/api/v1/namespaces/{NS}/secrets/{names.admin_secret(name)}")
    assert secret is not None and secret["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
    token = base64.b64decode(secret["data"][names.CONTROL_TOKEN_KEY]).decode()
    assert len(token) >= 32
    wait_for(lambda: f"Bearer {token}" in admin.authorization, what="Admin called with the token")
    policies = api.names(f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies")
    assert {"llama-g0", "llama-g1", "llama-router"} <= policies

    # Pods could be Running here; only the router's report makes the deployment Ready.
    assert condition(api.cr(NS, name), "Ready")["status"] == "False"
    _serve_all(admin, api, name, {"shift": {"sp": 4, "tp": 2, "threshold": 256}})
    wait_for(lambda: condition(api.cr(NS, name), "Ready").get("status") == "True", what="Ready")
    obj = api.cr(NS, name)
    assert condition(obj, "Progressing")["reason"] == "Complete"
    assert _status(api, name)["readyGroups"] == "2/2" and _status(api, name)["gear"] == "base"


def test_replicas_add_and_remove_whole_groups(
    api: Api, admin: StandInAdmin, operator_process: OperatorProcess, repo: Path
) -> None:
    name = "scale"
    api.create_cr(NS, _resource(repo, name, replicas=1))
    wait_for(lambda: _groups(api, name) == {"scale-g0"}, what="one group")
    api.patch_spec(NS, name, {"replicas": 3})
    wait_for(
        lambda: _groups(api, name) == {"scale-g0", "scale-g1", "scale-g2"}, what="three groups"
    )
    assert {"scale-g1", "scale-g2"} <= api.names(SVC)
    api.patch_spec(NS, name, {"replicas": 1})
    # kopf re-handles a spec change until its own annotation patch sticks, which against kmock
    # with a 0.5 s resync timer can take several passes on a loaded machine: bounded, not 20 s.
    wait_for(lambda: _groups(api, name) == {"scale-g0"}, 60, "back to one group")
    assert not {"scale-g1", "scale-g2"} & api.names(SVC)
    wait_for(lambda: _status(api, name).get("replicas") == 1, what="status.replicas")


def test_a_failing_pod_recreates_its_whole_group_with_restarts_in_status(
    api: Api, admin: StandInAdmin, operator_process: OperatorProcess, repo: Path
) -> None:
    name = "crash"
    api.create_cr(
        NS,
        _resource(
            repo,
            name,
            replicas=2,
            group={"nodes": 2, "gpusPerNode": 4},
            restartPolicy={
                "type": "RecreateGroupOnPodFailure",
                "backoffSeconds": 30,
                "maxRestarts": 3,
            },
        ),
    )
    wait_for(lambda: _groups(api, name) == {"crash-g0", "crash-g1"}, what="groups")
    for group in ("crash-g0", "crash-g1"):
        _make_pods(api, name, group, nodes=2)
    code, _ = api.call(
        "PATCH",
        f"{PODS}/crash-g0-1/status",
        {"status": {"containerStatuses": [{"name": "worker", "restartCount": 1}]}},
    )
    assert code == 200
    # Both ranks of group 0 go (the StatefulSet recreates them together); group 1 is untouched.
    wait_for(
        lambda: not api.names(PODS, {names.LABEL_GROUP: "crash-g0"}), what="group 0 pods deleted"
    )
    assert api.names(PODS, {names.LABEL_GROUP: "crash-g1"}) == {"crash-g1-0", "crash-g1-1"}
    groups = wait_for(
        lambda: {g["name"]: g for g in _status(api, name).get("groups", []) if g.get("restarts")},
        what="restart counted in status",
    )
    assert groups["crash-g0"]["restarts"] == 1 and "lastRestartTime" in groups["crash-g0"]
    degraded = condition(api.cr(NS, name), "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "GroupRestarting")
    assert "crash-g0" in degraded["message"] and "crash-g1" not in degraded["message"]

    # Crashing again inside the back-off window waits instead of restarting at once.
    _make_pods(api, name, "crash-g0", nodes=2)
    api.call(
        "PATCH",
        f"{PODS}/crash-g0-0/status",
        {"status": {"phase": "Failed", "reason": "Error"}},
    )
    wait_for(
        lambda: condition(api.cr(NS, name), "Degraded").get("message", "").count("back-off"),
        what="back-off reported",
    )
    assert api.names(PODS, {names.LABEL_GROUP: "crash-g0"}) == {"crash-g0-0", "crash-g0-1"}


def test_a_threshold_change_is_applied_live_and_a_layout_change_rolls_one_group_at_a_time(
    api: Api, admin: StandInAdmin, operator_process: OperatorProcess, repo: Path
) -> None:
    name = "live"
    api.create_cr(
        NS, _resource(repo, name, replicas=2, rollout={"maxUnavailable": 1, "maxSurge": 0})
    )
    wait_for(lambda: _groups(api, name) == {"live-g0", "live-g1"}, what="groups")
    policy = {"shift": {"sp": 4, "tp": 2, "threshold": 256}}
    _serve_all(admin, api, name, policy)
    for group in ("live-g0", "live-g1"):
        _make_pods(api, name, group, nodes=1)
    wait_for(lambda: condition(api.cr(NS, name), "Ready").get("status") == "True", what="Ready")
    revisions = {g: _revision(api, g) for g in _groups(api, name)}

    api.patch_spec(NS, name, {"policy": {"shift": {"sp": 4, "tp": 2, "threshold": 512}}})
    wait_for(
        lambda: all(admin.groups[g].policy.shift.threshold == 512 for g in revisions),
        what="live apply",
    )
    applied = admin.applied[-1]
    assert policy_fields.kind_of(applied) == "shift" and applied.shift.threshold == 512
    assert not applied.shift.HasField("sp"), "only live fields travel through ApplyPolicy"
    # No pod was recreated and no group changed revision.
    assert api.names(PODS, {names.LABEL_DEPLOYMENT: name}) == {"live-g0-0", "live-g1-0"}
    for group, rev in revisions.items():
        assert api.get(f"{STS}/{group}")["metadata"]["labels"][names.LABEL_REVISION] == rev
    engine = yaml.safe_load(
        api.get(f"/api/v1/namespaces/{NS}/configmaps/live-config")["data"]["engine.json"]
    )
    assert engine["policy"]["shift"]["threshold"] == 512

    # A layout change rolls: with maxUnavailable 1 only one group goes down at a time.
    api.patch_spec(NS, name, {"policy": {"shift": {"sp": 2, "tp": 4, "threshold": 512}}})

    def rolled() -> set[str]:
        return {g for g, rev in revisions.items() if _revision(api, g) != rev}

    first = wait_for(rolled, what="first group rolled")
    assert len(first) == 1
    (group,) = first
    # The operator relabels the group's StatefulSet, then deletes its pods (bounded: a loaded
    # machine may show the first before the second).
    wait_for(
        lambda: not api.names(PODS, {names.LABEL_GROUP: group}),
        what="the rolled group's pods replaced",
    )
    # The stand-in still says "serving" at the old revision, as a router may for a moment.
    other = ({"live-g0", "live-g1"} - first).pop()
    for _ in range(8):  # several passes: the second group waits while the first is not back
        assert rolled() == first
        time.sleep(0.25)
    assert api.names(PODS, {names.LABEL_GROUP: other}) == {f"{other}-0"}
    new_policy = json_format.ParseDict(
        {"shift": {"sp": 2, "tp": 4, "threshold": 512}}, policy_pb2.Policy()
    )
    admin.serve(group, new_policy, _revision(api, group))
    wait_for(lambda: rolled() == {"live-g0", "live-g1"}, what="second group rolled")
    admin.serve(other, new_policy, _revision(api, other))
    wait_for(
        lambda: condition(api.cr(NS, name), "Progressing").get("reason") == "Complete",
        what="rollout complete",
    )


def test_deleting_the_resource_removes_every_child(
    api: Api, admin: StandInAdmin, operator_process: OperatorProcess, repo: Path
) -> None:
    name = "gone"
    api.create_cr(NS, _resource(repo, name, replicas=2))
    wait_for(lambda: _groups(api, name) == {"gone-g0", "gone-g1"}, what="groups")
    wait_for(
        lambda: (api.cr(NS, name) or {}).get("metadata", {}).get("finalizers"), what="finalizer"
    )
    code, _ = api.call("DELETE", f"{CR_PATH}/{name}")
    assert code == 200
    wait_for(lambda: api.cr(NS, name) is None, what="resource gone")
    label = {names.LABEL_DEPLOYMENT: name}
    assert not _groups(api, name)
    assert not api.names(SVC, label)
    assert not api.names(f"/apis/apps/v1/namespaces/{NS}/deployments", label)
    assert not api.names(f"/api/v1/namespaces/{NS}/configmaps", label)


CR_PATH = f"/apis/{names.GROUP}/{names.VERSION}/namespaces/{NS}/{names.PLURAL}"


@pytest.fixture(autouse=True)
def _one_deployment_at_a_time(api: Api, operator_process: OperatorProcess) -> Iterator[None]:
    """Each test starts with a live operator and leaves no InferenceDeployment behind."""
    assert operator_process.alive(), operator_process.log.read_text()[-3000:]
    yield
    for obj in api.items(CR_PATH):
        api.call("DELETE", f"{CR_PATH}/{obj['metadata']['name']}")
    wait_for(lambda: not api.items(CR_PATH), 60, "test deployments deleted")
