"""Egress of a deployment's NetworkPolicies and the Admin rule (issue 31, item 5): every pod
may reach DNS; worker groups reach only their own pods (when they span several) and, for hf://
sources, the Hub over HTTPS; the router only its workers; the Admin rule never admits every pod;
the rendezvous port is open only to the group. Rendered for every policy kind's example."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gearshift.operator.reconcile import names, render_network
from gearshift.operator.reconcile.render_network import DnsPeer, OperatorPeer
from gearshift.operator.reconcile.settings import OperatorSettings
from gearshift.operator.reconcile.spec import DeploymentSpec, SpecError, parse
from gearshift.v1 import policy_fields

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "docs" / "examples").glob("*.yaml"))
K8S_VERSION = kubernetes_validate.utils.latest_version()
DNS = {
    "to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
    "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
}
HTTPS = {"ports": [{"protocol": "TCP", "port": 443}]}


def _spec(example: str, **spec: Any) -> DeploymentSpec:
    body = dict(yaml.safe_load((REPO / "docs" / "examples" / f"{example}.yaml").read_text()))
    body["metadata"].update(namespace="ml", uid="u-1")
    for key, value in spec.items():
        body["spec"][key] = copy.deepcopy(value)
    return parse(body)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_egress_follows_what_each_policy_kinds_group_needs(path: Path) -> None:
    spec = _spec(path.stem)
    kind = policy_fields.kind_of(spec.policy)
    policy = render_network.worker_policy(spec, 0)
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    group = {"podSelector": {"matchLabels": names.group_selector(spec.name, 0)}}
    expected = [DNS]
    if spec.group.nodes > 1:  # ranks on several pods: rendezvous, gloo/NCCL, Tetris control
        expected.append({"to": [group]})
    if spec.model.source.scheme == "hf":
        expected.append(HTTPS)
    assert policy["spec"]["egress"] == expected, kind
    # Nothing else: no rule reaches another group, the router, or anything on every port.
    for rule in policy["spec"]["egress"]:
        assert "ports" in rule or rule["to"] == [group]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_router_reaches_only_its_workers_dns_and_the_model_source(path: Path) -> None:
    spec = _spec(path.stem)
    policy = render_network.router_policy(spec, OperatorPeer("ops", {"a": "b"}))
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    port = names.VLLM_HTTP_PORT if spec.engine == "vllm" else names.WORKER_GRPC_PORT
    workers = {names.LABEL_DEPLOYMENT: spec.name, names.LABEL_COMPONENT: "worker"}
    expected = [
        DNS,
        {
            "to": [{"podSelector": {"matchLabels": workers}}],
            "ports": [{"protocol": "TCP", "port": port}],
        },
    ]
    if spec.model.source.scheme == "hf":
        expected.append(HTTPS)
    assert policy["spec"]["egress"] == expected


def test_a_single_pod_group_gets_no_pod_to_pod_egress_and_a_multi_pod_one_does() -> None:
    single = _spec("shift", group={"nodes": 1, "gpusPerNode": 8})
    multi = _spec("shift", group={"nodes": 2, "gpusPerNode": 4})
    rules = [render_network.worker_policy(s, 0)["spec"]["egress"] for s in (single, multi)]
    assert [r for r in rules[0] if "ports" not in r] == []
    assert [r for r in rules[1] if "ports" not in r] == [
        {"to": [{"podSelector": {"matchLabels": names.group_selector(multi.name, 0)}}]}
    ]


def test_the_model_download_can_be_narrowed_to_given_peers() -> None:
    mirror = [{"ipBlock": {"cidr": "10.20.0.0/16"}}]
    model = {"source": "hf://org/m", "name": "m", "egress": mirror}
    spec = _spec("shift", model=model)
    egress = render_network.worker_policy(spec, 0)["spec"]["egress"]
    (https,) = [r for r in egress if {"protocol": "TCP", "port": 443} in r.get("ports", [])]
    assert https == {"to": mirror, "ports": [{"protocol": "TCP", "port": 443}]}
    with pytest.raises(SpecError, match=r"spec\.model\.egress: applies to hf:// sources only"):
        _spec("shift", model={"source": "pvc://m/x", "egress": mirror})


def test_dns_pods_can_be_named_by_the_chart() -> None:
    settings = OperatorSettings.from_env({"GEARSHIFT_DNS_LABELS": "app=node-dns"})
    assert settings.dns == DnsPeer({"app": "node-dns"})
    rule = render_network.worker_policy(_spec("static"), 0, settings.dns)["spec"]["egress"][0]
    assert rule["to"][0]["podSelector"] == {"matchLabels": {"app": "node-dns"}}
    assert OperatorSettings.from_env({}).dns == DnsPeer()


@pytest.mark.parametrize(
    "operator",
    [OperatorPeer(), OperatorPeer("", {}), OperatorPeer("ops", {}), OperatorPeer("", {"a": "b"})],
)
def test_the_admin_rule_never_matches_every_pod(operator: OperatorPeer) -> None:
    """An empty namespace selector with an empty pod selector admits every pod of the cluster:
    unset chart values now fall back to this namespace and the chart's operator labels."""
    _, admin = render_network.router_policy(_spec("static"), operator)["spec"]["ingress"]
    (peer,) = admin["from"]
    assert peer["podSelector"]["matchLabels"], "an empty podSelector matches every pod"
    if operator.namespace:
        assert peer["namespaceSelector"] == {
            "matchLabels": {"kubernetes.io/metadata.name": operator.namespace}
        }
    else:
        assert "namespaceSelector" not in peer  # the deployment's own namespace only
    assert admin["ports"] == [{"protocol": "TCP", "port": names.ROUTER_ADMIN_PORT}]


def test_the_rendezvous_port_is_open_only_to_the_group() -> None:
    spec = _spec("shift", group={"nodes": 2, "gpusPerNode": 4})
    ingress = render_network.worker_policy(spec, 0)["spec"]["ingress"]
    for rule in ingress:
        assert rule.get("from"), "a rule without `from` admits everyone"
        ports = {p["port"] for p in rule.get("ports", [])}
        own = rule["from"] == [{"podSelector": {"matchLabels": names.group_selector(spec.name, 0)}}]
        # Every port (the rendezvous store's among them) only for the group's own pods.
        assert own or (ports and names.WORKER_DIST_PORT not in ports)
