"""Egress per policy kind under the real operator (issue 31, item 5): kopf against kmock, one
deployment per docs/examples file (every policy kind the workers run, engine vllm too) and a
two-pod shift group; the NetworkPolicies the operator writes let a group's pods reach DNS, their
own group's pods (only when it spans several pods) and, for hf:// sources, HTTPS; the router
reaches DNS, its own workers' serving port and, for hf://, HTTPS. Nothing else leaves a pod.

Expectations come from the resource bodies (nodes, source, engine), not from render_network,
so a change in what the operator renders shows here. `policy: auto` is left out: it renders the
kind it plans (Shift for auto.yaml), and planning takes minutes on a loaded CPU beside six other
deployments; test_operator_network.py renders its policies, test_operator_auto.py runs it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kmock_harness import Api, OperatorProcess, StandInAdmin, condition, cr_metadata, wait_for

from gearshift.operator.reconcile import names

NS = "net"
POLICIES = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies"
EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "docs" / "examples").glob("*.yaml"))
DNS = {
    "to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
    "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
}
HTTPS = {"ports": [{"protocol": "TCP", "port": 443}]}


def _bodies() -> dict[str, dict[str, Any]]:
    """name → resource: every example, and shift.yaml with its group over two pods."""
    out = {}
    for path in EXAMPLES:
        body = dict(yaml.safe_load(path.read_text()))
        if "auto" not in body["spec"]["policy"]:
            out[f"net-{path.stem}"] = body
    multi = copy.deepcopy(out["net-shift"])
    multi["spec"]["group"].update(nodes=2, gpusPerNode=4)
    out["net-shift-2pods"] = multi
    for name, body in out.items():
        body["metadata"] = cr_metadata(name, NS)
        body["spec"]["replicas"] = 2  # two groups: each policy reaches its own group only
    return out


BODIES = _bodies()


@pytest.fixture(scope="module")
def deployed(api: Api, admin: StandInAdmin, operator_process: OperatorProcess) -> Iterator[None]:
    """Every body created at once: the operator reconciles them side by side."""
    assert operator_process.alive(), operator_process.log.read_text()[-3000:]
    for body in BODIES.values():
        api.create_cr(NS, copy.deepcopy(body))
    yield
    # Seven deployments' children, deleted by the operator on a loaded CPU: a wider bound.
    api.delete_all_crs(NS, timeout=240)


def _policy(api: Api, name: str) -> dict[str, Any]:
    found: dict[str, Any] = wait_for(
        lambda: api.get(f"{POLICIES}/{name}"), 90, f"NetworkPolicy {name}"
    )
    return found


def _rule_reaches(rule: dict[str, Any]) -> str:
    """What an egress rule opens, in words, for the assertion message."""
    return yaml.safe_dump(rule, default_flow_style=True).strip()


def test_every_policy_kind_is_covered() -> None:
    kinds = {next(iter(body["spec"]["policy"])) for body in BODIES.values()}
    assert kinds == {"static", "shift", "seesaw", "sidp", "tetris"}
    assert any(body["spec"].get("engine") == "vllm" for body in BODIES.values())


@pytest.mark.parametrize("name", sorted(BODIES))
def test_the_operator_writes_egress_that_follows_what_each_group_needs(
    name: str, api: Api, deployed: None
) -> None:
    spec = BODIES[name]["spec"]
    hf = spec["model"]["source"].startswith("hf://")
    vllm = spec.get("engine") == "vllm"
    for index in range(spec["replicas"]):
        group = {"podSelector": {"matchLabels": names.group_selector(name, index)}}
        policy = _policy(api, names.group_name(name, index))
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
        assert policy["spec"]["podSelector"] == group["podSelector"]
        expected = [DNS]
        if spec["group"]["nodes"] > 1:
            expected.append({"to": [group]})
        if hf:
            expected.append(HTTPS)
        egress = policy["spec"]["egress"]
        assert egress == expected, [_rule_reaches(r) for r in egress]

    router = _policy(api, names.router_name(name))
    workers = {names.LABEL_DEPLOYMENT: name, names.LABEL_COMPONENT: "worker"}
    port = names.VLLM_HTTP_PORT if vllm else names.WORKER_GRPC_PORT
    expected = [
        DNS,
        {
            "to": [{"podSelector": {"matchLabels": workers}}],
            "ports": [{"protocol": "TCP", "port": port}],
        },
    ]
    if hf:
        expected.append(HTTPS)
    assert router["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert router["spec"]["egress"] == expected
    # The Admin rule admits the operator's pods, never an empty (match-all) selector.
    admin_rule = next(
        r
        for r in router["spec"]["ingress"]
        if r["ports"] == [{"protocol": "TCP", "port": names.ROUTER_ADMIN_PORT}]
    )
    assert all(peer["podSelector"]["matchLabels"] for peer in admin_rule["from"])
    assert condition(api.cr(NS, name), "InvalidSpec").get("status") != "True"
