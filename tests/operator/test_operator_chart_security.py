"""The chart's security (issue 31, items 2 and 5): the rendered RBAC, the operator's key, the
ValidatingAdmissionPolicy that confines the operator's Secret writes to its own token Secrets
(its CEL evaluated with cel-python for the requests that matter), the DNS pods of the
NetworkPolicies."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
import pytest
from test_operator_chart import K8S_VERSION, _render, helm  # noqa: F401  (helm: a fixture)

OPERATOR = "system:serviceaccount:gearshift-system:gs-gearshift"


def _rules(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [rule for d in docs if d["kind"] == kind for rule in d.get("rules", [])]


@pytest.mark.parametrize(
    "values",
    [(), ("watchNamespaces={ml,research}",), ("clusterWide=true",)],
    ids=["namespaced", "two-namespaces", "cluster-wide"],
)
def test_no_secret_can_be_read_and_only_cluster_wide_mode_writes_them_cluster_wide(
    helm: Path,  # noqa: F811
    values: tuple[str, ...],
) -> None:
    docs = _render(helm, *values)
    secret_rules = [
        (d["kind"], set(rule["verbs"]))
        for d in docs
        if d["kind"] in ("Role", "ClusterRole")
        for rule in d["rules"]
        if "secrets" in rule["resources"]
    ]
    assert secret_rules, "the operator writes its token Secrets"
    assert all(verbs == {"create", "patch"} for _, verbs in secret_rules)  # no get/list/delete
    cluster_wide = {kind for kind, _ in secret_rules} == {"ClusterRole"}
    assert cluster_wide == ("clusterWide=true" in values)
    # Every mode ships the guard, bound to the policy.
    kinds = {d["kind"]: d for d in docs}
    binding = kinds["ValidatingAdmissionPolicyBinding"]
    assert binding["spec"]["policyName"] == kinds["ValidatingAdmissionPolicy"]["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]


def test_the_guard_is_valid_kubernetes_and_can_be_turned_off(helm: Path) -> None:  # noqa: F811
    docs = _render(helm, "clusterWide=true")
    for doc in docs:
        if doc["kind"].startswith("ValidatingAdmissionPolicy"):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    off = _render(helm, "rbac.secretGuard=false")
    assert not any(d["kind"].startswith("ValidatingAdmissionPolicy") for d in off)


def test_the_operator_key_is_a_mounted_secret_of_the_release(helm: Path) -> None:  # noqa: F811
    docs = _render(helm)
    key = next(d for d in docs if d["kind"] == "Secret")
    assert key["metadata"]["name"] == "gs-gearshift-key"
    assert key["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(key["data"]["key"]) >= 64
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "key")
    assert volume["secret"]["secretName"] == "gs-gearshift-key"
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["GEARSHIFT_OPERATOR_KEY_FILE"] == "/etc/gearshift-operator/key"
    # A Secret the user manages instead (GitOps): named, not rendered.
    mine = _render(helm, "operator.keySecret=my-key")
    assert not any(d["kind"] == "Secret" for d in mine)
    pod = next(d for d in mine if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "key")["secret"]["secretName"] == "my-key"


def _secret(name: str, labels: dict[str, str] | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ml"}
    if labels is not None:
        meta["labels"] = labels
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta}


OURS = {"app.kubernetes.io/managed-by": "gearshift-operator", "gearshift.dev/deployment": "llama"}
THEIRS = {"app": "billing"}

CASES = [
    # (who, operation, name, new labels, old labels, allowed)
    (OPERATOR, "CREATE", "llama-admin-token", OURS, None, True),
    (OPERATOR, "CREATE", "llama-control-token", OURS, None, True),
    (OPERATOR, "UPDATE", "llama-control-token", OURS, OURS, True),  # a rotation
    (OPERATOR, "DELETE", "llama-admin-token", None, OURS, True),
    (OPERATOR, "CREATE", "llama-admin-token", None, None, False),  # unlabelled
    (OPERATOR, "CREATE", "db-password", OURS, None, False),  # not a token Secret's name
    (OPERATOR, "UPDATE", "llama-admin-token", OURS, None, False),  # someone else's, same name
    (OPERATOR, "UPDATE", "llama-admin-token", OURS, THEIRS, False),
    (OPERATOR, "UPDATE", "db-control-token", THEIRS, THEIRS, False),
    (OPERATOR, "DELETE", "db-password", None, THEIRS, False),
    (OPERATOR, "UPDATE", "llama-admin-token", THEIRS, OURS, False),  # no unlabelling
    # Other users are not matched at all: the policy never judges their requests.
    ("system:serviceaccount:ml:app", "CREATE", "db-password", THEIRS, None, None),
    ("jane@example.com", "DELETE", "llama-admin-token", None, OURS, None),
]


@pytest.mark.parametrize(("who", "op", "name", "new", "old", "allowed"), CASES)
def test_the_guard_admits_only_the_operators_own_labelled_token_secrets(
    helm: Path,  # noqa: F811
    who: str,
    op: str,
    name: str,
    new: dict[str, str] | None,
    old: dict[str, str] | None,
    allowed: bool | None,
) -> None:
    policy = next(
        d for d in _render(helm, "clusterWide=true") if d["kind"] == "ValidatingAdmissionPolicy"
    )
    env = celpy.Environment()
    activation = {
        "request": celpy.json_to_cel(
            {"operation": op, "name": name, "namespace": "ml", "userInfo": {"username": who}}
        ),
        "object": celpy.json_to_cel(_secret(name, new) if op != "DELETE" else None),
        "oldObject": celpy.json_to_cel(_secret(name, old) if op != "CREATE" else None),
    }

    def holds(expression: str) -> bool:
        try:
            return bool(env.program(env.compile(expression)).evaluate(activation))
        except Exception:  # noqa: BLE001 - a CEL runtime error denies, as the API server does
            return False

    matched = all(holds(c["expression"]) for c in policy["spec"]["matchConditions"])
    if allowed is None:
        assert not matched
        return
    assert matched
    verdicts = [holds(v["expression"]) for v in policy["spec"]["validations"]]
    assert all(verdicts) is allowed, verdicts


def test_the_dns_pods_can_be_named_for_the_network_policies(helm: Path) -> None:  # noqa: F811
    def env(*values: str) -> dict[str, str | None]:
        docs = _render(helm, *values)
        pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
        return {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}

    assert "GEARSHIFT_DNS_LABELS" not in env()
    named = env("dnsPodLabels.app=node-dns", "dnsPodLabels.tier=dns")
    assert named["GEARSHIFT_DNS_LABELS"] == "app=node-dns,tier=dns"


def _documented_rbac() -> set[tuple[str, str, str]]:
    """(API group, resource, verb) for every row of docs/operator.md's RBAC table."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "operator.md").read_text()
    table = text.split("**RBAC, verb by verb.**", 1)[1].split("\n\n", 2)[1]
    out = set()
    for row in table.splitlines()[2:]:
        what, verbs, why = (cell.strip() for cell in row.strip("|").split("|"))
        assert why, f"the RBAC row {what} says why"
        tokens = re.findall(r"`([^`]*)`", re.sub(r"\(.*?\)", "", what))
        # API groups: the core group `""`, dotted names, and the three built-in plain ones.
        groups = [t for t in tokens if t in ('""', "apps", "policy", "batch") or "." in t]
        resources = [t for t in tokens if t not in groups]
        assert groups and resources, row
        out |= {
            (g.strip('"'), r, v.strip())
            for g in groups
            for r in resources
            for v in verbs.split(",")
        }
    return out


def test_docs_rbac_table_lists_every_rendered_verb_and_nothing_else(helm: Path) -> None:  # noqa: F811
    everything = ("clusterWide=true", "rbac.volcano=true", "rbac.coscheduling=true")
    rendered = {
        (group, resource, verb)
        for rule in _rules(_render(helm, *everything), "ClusterRole")
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert ("", "secrets", "create") in rendered
    assert _documented_rbac() == rendered
