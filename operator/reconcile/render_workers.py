"""Worker groups as manifests: one headless Service and one StatefulSet per group, PodGroups for
gang scheduling, and the workers' PodDisruptionBudget. Pure functions of the spec.

A group is one engine instance over nodes × gpusPerNode ranks; its pods are the StatefulSet's
ordinals, so pod index = node rank. The StatefulSet uses OnDelete: the operator replaces a group's
pods all at once (a group whose ranks run different revisions cannot rendezvous).
"""

from __future__ import annotations

import copy
from typing import Any

from gearshift.operator.reconcile import names, render_config, render_model
from gearshift.operator.reconcile import render_security as security
from gearshift.operator.reconcile.render_meta import child_metadata
from gearshift.operator.reconcile.spec import DeploymentSpec

# NCCL in a GPU group's pods (worker/p2p): an error or a timeout (the group's, set when the
# engine creates its NCCL groups) aborts the communicators and ends the process, so the group
# restarts as a whole; NCCL bootstraps over the pod's network interface. spec.group.env
# overrides either.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_SOCKET_IFNAME": "eth0"}


def _nccl_env(spec: DeploymentSpec) -> list[dict[str, Any]]:
    if not spec.group.gpu_resource:
        return []
    given = {e.get("name") for e in spec.group.env}
    return [{"name": k, "value": v} for k, v in NCCL_ENV.items() if k not in given]


def _env(spec: DeploymentSpec, index: int, cluster_domain: str) -> list[dict[str, Any]]:
    # What the multi-rank launcher reads; global rank = node rank × ranks per node + local rank.
    group = names.group_name(spec.name, index)
    env: list[dict[str, Any]] = [
        {"name": "GEARSHIFT_GROUP_NAME", "value": group},
        {
            "name": "GEARSHIFT_GROUP_ADDR",
            "value": names.leader_host(spec.name, index, spec.namespace, cluster_domain),
        },
        {"name": "GEARSHIFT_GROUP_PORT", "value": str(names.WORKER_DIST_PORT)},
        {"name": "GEARSHIFT_GROUP_SIZE", "value": str(spec.group.ranks)},
        {"name": "GEARSHIFT_RANKS_PER_NODE", "value": str(spec.group.gpus_per_node)},
        {
            "name": "GEARSHIFT_NODE_RANK",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{names.LABEL_POD_INDEX}']"}},
        },
        {"name": "GEARSHIFT_CONFIG", "value": names.ENGINE_CONFIG},
        {"name": "GEARSHIFT_WORKER_PORT", "value": str(names.WORKER_GRPC_PORT)},
        {
            "name": "GEARSHIFT_REVISION",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{names.LABEL_REVISION}']"}},
        },
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    return env + _nccl_env(spec) + [copy.deepcopy(e) for e in spec.group.env]


def vllm_args(spec: DeploymentSpec) -> list[str]:
    """`vllm serve` arguments for the static policy; every value comes from a validated field."""
    static = spec.full_policy.static
    args = [
        render_config.model_path(spec),
        "--served-model-name",
        spec.model.served_name,
        "--tensor-parallel-size",
        str(static.tp),
        "--pipeline-parallel-size",
        str(static.pp),
        "--data-parallel-size",
        str(static.dp),
        "--dtype",
        spec.model.dtype,
        "--host",
        "0.0.0.0",
        "--port",
        str(names.VLLM_HTTP_PORT),
    ]
    if spec.model.max_model_len:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    return args


def _container(spec: DeploymentSpec, index: int, cluster_domain: str) -> dict[str, Any]:
    resources = copy.deepcopy(spec.group.resources)
    if spec.group.gpu_resource:
        gpus = str(spec.group.gpus_per_node)
        resources.setdefault("limits", {}).setdefault(spec.group.gpu_resource, gpus)
        resources.setdefault("requests", {}).setdefault(spec.group.gpu_resource, gpus)
    mounts = [
        {"name": "config", "mountPath": names.CONFIG_DIR, "readOnly": True},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    model_mount = render_model.mount(spec)
    if model_mount is not None:
        mounts.append(model_mount)
    gearshift = spec.engine != "vllm"
    env = _env(spec, index, cluster_domain)
    # Read-only root: the server writes only to /tmp, the cache mount and /dev/shm.
    mounts += security.scratch_mounts()
    if gearshift:
        mounts.append(security.token_mount())
        env = [security.token_env(), *security.cache_env(), *env]
    else:
        env = [*security.vllm_env(spec), *env]
    container: dict[str, Any] = {
        "name": "worker",
        "imagePullPolicy": spec.images.pull_policy,
        "env": env,
        "resources": resources,
        "volumeMounts": mounts,
        "securityContext": security.container_security(read_only_root=True, non_root=True),
        "lifecycle": security.stop_admission_hook(signal_pid1=gearshift),
    }
    if spec.engine == "vllm":
        container |= {
            "image": spec.images.vllm,
            "command": ["vllm", "serve"],
            "args": vllm_args(spec),
            "ports": [{"name": "http", "containerPort": names.VLLM_HTTP_PORT}],
            "readinessProbe": {
                "httpGet": {"path": "/health", "port": names.VLLM_HTTP_PORT},
                "periodSeconds": 10,
            },
        }
    else:
        container |= {
            "image": spec.images.worker,
            "command": ["gearshift"],
            "args": [
                "worker",
                "--config",
                names.ENGINE_CONFIG,
                "--drain-timeout",
                str(spec.router.drain_timeout_seconds),
                # A rank per requested GPU (local rank i on GPU i); no GPU resource: the CPU.
                *(["--device", "cuda"] if spec.group.gpu_resource else []),
            ],
            "ports": [
                {"name": "grpc", "containerPort": names.WORKER_GRPC_PORT},
                {"name": "dist", "containerPort": names.WORKER_DIST_PORT},
            ],
            # Every rank serves grpc.health.v1; the leader also serves gearshift.v1.Worker.
            "readinessProbe": {
                "grpc": {"port": names.WORKER_GRPC_PORT},
                "periodSeconds": 10,
            },
        }
    return container


def pod_template(spec: DeploymentSpec, index: int, cluster_domain: str) -> dict[str, Any]:
    """The pod template of group `index`, without the revision label."""
    sched = spec.scheduling
    group = names.group_name(spec.name, index)
    labels = {
        **names.base_labels(spec.name, "worker"),
        **names.group_selector(spec.name, index),
        names.LABEL_GROUP_INDEX: str(index),
    }
    gearshift = spec.engine != "vllm"
    pod: dict[str, Any] = {
        "enableServiceLinks": False,
        # Workers never call the Kubernetes API.
        "automountServiceAccountToken": False,
        "securityContext": security.pod_security(names.WORKER_UID if gearshift else names.VLLM_UID),
        "terminationGracePeriodSeconds": security.grace_period_seconds(spec),
        "containers": [_container(spec, index, cluster_domain)],
        "volumes": [
            {"name": "config", "configMap": {"name": names.config_map_name(spec.name)}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.group.shm_size}},
        ],
    }
    pod["volumes"] += security.scratch_volumes()
    if gearshift:
        pod["volumes"].append(security.token_volume(spec))
    model_volume, fetch = render_model.volume(spec), render_model.fetch_container(spec)
    if model_volume is not None:
        pod["volumes"].append(model_volume)
    if fetch is not None:  # hf://: download before the server starts
        pod["initContainers"] = [fetch]
    if spec.images.pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in spec.images.pull_secrets]
    if sched.node_selector:
        pod["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        pod["tolerations"] = [copy.deepcopy(t) for t in sched.tolerations]
    if sched.affinity:
        pod["affinity"] = copy.deepcopy(sched.affinity)
    if sched.priority_class_name:
        pod["priorityClassName"] = sched.priority_class_name
    scheduler = sched.scheduler_name or ("volcano" if sched.gang == "volcano" else "")
    if scheduler:
        pod["schedulerName"] = scheduler
    annotations: dict[str, str] = {}
    if not gearshift and spec.token_epoch:
        # vLLM reads its API key once, at start: a rotated control token rolls the group.
        annotations[names.ANNOTATION_TOKEN_EPOCH] = spec.token_epoch
    if sched.gang == "volcano":
        annotations["scheduling.k8s.io/group-name"] = group
    elif sched.gang == "coscheduling":
        labels["scheduling.x-k8s.io/pod-group"] = group
    meta: dict[str, Any] = {"labels": labels}
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": pod}


def headless_service(spec: DeploymentSpec, index: int) -> dict[str, Any]:
    """Gives each rank a stable DNS name; unready addresses resolve so ranks can rendezvous."""
    group = names.group_name(spec.name, index)
    port = names.VLLM_HTTP_PORT if spec.engine == "vllm" else names.WORKER_GRPC_PORT
    ports = [{"name": "grpc" if spec.engine != "vllm" else "http", "port": port}]
    if spec.engine != "vllm":
        ports.append({"name": "dist", "port": names.WORKER_DIST_PORT})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(spec, group, "worker", names.group_selector(spec.name, index)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": names.group_selector(spec.name, index),
            "ports": ports,
        },
    }


def stateful_set(
    spec: DeploymentSpec, index: int, cluster_domain: str, surge: bool = False
) -> dict[str, Any]:
    """Group `index` as a StatefulSet, labelled and annotated with its layout revision."""
    template = pod_template(spec, index, cluster_domain)
    rev = render_config.revision(spec, template)
    template["metadata"]["labels"][names.LABEL_REVISION] = rev
    labels = {
        **names.group_selector(spec.name, index),
        names.LABEL_GROUP_INDEX: str(index),
        names.LABEL_REVISION: rev,
    }
    if surge:
        labels[names.LABEL_SURGE] = "true"
    group = names.group_name(spec.name, index)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": child_metadata(spec, group, "worker", labels),
        "spec": {
            "serviceName": group,
            "replicas": spec.group.nodes,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": names.group_selector(spec.name, index)},
            "template": template,
        },
    }


def pod_group(spec: DeploymentSpec, index: int) -> dict[str, Any] | None:
    """The gang-scheduling PodGroup of a group (all nodes scheduled together), if enabled."""
    group = names.group_name(spec.name, index)
    meta = child_metadata(spec, group, "worker", names.group_selector(spec.name, index))
    if spec.scheduling.gang == "volcano":
        return {
            "apiVersion": "scheduling.volcano.sh/v1beta1",
            "kind": "PodGroup",
            "metadata": meta,
            "spec": {"minMember": spec.group.nodes},
        }
    if spec.scheduling.gang == "coscheduling":
        pg_spec: dict[str, Any] = {"minMember": spec.group.nodes}
        if spec.scheduling.gang_timeout_seconds:
            pg_spec["scheduleTimeoutSeconds"] = spec.scheduling.gang_timeout_seconds
        return {
            "apiVersion": "scheduling.x-k8s.io/v1alpha1",
            "kind": "PodGroup",
            "metadata": meta,
            "spec": pg_spec,
        }
    return None


def disruption_budget(spec: DeploymentSpec) -> dict[str, Any]:
    """Voluntary disruptions take at most maxUnavailable worker pods, hence as many groups."""
    max_unavailable, _ = spec.rollout.resolve(spec.replicas)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(spec, names.pdb_name(spec.name), "worker"),
        "spec": {
            "maxUnavailable": max_unavailable,
            "selector": {
                "matchLabels": {
                    names.LABEL_DEPLOYMENT: spec.name,
                    names.LABEL_COMPONENT: "worker",
                }
            },
        },
    }
