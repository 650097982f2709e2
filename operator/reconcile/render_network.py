"""NetworkPolicies of one deployment: who may reach worker, rendezvous, Admin and client ports.

- A worker group's pods: every port from the group's own pods (the rendezvous store, and the
  gloo/NCCL connections on ports they pick themselves), the worker gRPC port from the router.
- The router's pods: the Admin port from the operator only; the client ports (HTTP with
  /metrics, gRPC Generation) from `spec.router.allowedClients`, or from everyone.

Kubelet probes come from the node, which common CNIs (Calico, Cilium) always let through.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from gearshift.operator.reconcile import names
from gearshift.operator.reconcile.render_meta import child_metadata
from gearshift.operator.reconcile.spec import DeploymentSpec


@dataclass(frozen=True)
class OperatorPeer:
    """Where the operator's pods run and their labels (the chart sets both)."""

    namespace: str = ""  # "": any namespace
    labels: dict[str, str] = field(default_factory=dict)

    def peer(self) -> dict[str, Any]:
        ns: dict[str, Any] = {}
        if self.namespace:
            ns = {"matchLabels": {"kubernetes.io/metadata.name": self.namespace}}
        return {"namespaceSelector": ns, "podSelector": {"matchLabels": dict(self.labels)}}


def _router_selector(spec: DeploymentSpec) -> dict[str, str]:
    return {names.LABEL_DEPLOYMENT: spec.name, names.LABEL_COMPONENT: "router"}


def _tcp(port: int) -> dict[str, Any]:
    return {"protocol": "TCP", "port": port}


def worker_policy(spec: DeploymentSpec, index: int) -> dict[str, Any]:
    """Group `index`: its own pods on any port, the router on the worker's serving port."""
    group = names.group_selector(spec.name, index)
    port = names.VLLM_HTTP_PORT if spec.engine == "vllm" else names.WORKER_GRPC_PORT
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(spec, names.group_name(spec.name, index), "worker", group),
        "spec": {
            "podSelector": {"matchLabels": dict(group)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": dict(group)}}]},
                {
                    "from": [{"podSelector": {"matchLabels": _router_selector(spec)}}],
                    "ports": [_tcp(port)],
                },
            ],
        },
    }


def router_policy(spec: DeploymentSpec, operator: OperatorPeer) -> dict[str, Any]:
    """The router: Admin from the operator only, client ports as the spec allows."""
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
            "policyTypes": ["Ingress"],
            "ingress": [
                clients,
                {"from": [operator.peer()], "ports": [_tcp(names.ROUTER_ADMIN_PORT)]},
            ],
        },
    }
