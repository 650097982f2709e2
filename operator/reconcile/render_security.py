"""Pod hardening and the tokens, as manifest fragments: the token Secrets' volumes, security
contexts, writable mounts under a read-only root, preStop and grace period (the Secrets
themselves are tokens.py's).

The trust model (docs/operator.md, "Security"): whoever may create an InferenceDeployment may run
its images with its Secrets, as with a Deployment; the pods themselves get no Kubernetes API
access (no service-account token) and run with the restricted Pod Security profile where the
image allows it.
"""

from __future__ import annotations

from typing import Any

from gearshift.operator.reconcile import names
from gearshift.operator.reconcile.spec import DeploymentSpec
from gearshift.worker.server import auth


def token_volume(spec: DeploymentSpec, purpose: str = "control") -> dict[str, Any]:
    """The volume of one of the deployment's token Secrets (tokens.py). A whole-Secret volume
    (no subPath), so the kubelet updates the file when the Secret is rotated."""
    secret = names.admin_secret if purpose == "admin" else names.control_secret
    return {
        "name": f"{purpose}-token",
        "secret": {
            "secretName": secret(spec.name),
            "items": [{"key": names.CONTROL_TOKEN_KEY, "path": names.CONTROL_TOKEN_KEY}],
            # Readable by the pod's fsGroup (the image's user), by nobody else in the pod.
            "defaultMode": 0o440,
        },
    }


def token_mount(purpose: str = "control") -> dict[str, Any]:
    path = names.ADMIN_TOKEN_DIR if purpose == "admin" else names.CONTROL_TOKEN_DIR
    return {"name": f"{purpose}-token", "mountPath": path, "readOnly": True}


def token_env(purpose: str = "control") -> dict[str, Any]:
    if purpose == "admin":
        return {"name": auth.ADMIN_TOKEN_FILE_ENV, "value": names.ADMIN_TOKEN_FILE}
    return {"name": auth.TOKEN_FILE_ENV, "value": names.CONTROL_TOKEN_FILE}


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


def vllm_env(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """What `vllm serve` needs to run as a non-root user under a read-only root filesystem:
    every cache and config folder on the writable cache mount, a user name without a passwd
    entry, no usage reporting; and the control token as its API key (VLLM_API_KEY, read from
    the Secret by the kubelet: not in the pod spec, not on the command line)."""
    cache = names.CACHE_DIR
    ref = {"name": names.control_secret(spec.name), "key": names.CONTROL_TOKEN_KEY}
    return [
        {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": ref}},
        {"name": "HOME", "value": f"{names.TMP_DIR}/home"},
        {"name": "USER", "value": "vllm"},  # getpass.getuser() without /etc/passwd
        {"name": "HF_HOME", "value": f"{cache}/huggingface"},
        {"name": "VLLM_CACHE_ROOT", "value": f"{cache}/vllm"},
        {"name": "VLLM_CONFIG_ROOT", "value": f"{cache}/vllm-config"},
        {"name": "XDG_CACHE_HOME", "value": f"{cache}/xdg"},
        {"name": "XDG_CONFIG_HOME", "value": f"{cache}/xdg-config"},
        {"name": "TRITON_CACHE_DIR", "value": f"{cache}/triton"},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{cache}/inductor"},
        {"name": "NUMBA_CACHE_DIR", "value": f"{cache}/numba"},
        {"name": "OUTLINES_CACHE_DIR", "value": f"{cache}/outlines"},
        {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
        {"name": "DO_NOT_TRACK", "value": "1"},
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
