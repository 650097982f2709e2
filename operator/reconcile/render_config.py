"""The engine and router configuration (one ConfigMap) and the layout revision of a group.

The worker reads `engine.json` (`gearshift worker --config`), the router `router.json`
(`gearshift router --config`). Both carry the policy in the proto's JSON form, defaults filled in,
so `json_format.ParseDict(cfg["policy"], Policy())` reads it back.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from google.protobuf import json_format

from gearshift.operator.reconcile import names
from gearshift.operator.reconcile.render_meta import child_metadata
from gearshift.operator.reconcile.spec import DeploymentSpec
from gearshift.v1 import policy_fields, policy_pb2
from gearshift.worker.model.source import HubSource


def _policy_json(policy: policy_pb2.Policy) -> dict[str, Any]:
    # int64 fields would be strings in proto JSON; ParseDict reads both, people read numbers.
    return json_format.MessageToDict(policy, preserving_proto_field_name=False)


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


def engine_config(spec: DeploymentSpec) -> dict[str, Any]:
    """What every worker rank reads at start (through GEARSHIFT_CONFIG)."""
    return {
        "deployment": spec.name,
        "namespace": spec.namespace,
        "engine": spec.engine,
        "model": {
            "source": spec.model.uri,
            "path": model_path(spec),
            "name": spec.model.served_name,
            "dtype": spec.model.dtype,
            "maxModelLen": spec.model.max_model_len,
        },
        "group": {
            "nodes": spec.group.nodes,
            "gpusPerNode": spec.group.gpus_per_node,
            "ranks": spec.group.ranks,
        },
        "ports": {"worker": names.WORKER_GRPC_PORT, "rendezvous": names.WORKER_DIST_PORT},
        "policy": _policy_json(spec.full_policy),
    }


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
        "cacheSaltByApiKey": spec.router.cache_salt_by_api_key,
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
            "engine.json": json.dumps(engine_config(spec), indent=2, sort_keys=True),
            "router.json": json.dumps(
                router_config(spec, indices, cluster_domain), indent=2, sort_keys=True
            ),
        },
    }


def layout_policy(spec: DeploymentSpec) -> policy_pb2.Policy:
    """The policy minus its live fields: what a group's pods must be restarted to change."""
    full = spec.full_policy
    out = policy_pb2.Policy()
    out.CopyFrom(full)
    kind = policy_fields.kind_of(full)
    if kind:
        for path, fdesc in policy_fields.walk_fields(getattr(full, kind).DESCRIPTOR):
            if policy_fields.is_live(fdesc):
                *parents, leaf = path.split(".")
                target = getattr(out, kind)
                for p in parents:
                    target = getattr(target, p)
                target.ClearField(leaf)
    return out


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
