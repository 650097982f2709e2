"""Pod hardening and the control token, as manifest fragments: the deployment's token Secret,
security contexts, writable mounts under a read-only root, preStop and grace period.

The trust model (docs/operator.md, "Security"): whoever may create an InferenceDeployment may run
its images with its Secrets, as with a Deployment; the pods themselves get no Kubernetes API
access (no service-account token) and run with the restricted Pod Security profile where the
image allows it.
"""

from __future__ import annotations

import base64
from typing import Any

from gearshift.operator.reconcile import names
from gearshift.operator.reconcile.render_meta import child_metadata
from gearshift.operator.reconcile.spec import DeploymentSpec


def control_secret(spec: DeploymentSpec, token: str) -> dict[str, Any]:
    """The Secret with the deployment's control token; garbage-collected with its owner."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(spec, names.control_secret(spec.name), "control"),
        "type": "Opaque",
        "data": {names.CONTROL_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def token_from_secret(secret: dict[str, Any]) -> str:
    """The token in a Secret as the API returns it (base64 `data`); "" when absent."""
    raw = (secret.get("data") or {}).get(names.CONTROL_TOKEN_KEY) or ""
    try:
        return base64.b64decode(raw).decode().strip()
    except (ValueError, UnicodeDecodeError):
        return ""


def token_volume(spec: DeploymentSpec) -> dict[str, Any]:
    return {
        "name": "control-token",
        "secret": {
            "secretName": names.control_secret(spec.name),
            "items": [{"key": names.CONTROL_TOKEN_KEY, "path": names.CONTROL_TOKEN_KEY}],
            # Readable by the pod's fsGroup (the image's user), by nobody else in the pod.
            "defaultMode": 0o440,
        },
    }


def token_mount() -> dict[str, Any]:
    return {"name": "control-token", "mountPath": names.CONTROL_TOKEN_DIR, "readOnly": True}


def token_env() -> dict[str, Any]:
    return {"name": "GEARSHIFT_CONTROL_TOKEN_FILE", "value": names.CONTROL_TOKEN_FILE}


def scratch_volumes() -> list[dict[str, Any]]:
    """emptyDirs for the paths a read-only root filesystem must still let the process write."""
    return [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]


def scratch_mounts() -> list[dict[str, Any]]:
    return [
        {"name": "tmp", "mountPath": names.TMP_DIR},
        {"name": "cache", "mountPath": names.CACHE_DIR},
    ]


def cache_env() -> list[dict[str, Any]]:
    """Every cache the engine writes, under the writable cache mount."""
    return [
        {"name": "GEARSHIFT_KERNEL_CACHE", "value": f"{names.CACHE_DIR}/kernels"},
        {"name": "TRITON_CACHE_DIR", "value": f"{names.CACHE_DIR}/triton"},
        {"name": "HF_HOME", "value": f"{names.CACHE_DIR}/huggingface"},
    ]


def pod_security(uid: int | None) -> dict[str, Any]:
    """The pod's securityContext; `uid` None: the image's own user (it may need root)."""
    out: dict[str, Any] = {"seccompProfile": {"type": "RuntimeDefault"}}
    if uid is not None:
        out |= {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid}
    return out


def container_security(read_only_root: bool, non_root: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": read_only_root,
    }
    if non_root:
        out["runAsNonRoot"] = True
    return out


def stop_admission_hook(signal_pid1: bool) -> dict[str, Any]:
    """preStop: stop taking new requests (SIGUSR1 to the server, PID 1), then give endpoints and
    the router's health poll time to see it before SIGTERM starts the drain."""
    wait = f"sleep {names.PRESTOP_SECONDS}"
    script = f"kill -USR1 1; {wait}" if signal_pid1 else wait
    return {"preStop": {"exec": {"command": ["/bin/sh", "-c", script]}}}


def grace_period_seconds(spec: DeploymentSpec) -> int:
    """Above preStop + drain timeout, with a margin: Kubernetes' default 30 s is not."""
    return names.PRESTOP_SECONDS + spec.router.drain_timeout_seconds + names.GRACE_MARGIN_SECONDS
