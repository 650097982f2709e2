"""``spec.policy.auto.calibrate`` without a cluster (issue 30, item 1): what is refused naming the
field, what one calibration is shared by, the node it runs on, the wait with a running choice,
and the chart's calibration guard (its CEL evaluated with cel-python) admitting exactly the
operator's own calibration objects. kopf against kmock: test_auto_calibrate_kmock.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
import pytest
import yaml
from cpu_profile import MODEL
from test_operator_chart import K8S_VERSION, _render, helm  # noqa: F401  (helm: a fixture)

from gearshift.operator.reconcile import auto, calibration, calibration_run
from gearshift.operator.reconcile.reconciler import runnable
from gearshift.operator.reconcile.spec import SpecError, parse

REPO = Path(__file__).resolve().parents[2]
FIELD = "spec.policy.auto.calibrate"
OPERATOR = "system:serviceaccount:gearshift-system:gs-gearshift"
H100 = "NVIDIA-H100-80GB-HBM3"


def _body(name: str = "a", **auto_fields: Any) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "docs/examples/auto.yaml").read_text())
    body["metadata"].update(name=name, namespace="ns", uid=f"uid-{name}", generation=1)
    body["spec"]["group"] = {"nodes": 1, "gpusPerNode": 2}
    a = body["spec"]["policy"]["auto"]
    a.update(model=dict(MODEL), calibrate=True)
    a.update(auto_fields)
    return body


def _node(product: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": product, "labels": {calibration.GPU_LABEL: product, **labels}}}


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"policy": {"profile": "p"}}, f"{FIELD}, spec.policy.auto.profile: set one"),
        ({"group": {"nodes": 2, "gpusPerNode": 8}}, "the group spans several nodes"),
        ({"group": {"nodes": 1, "gpusPerNode": 2, "gpuResource": ""}}, "runs on no GPU"),
        ({"worker": "reg:5000/gs/worker"}, "'reg:5000/gs/worker' names no version"),
        ({"worker": "gs/worker:latest"}, "'gs/worker:latest' names no version"),
    ],
    ids=["with-profile", "two-nodes", "no-gpu", "untagged-image", "latest-image"],
)
def test_what_cannot_be_calibrated_is_refused_naming_the_field(
    change: dict[str, Any], says: str
) -> None:
    body = _body()
    if "policy" in change:
        body["spec"]["policy"]["auto"].update(change["policy"])
    elif "worker" in change:
        body["spec"]["images"]["worker"] = change["worker"]
    else:
        body["spec"]["group"] = change["group"]
    with pytest.raises(SpecError, match=says) as err:
        calibration.check(parse(body))
    assert err.value.field == FIELD and str(err.value).startswith(FIELD)


@pytest.mark.parametrize(
    "image", ["reg:5000/gs/worker:0.2", "gs/worker:latest@sha256:" + "0" * 64, "gs/worker@sha256:1"]
)
def test_an_image_pinned_by_a_tag_or_a_digest_is_calibrated(image: str) -> None:
    body = _body()
    body["spec"]["images"]["worker"] = image
    calibration.check(parse(body))  # no SpecError


def test_one_calibration_serves_every_deployment_of_the_same_shape_gpu_image_and_size() -> None:
    base = calibration.key(parse(_body("a")), "H100")
    other_traffic = _body("b", traffic={"rate": 99})
    assert calibration.key(parse(other_traffic), "H100") == base
    image = _body("c")
    image["spec"]["images"]["worker"] = "ghcr.io/gearshift/worker:0.2.0"
    wider = _body("d")
    wider["spec"]["group"]["gpusPerNode"] = 4
    shape = _body("e", model={**MODEL, "numHiddenLayers": 3})
    keys = {
        calibration.key(parse(image), "H100"),
        calibration.key(parse(wider), "H100"),
        calibration.key(parse(shape), "H100"),
        calibration.key(parse(_body("f")), "H200"),
    }
    assert base not in keys and len(keys) == 4
    assert calibration.layouts(4) == ["tp4", "sp4", "pp4", "shift4"]
    assert calibration.layouts(1) == ["one"]


def test_the_job_runs_on_a_node_of_the_groups_gpu_type() -> None:
    spec = parse(_body())
    nodes = [_node("NVIDIA-H200"), _node(H100), _node("NVIDIA-H100-PCIe")]
    assert calibration_run.product_of(spec, "H100", nodes) == H100
    job = calibration.job(spec, "H100", H100, "k")
    assert job["spec"]["template"]["spec"]["nodeSelector"] == {
        **spec.scheduling.node_selector,
        calibration.GPU_LABEL: H100,
    }
    with pytest.raises(SpecError, match=f"^{FIELD}: no node .* carries a L4 GPU") as err:
        calibration_run.product_of(spec, "L4", nodes)
    assert err.value.field == FIELD


def test_in_process_planning_refuses_calibrate() -> None:
    with pytest.raises(SpecError, match=f"^{FIELD}: runs a profiling Job"):
        runnable(_body(), {}, [_node(H100)])


def test_while_calibrating_a_running_choice_keeps_running_and_none_waits() -> None:
    spec = parse(_body())
    running = {"policy": {"static": {"tp": 2}}, "choice": "tp2", "planning": {"message": "x"}}
    held = auto.hold(spec, running, "calibrating")
    assert held.status["calibrating"] == {"message": "calibrating"} and not held.planned
    assert "planning" not in held.status and held.status["choice"] == "tp2"
    assert held.spec.policy.static.tp == 2
    with pytest.raises(auto.Waiting) as wait:
        auto.hold(spec, {}, "calibrating")
    assert wait.value.reason == "Calibrating" and not wait.value.timed_out


def _admitted(
    policy: dict[str, Any],
    obj: dict[str, Any],
    resource: str,
    who: str = OPERATOR,
    operation: str = "CREATE",
) -> bool | None:
    """The guard's verdict on creating (or deleting) ``obj`` (None: the request is not the
    operator's)."""
    env = celpy.Environment()
    deleting = operation == "DELETE"
    activation = {
        "request": celpy.json_to_cel(
            {
                "operation": operation,
                "name": obj["metadata"]["name"],
                "namespace": "ns",
                "userInfo": {"username": who},
                "resource": {"resource": resource},
            }
        ),
        "object": celpy.json_to_cel(None if deleting else obj),
        "oldObject": celpy.json_to_cel(obj if deleting else None),
    }

    def holds(expression: str) -> bool:
        try:
            return bool(env.program(env.compile(expression)).evaluate(activation))
        except Exception:  # noqa: BLE001 - a CEL runtime error denies, as the API server does
            return False

    if not all(holds(c["expression"]) for c in policy["spec"]["matchConditions"]):
        return None
    return all(holds(v["expression"]) for v in policy["spec"]["validations"])


RESOURCES = {
    "Job": "jobs",
    "ServiceAccount": "serviceaccounts",
    "Role": "roles",
    "RoleBinding": "rolebindings",
}


def test_the_calibration_guard_admits_the_operators_own_objects_only(helm: Path) -> None:  # noqa: F811
    policy = next(
        d
        for d in _render(helm, "clusterWide=true")
        if d["kind"] == "ValidatingAdmissionPolicy"
        and d["metadata"]["name"].endswith("-calibration")
    )
    made = {
        m["kind"]: m for m in calibration.manifests(parse(_body()), "H100", H100, "0123456789ab")
    }
    for kind, resource in RESOURCES.items():
        assert _admitted(policy, made[kind], resource) is True, kind
        assert _admitted(policy, made[kind], resource, "jane@example.com") is None
    role, binding = made["Role"], made["RoleBinding"]
    bad: list[tuple[dict[str, Any], str]] = []
    for change in (
        lambda r: r["rules"][0]["verbs"].append("list"),
        lambda r: r["rules"][0].update(resourceNames=["db-config"]),
        lambda r: r["rules"][0].update(resources=["secrets"]),
        lambda r: r["rules"][0].pop("resourceNames"),
        lambda r: r["rules"].append(copy.deepcopy(r["rules"][0])),
    ):
        r = copy.deepcopy(role)
        change(r)
        bad.append((r, "roles"))
    b = copy.deepcopy(binding)
    b["subjects"][0]["name"] = "default"
    bad.append((b, "rolebindings"))
    b = copy.deepcopy(binding)
    b["roleRef"] = {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "admin"}
    bad.append((b, "rolebindings"))
    j = copy.deepcopy(made["Job"])
    j["metadata"]["name"] = "miner"
    bad.append((j, "jobs"))
    s = copy.deepcopy(made["ServiceAccount"])
    del s["metadata"]["labels"][calibration.LABEL_CALIBRATION]
    bad.append((s, "serviceaccounts"))
    for obj, resource in bad:
        assert _admitted(policy, obj, resource) is False, obj


def test_the_calibration_objects_are_valid_kubernetes() -> None:
    made = calibration.manifests(parse(_body()), "H100", H100, "0123456789ab")
    assert [m["kind"] for m in made] == [
        "ConfigMap",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Job",
    ]
    for manifest in made:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def test_the_calibration_guard_lets_the_operator_delete_only_its_calibration_objects(
    helm: Path,  # noqa: F811
) -> None:
    """A failed Job is deleted to be tried again, and a calibration no deployment uses any more
    is deleted whole (calibration_run.retire): admitted for the calibration's own objects only."""
    policy = next(
        d
        for d in _render(helm, "clusterWide=true")
        if d["kind"] == "ValidatingAdmissionPolicy"
        and d["metadata"]["name"].endswith("-calibration")
    )
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    for resource in RESOURCES.values():
        assert "DELETE" in next(r for r in rules if resource in r["resources"])["operations"]
    made = {
        m["kind"]: m for m in calibration.manifests(parse(_body()), "H100", H100, "0123456789ab")
    }
    for kind, resource in RESOURCES.items():
        assert _admitted(policy, made[kind], resource, operation="DELETE") is True, kind
        other = copy.deepcopy(made[kind])
        other["metadata"]["name"] = "nightly-backup"
        del other["metadata"]["labels"][calibration.LABEL_CALIBRATION]
        assert _admitted(policy, other, resource, operation="DELETE") is False, kind
        assert _admitted(policy, other, resource, "jane@example.com", operation="DELETE") is None
        unlabelled = copy.deepcopy(made[kind])  # the name alone is not enough
        del unlabelled["metadata"]["labels"][calibration.LABEL_CALIBRATION]
        assert _admitted(policy, unlabelled, resource, operation="DELETE") is False, kind


def test_the_operator_may_list_jobs_and_delete_the_calibration_kinds_only_with_calibration(
    helm: Path,  # noqa: F811
) -> None:
    """What retiring an unused calibration needs (calibration_run.retire), under
    rbac.calibration: list Jobs (to find them), delete Jobs, ServiceAccounts, Roles and
    RoleBindings (the ConfigMap is deleted under the operator's configmaps rule)."""

    def verbs(*values: str) -> dict[str, set[str]]:
        (role,) = [
            d
            for d in _render(helm, *values)
            if d["kind"] == "ClusterRole"
            and not d["metadata"]["name"].endswith(("-node-read", "-crd-read"))
        ]
        out: dict[str, set[str]] = {}
        for rule in role["rules"]:
            for resource in rule["resources"]:
                out.setdefault(resource, set()).update(rule["verbs"])
        return out

    granted = verbs("clusterWide=true")
    assert {"get", "list", "delete"} <= granted["jobs"] and "watch" not in granted["jobs"]
    for resource in ("serviceaccounts", "roles", "rolebindings"):
        assert granted[resource] == {"get", "create", "patch", "delete"}, resource
    assert {"list", "delete"} <= granted["configmaps"]
    without = verbs("clusterWide=true", "rbac.calibration=false")
    assert not {"jobs", "serviceaccounts", "roles", "rolebindings"} & set(without)
