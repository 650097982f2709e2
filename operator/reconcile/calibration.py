"""``spec.policy.auto.calibrate`` as manifests (issue 30, item 1): a Job that runs ``gearshift
profile --layouts`` on one node of the group's GPU type and hands its profile over in a ConfigMap,
with a ServiceAccount, Role and RoleBinding that allow that Job nothing but ``get`` and ``patch``
of that one ConfigMap. Pure functions of the spec (the API calls are calibration_run.py's).

One calibration serves every deployment in the namespace with the same key: the model's shape
(``auto.model``), the GPU type, the worker image and the group's GPU count (which layouts are
measured). Its objects carry no deployment label (they are nobody's child alone) but an owner
reference to each deployment using them (``controller: false``). A deployment that stops using
one (its key changed, ``calibrate`` off, deleted) removes its reference, and the last one deletes
the calibration (calibration_run.retire), as Kubernetes' garbage collector would, later.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from google.protobuf import json_format

from gearshift.operator.reconcile import names, render_config, render_model
from gearshift.operator.reconcile import render_security as security
from gearshift.operator.reconcile.spec import DeploymentSpec, SpecError

FIELD = "spec.policy.auto.calibrate"
LABEL_CALIBRATION = "gearshift.dev/calibration"  # the key, on every calibration object
GPU_LABEL = "nvidia.com/gpu.product"
OUTPUT = f"{names.TMP_DIR}/profile.json"
# A profile of the default grid takes minutes per layout; past this the Job is failed.
DEADLINE_S = 3 * 3600


def check(spec: DeploymentSpec) -> None:
    """SpecError naming the field when ``calibrate`` cannot be honoured for ``spec``."""
    auto = spec.policy.auto
    if auto.HasField("profile"):
        raise SpecError(
            f"{FIELD}, spec.policy.auto.profile: set one: calibrate measures a profile, profile "
            "names one",
            FIELD,
        )
    why = ""
    if spec.group.nodes != 1:
        why = "the group spans several nodes; one profiling pod runs on one node"
    elif not spec.group.gpu_resource:
        why = "spec.group.gpuResource is empty: the group runs on no GPU to profile"
    elif spec.engine != "gearshift":
        why = f"engine {spec.engine}: gearshift profile measures the gearshift engine"
    elif _names_no_version(spec.images.worker):
        # The key holds the image reference: one that names no version (no tag, or :latest)
        # would keep an old profile after the image behind it moved.
        why = (
            f"spec.images.worker {spec.images.worker!r} names no version, and a profile is "
            "measured once per image version: pin a tag other than latest, or a digest"
        )
    if why:
        raise SpecError(f"{FIELD}: {why}; give spec.policy.auto.profile instead", FIELD)


def _names_no_version(image: str) -> bool:
    """True for an image reference with neither a digest nor a tag other than ``latest``."""
    if "@" in image:
        return False
    last = image.rsplit("/", 1)[-1]  # a registry's host:port is not a tag
    return ":" not in last or last.rsplit(":", 1)[1] == "latest"


def key(spec: DeploymentSpec, gpu: str) -> str:
    """What one calibration is for: model shape, GPU type, worker image and group size."""
    model = json_format.MessageToDict(spec.policy.auto.model, preserving_proto_field_name=True)
    what = {
        "model": model,
        "dtype": spec.model.dtype,
        "gpu": gpu.upper(),
        "image": spec.images.worker,
        "gpus": spec.group.ranks,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]


def name_of(calibration_key: str) -> str:
    return f"gearshift-calibration-{calibration_key}"


def layouts(ranks: int) -> list[str]:
    """The layouts ``auto`` can price from a profile on a group of ``ranks`` GPUs."""
    return ["one"] if ranks == 1 else [f"{k}{ranks}" for k in ("tp", "sp", "pp", "shift")]


def owner(spec: DeploymentSpec) -> dict[str, Any]:
    """A deployment's reference on a shared object: not its controller, any one may go first."""
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": spec.name, "uid": spec.uid}


def _meta(spec: DeploymentSpec, name: str, calibration_key: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": spec.namespace,
        "labels": {
            names.LABEL_MANAGED_BY: names.MANAGED_BY,
            names.LABEL_COMPONENT: "calibration",
            LABEL_CALIBRATION: calibration_key,
        },
        "ownerReferences": [owner(spec)],
    }


def manifests(
    spec: DeploymentSpec, gpu: str, product: str, calibration_key: str
) -> list[dict[str, Any]]:
    """The result ConfigMap (empty), the Job's ServiceAccount, Role and RoleBinding, and the Job
    on a node labelled ``nvidia.com/gpu.product: product``; in the order to create them."""
    name = name_of(calibration_key)
    meta = _meta(spec, name, calibration_key)
    rule = {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "resourceNames": [name],
        "verbs": ["get", "patch"],
    }
    rbac = "rbac.authorization.k8s.io"
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {}},
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": meta,
            "automountServiceAccountToken": False,  # the Job's pod mounts it, nothing else
        },
        {"apiVersion": f"{rbac}/v1", "kind": "Role", "metadata": meta, "rules": [rule]},
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": rbac, "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": spec.namespace}],
        },
        job(spec, gpu, product, calibration_key),
    ]


def job(spec: DeploymentSpec, gpu: str, product: str, calibration_key: str) -> dict[str, Any]:
    """The profiling Job: the worker image, hardened as the workers are, one node's GPUs."""
    name = name_of(calibration_key)
    gpus = str(spec.group.gpus_per_node)
    resources = {
        "limits": {spec.group.gpu_resource: gpus},
        "requests": {spec.group.gpu_resource: gpus},
    }
    args = [
        "profile",
        "--model",
        render_config.model_path(spec),
        "--layouts",
        ",".join(layouts(spec.group.ranks)),
        "--device",
        "cuda",
        "--dtype",
        spec.model.dtype,
        "-o",
        OUTPUT,
        "--configmap",
        name,
    ]
    if spec.model.max_model_len:
        args[-2:-2] = ["--max-model-len", str(spec.model.max_model_len)]
    mounts = [{"name": "shm", "mountPath": "/dev/shm"}, *security.scratch_mounts()]
    volumes: list[dict[str, Any]] = [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.group.shm_size}},
        *security.scratch_volumes(),
    ]
    model_mount, model_volume = render_model.mount(spec), render_model.volume(spec)
    if model_mount is not None and model_volume is not None:
        mounts.append(model_mount)
        volumes.append(model_volume)
    container = {
        "name": "profile",
        "image": spec.images.worker,
        "imagePullPolicy": spec.images.pull_policy,
        "command": ["gearshift"],
        "args": args,
        "env": security.cache_env(),
        "resources": resources,
        "volumeMounts": mounts,
        "securityContext": security.container_security(read_only_root=True, non_root=True),
    }
    pod: dict[str, Any] = {
        "serviceAccountName": name,
        # The one pod that calls the API: its token patches the result ConfigMap, nothing else.
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        "restartPolicy": "Never",
        "securityContext": security.pod_security(names.WORKER_UID),
        "nodeSelector": {**spec.scheduling.node_selector, GPU_LABEL: product},
        "containers": [container],
        "volumes": volumes,
    }
    fetch = render_model.fetch_container(spec)
    if fetch is not None:  # hf://: the weights, as a worker pod downloads them
        pod["initContainers"] = [fetch]
    if spec.images.pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in spec.images.pull_secrets]
    if spec.scheduling.tolerations:  # GPU nodes are often tainted: the group's tolerations
        pod["tolerations"] = [copy.deepcopy(t) for t in spec.scheduling.tolerations]
    meta = _meta(spec, name, calibration_key)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": 0,  # a failed profile is reported, not retried (delete the Job)
            "activeDeadlineSeconds": DEADLINE_S,
            "template": {"metadata": {"labels": dict(meta["labels"])}, "spec": pod},
        },
    }
