"""The model as pod parts: its volume, its mount, and for hf:// sources the init container that
downloads it (as KServe's storage initializer does). Pure functions of the spec.

pvc:// mounts the claim read-only. hf:// runs `gearshift fetch-model` (router image) before the
server starts, into a volume the server then mounts read-only: an emptyDir by default, or the PVC
named in spec.model.cache, where a pinned revision downloaded once is not fetched again. The
router only needs the tokenizer, so its init container skips the weights and it always uses an
emptyDir (its pod may run on another node than the claim's).
"""

from __future__ import annotations

from typing import Any

from gearshift.operator.reconcile import names, render_config
from gearshift.operator.reconcile.spec import DeploymentSpec

VOLUME = "model"


def volume(spec: DeploymentSpec, router: bool = False) -> dict[str, Any] | None:
    src = spec.model.source
    if src.scheme == "pvc":
        return {
            "name": VOLUME,
            "persistentVolumeClaim": {"claimName": src.claim, "readOnly": True},
        }
    if src.scheme == "hf":
        if spec.model.cache_claim and not router:
            return {"name": VOLUME, "persistentVolumeClaim": {"claimName": spec.model.cache_claim}}
        return {"name": VOLUME, "emptyDir": {}}
    return None


def mount(spec: DeploymentSpec) -> dict[str, Any] | None:
    """The server container's read-only mount of the model volume."""
    src = spec.model.source
    if src.scheme == "pvc":
        return {"name": VOLUME, "mountPath": names.PVC_MOUNT, "readOnly": True}
    if src.scheme == "hf":
        return {"name": VOLUME, "mountPath": names.HF_MOUNT, "readOnly": True}
    return None


def fetch_container(spec: DeploymentSpec, router: bool = False) -> dict[str, Any] | None:
    """The init container that downloads an hf:// source, or None for other sources."""
    if spec.model.source.scheme != "hf":
        return None
    args = ["fetch-model", spec.model.uri, "--dest", render_config.model_path(spec)]
    if spec.model.revision:
        args += ["--revision", spec.model.revision]
    if router:
        args.append("--tokenizer-only")
    env: list[dict[str, Any]] = [
        # huggingface_hub's own files (locks, token lookups) on the writable volume: the root
        # filesystem is read-only.
        {"name": "HF_HOME", "value": f"{names.HF_MOUNT}/.hf-home"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    if spec.model.token_secret:
        ref = {"name": spec.model.token_secret, "key": spec.model.token_key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    return {
        "name": "fetch-model",
        "image": spec.images.router,
        "imagePullPolicy": spec.images.pull_policy,
        "command": ["gearshift"],
        "args": args,
        "env": env,
        "volumeMounts": [{"name": VOLUME, "mountPath": names.HF_MOUNT}],
        "securityContext": {
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
