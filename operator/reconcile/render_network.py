"""NetworkPolicies of one deployment: who may reach worker, rendezvous, Admin and client ports,
and where its pods may connect to.

Ingress:
- A worker group's pods: every port from the group's own pods (the rendezvous store, and the
  gloo/NCCL connections on ports they pick themselves), the worker gRPC port from the router.
- The router's pods: the Admin port from the operator only; the client ports (HTTP with
  /metrics, gRPC Generation) from `spec.router.allowedClients`, or from everyone.

Egress, derived from what the pods must reach, never from the policy kind:
- DNS (the group's and workers' addresses are DNS names).
- A worker group: its own pods, when it spans several (every policy's ranks, Tetris's control
  listener included, talk only inside their group; a pod's traffic to itself is never blocked).
- The router: the worker pods of its deployment, on the serving port.
- hf:// sources: HTTPS for the init container's download (`spec.model.egress` narrows it to
  the peers given; a NetworkPolicy is per pod, so the server container gets the same).

Kubelet probes come from the node, which NetworkPolicies never block.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from gearshift.operator.reconcile import names
from gearshift.operator.reconcile.render_meta import child_metadata
from gearshift.operator.reconcile.spec import DeploymentSpec

# The chart's operator pod labels: what an unset GEARSHIFT_OPERATOR_LABELS falls back to, so the
# Admin rule never becomes an empty selector (which would admit every pod).
DEFAULT_OPERATOR_LABELS = {
    "app.kubernetes.io/name": "gearshift",
    "app.kubernetes.io/component": "operator",
}
DNS_PORT = 53
HTTPS_PORT = 443


@dataclass(frozen=True)
class OperatorPeer:
    """Where the operator's pods run and their labels (the chart sets both)."""

    namespace: str = ""  # "": the deployment's own namespace
    labels: dict[str, str] = field(default_factory=dict)  # {}: DEFAULT_OPERATOR_LABELS

    def peer(self) -> dict[str, Any]:
        """Never a selector that matches everything: no namespace means this namespace only
        (a podSelector without namespaceSelector), no labels mean the chart's defaults."""
        out: dict[str, Any] = {
            "podSelector": {"matchLabels": dict(self.labels or DEFAULT_OPERATOR_LABELS)}
        }
        if self.namespace:
            out["namespaceSelector"] = {
                "matchLabels": {"kubernetes.io/metadata.name": self.namespace}
            }
        return out


@dataclass(frozen=True)
class DnsPeer:
    """The cluster DNS pods (kube-dns and CoreDNS both carry k8s-app=kube-dns); the chart may
    name others. DNS on the node (NodeLocal DNSCache) is reachable anyway."""

    labels: dict[str, str] = field(default_factory=lambda: {"k8s-app": "kube-dns"})

    def rule(self) -> dict[str, Any]:
        return {
            "to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": dict(self.labels)}}],
            "ports": [
                {"protocol": "UDP", "port": DNS_PORT},
                {"protocol": "TCP", "port": DNS_PORT},
            ],
        }


def _router_selector(spec: DeploymentSpec) -> dict[str, str]:
    return {names.LABEL_DEPLOYMENT: spec.name, names.LABEL_COMPONENT: "router"}


def _tcp(port: int) -> dict[str, Any]:
    return {"protocol": "TCP", "port": port}


def _serving_port(spec: DeploymentSpec) -> int:
    return names.VLLM_HTTP_PORT if spec.engine == "vllm" else names.WORKER_GRPC_PORT


def _model_source_rule(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """HTTPS to the Hub for hf:// downloads (the init container's), to `spec.model.egress`
    peers when given, else to any address."""
    if spec.model.source.scheme != "hf":
        return []
    rule: dict[str, Any] = {"ports": [_tcp(HTTPS_PORT)]}
    if spec.model.egress:
        rule["to"] = [copy.deepcopy(p) for p in spec.model.egress]
    return [rule]


def worker_policy(spec: DeploymentSpec, index: int, dns: DnsPeer | None = None) -> dict[str, Any]:
    """Group `index`: in, its own pods on any port and the router on the serving port; out,
    DNS, its own pods (when it spans several) and the model source."""
    group = names.group_selector(spec.name, index)
    port = _serving_port(spec)
    egress = [(dns or DnsPeer()).rule()]
    if spec.group.nodes > 1:
        egress.append({"to": [{"podSelector": {"matchLabels": dict(group)}}]})
    egress += _model_source_rule(spec)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(spec, names.group_name(spec.name, index), "worker", group),
        "spec": {
            "podSelector": {"matchLabels": dict(group)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": dict(group)}}]},
                {
                    "from": [{"podSelector": {"matchLabels": _router_selector(spec)}}],
                    "ports": [_tcp(port)],
                },
            ],
            "egress": egress,
        },
    }


def router_policy(
    spec: DeploymentSpec, operator: OperatorPeer, dns: DnsPeer | None = None
) -> dict[str, Any]:
    """The router: in, Admin from the operator only and client ports as the spec allows; out,
    DNS, its deployment's workers on their serving port, and the model source."""
    workers = {names.LABEL_DEPLOYMENT: spec.name, names.LABEL_COMPONENT: "worker"}
    egress = [
        (dns or DnsPeer()).rule(),
        {
            "to": [{"podSelector": {"matchLabels": workers}}],
            "ports": [_tcp(_serving_port(spec))],
        },
        *_model_source_rule(spec),
    ]
    clients: dict[str, Any] = {
        "ports": [_tcp(names.ROUTER_HTTP_PORT), _tcp(names.ROUTER_GRPC_PORT)]
    }
    if spec.router.allowed_clients:
        clients["from"] = [copy.deepcopy(p) for p in spec.router.allowed_clients]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(spec, names.router_name(spec.name), "router"),
        "spec": {
            "podSelector": {"matchLabels": _router_selector(spec)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                clients,
                {"from": [operator.peer()], "ports": [_tcp(names.ROUTER_ADMIN_PORT)]},
            ],
            "egress": egress,
        },
    }
