"""The router as manifests: its Deployment, the client Service and the ClusterIP admin Service.

The Admin API changes policies and drains groups, so it listens on its own port behind a
ClusterIP Service that a LoadBalancer never exposes; the operator calls it there.
"""

from __future__ import annotations

import copy
from typing import Any

from gearshift.operator.reconcile import names, render_model
from gearshift.operator.reconcile import render_security as security
from gearshift.operator.reconcile.render_meta import child_metadata
from gearshift.operator.reconcile.spec import DeploymentSpec


def _router_labels(spec: DeploymentSpec) -> dict[str, str]:
    return {names.LABEL_DEPLOYMENT: spec.name, names.LABEL_COMPONENT: "router"}


def deployment(spec: DeploymentSpec) -> dict[str, Any]:
    env: list[dict[str, Any]] = [
        {"name": "GEARSHIFT_CONFIG", "value": names.ROUTER_CONFIG},
        # Both tokens: the control token for its worker calls, the admin token for Admin.
        security.token_env(),
        security.token_env("admin"),
        # The tokenizer cache must be writable under a read-only root filesystem.
        {"name": "HF_HOME", "value": "/tmp/hf"},
    ]
    if spec.router.api_key_secret:
        env.append(
            {
                "name": "GEARSHIFT_API_KEY",
                "valueFrom": {
                    "secretKeyRef": {
                        "name": spec.router.api_key_secret,
                        "key": spec.router.api_key_key,
                    }
                },
            }
        )
    mounts = [
        {"name": "config", "mountPath": names.CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": names.TMP_DIR},
        security.token_mount(),
        security.token_mount("admin"),
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": names.config_map_name(spec.name)}},
        {"name": "tmp", "emptyDir": {}},
        security.token_volume(spec),
        security.token_volume(spec, "admin"),
    ]
    # The router loads the tokenizer from the same folder as the weights (hf://: its own
    # tokenizer-only download).
    model_mount, model_volume = render_model.mount(spec), render_model.volume(spec, router=True)
    if model_mount is not None and model_volume is not None:
        mounts.append(model_mount)
        volumes.append(model_volume)
    fetch = render_model.fetch_container(spec, router=True)
    container = {
        "name": "router",
        "image": spec.images.router,
        "imagePullPolicy": spec.images.pull_policy,
        "command": ["gearshift"],
        "args": [
            "router",
            "--config",
            names.ROUTER_CONFIG,
            "--drain-timeout",
            str(spec.router.drain_timeout_seconds),
        ],
        "env": env,
        "ports": [
            {"name": "http", "containerPort": names.ROUTER_HTTP_PORT},
            {"name": "grpc", "containerPort": names.ROUTER_GRPC_PORT},
            {"name": "admin", "containerPort": names.ROUTER_ADMIN_PORT},
        ],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10},
        "resources": copy.deepcopy(spec.router.resources),
        "volumeMounts": mounts,
        "securityContext": security.container_security(read_only_root=True, non_root=True),
        "lifecycle": security.stop_admission_hook(signal_pid1=True),
    }
    pod: dict[str, Any] = {
        "enableServiceLinks": False,
        # The router never calls the Kubernetes API (router.json arrives as a mounted file).
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": security.grace_period_seconds(spec),
        "containers": [container],
        "volumes": volumes,
        **({"initContainers": [fetch]} if fetch is not None else {}),
        "securityContext": security.pod_security(names.ROUTER_UID),
    }
    if spec.images.pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in spec.images.pull_secrets]
    if spec.scheduling.priority_class_name:
        pod["priorityClassName"] = spec.scheduling.priority_class_name
    labels = _router_labels(spec)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(spec, names.router_name(spec.name), "router"),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": {**names.base_labels(spec.name, "router"), **labels}},
                "spec": pod,
            },
        },
    }


def service(spec: DeploymentSpec) -> dict[str, Any]:
    """The endpoint clients use: OpenAI HTTP and gRPC Generation."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(spec, names.router_name(spec.name), "router"),
        "spec": {
            "type": spec.router.service_type,
            "selector": _router_labels(spec),
            "ports": [
                {"name": "http", "port": spec.router.port, "targetPort": "http"},
                {"name": "grpc", "port": spec.router.grpc_port, "targetPort": "grpc"},
            ],
        },
    }


def admin_service(spec: DeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(spec, names.router_admin_service(spec.name), "router"),
        "spec": {
            "type": "ClusterIP",
            "selector": _router_labels(spec),
            "ports": [{"name": "admin", "port": names.ROUTER_ADMIN_PORT, "targetPort": "admin"}],
        },
    }


def endpoint(spec: DeploymentSpec, cluster_domain: str) -> str:
    """The URL reported in status.endpoint."""
    host = f"{names.router_name(spec.name)}.{spec.namespace}.svc.{cluster_domain}"
    return f"http://{host}:{spec.router.port}"
