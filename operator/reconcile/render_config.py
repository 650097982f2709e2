"""The engine and router configuration (one ConfigMap) and the layout revision of a group.

The worker reads `engine.json` (`gearshift worker --config`; the `EngineJson` dataclass of
`gearshift.worker.server.engine_json`), the router `router.json` (`gearshift router --config`).
Both carry the policy as the CRD writes it (`{"<kind>": {...}}`), defaults filled in, so
`policy_json.parse_policy(cfg["policy"])` reads it back.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from gearshift.operator.reconcile import names
from gearshift.operator.reconcile.render_meta import child_metadata
from gearshift.operator.reconcile.spec import DeploymentSpec
from gearshift.v1 import policy_fields, policy_pb2
from gearshift.worker.model.source import HubSource
from gearshift.worker.policies import policy_json
from gearshift.worker.server.engine_json import EngineJson, GroupJson, ModelJson, PortsJson


def _policy_json(policy: policy_pb2.Policy) -> dict[str, Any]:
    return policy_json.to_dict(policy)


def model_path(spec: DeploymentSpec) -> str:
    """The model as the server containers see it: a path in the image, on the PVC, or where
    the init container downloaded the hf:// source (render_model.py)."""
    src = spec.model.source
    if src.scheme == "pvc":
        return f"{names.PVC_MOUNT}/{src.path}".rstrip("/")
    if src.scheme == "hf":
        hub = HubSource(src.path, spec.model.revision or None)
        return f"{names.HF_MOUNT}/{hub.folder_name()}"
    return src.path


def engine_json(spec: DeploymentSpec) -> EngineJson:
    """What every worker rank reads at start (through GEARSHIFT_CONFIG)."""
    return EngineJson(
        deployment=spec.name,
        namespace=spec.namespace,
        engine=spec.engine,
        model=ModelJson(
            source=spec.model.uri,
            path=model_path(spec),
            name=spec.model.served_name,
            dtype=spec.model.dtype,
            max_model_len=spec.model.max_model_len,
            attention_backend=spec.model.attention_backend,
        ),
        group=GroupJson(spec.group.nodes, spec.group.gpus_per_node, spec.group.ranks),
        ports=PortsJson(worker=names.WORKER_GRPC_PORT, rendezvous=names.WORKER_DIST_PORT),
        policy=_policy_json(spec.full_policy),
    )


def engine_config(spec: DeploymentSpec) -> dict[str, Any]:
    """engine.json as its JSON object."""
    return engine_json(spec).to_dict()


def router_config(spec: DeploymentSpec, indices: list[int], cluster_domain: str) -> dict[str, Any]:
    """The router's view: model, policy and the leader address of each group in `indices`."""
    vllm = spec.engine == "vllm"
    port = names.VLLM_HTTP_PORT if vllm else names.WORKER_GRPC_PORT
    groups = [
        {
            "name": names.group_name(spec.name, i),
            "address": f"{names.leader_host(spec.name, i, spec.namespace, cluster_domain)}:{port}",
        }
        for i in sorted(set(indices))
    ]
    return {
        "deployment": spec.name,
        "model": {"name": spec.model.served_name, "path": model_path(spec)},
        # "worker-grpc": gearshift.v1.Worker on each leader; "openai-http": stock vLLM servers.
        "backend": "openai-http" if vllm else "worker-grpc",
        "groups": groups,
        "policy": _policy_json(spec.full_policy),
        "ports": {
            "http": names.ROUTER_HTTP_PORT,
            "grpc": names.ROUTER_GRPC_PORT,
            "admin": names.ROUTER_ADMIN_PORT,
        },
        "apiKeyEnv": "GEARSHIFT_API_KEY" if spec.router.api_key_secret else "",
        "protectMetrics": spec.router.protect_metrics,
        # Absent: the router's default (docs/serving.md, Limits).
        **({"maxBodyBytes": spec.router.max_body_bytes} if spec.router.max_body_bytes else {}),
    }


def config_map(spec: DeploymentSpec, indices: list[int], cluster_domain: str) -> dict[str, Any]:
    """The ConfigMap mounted at /etc/gearshift in worker and router pods.

    `indices` are the groups the router should route to (base groups plus surge groups).
    """
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(spec, names.config_map_name(spec.name), "config"),
        "data": {
            "engine.json": engine_json(spec).dumps(indent=2),
            "router.json": json.dumps(
                router_config(spec, indices, cluster_domain), indent=2, sort_keys=True
            ),
        },
    }


def layout_policy(spec: DeploymentSpec) -> policy_pb2.Policy:
    """The policy minus its live fields: what a group's pods must be restarted to change."""
    return policy_fields.without_live(spec.full_policy)


def revision(spec: DeploymentSpec, pod_template: dict[str, Any]) -> str:
    """A short hash of everything that needs a group restart to change.

    Live policy fields are left out (options.proto `live`), so changing a threshold keeps the
    revision and no pod is recreated.
    """
    payload = {
        "template": pod_template,
        "engine": {**engine_config(spec), "policy": _policy_json(layout_policy(spec))},
    }
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    return digest[:12]
