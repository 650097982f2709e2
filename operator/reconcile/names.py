"""Names, labels, ports and paths shared by the children the operator renders.

Kept in one place so the renderers, the reconciler and the tests agree on how a child is found.
"""

from __future__ import annotations

GROUP = "gearshift.dev"
VERSION = "v1alpha1"
PLURAL = "inferencedeployments"
KIND = "InferenceDeployment"
API_VERSION = f"{GROUP}/{VERSION}"

# Labels on every child; selectors use them (filtered client-side too: kmock has no selectors).
LABEL_DEPLOYMENT = "gearshift.dev/deployment"
LABEL_COMPONENT = "gearshift.dev/component"  # "worker" | "router"
LABEL_GROUP = "gearshift.dev/group"  # the group's StatefulSet name
LABEL_GROUP_INDEX = "gearshift.dev/group-index"
LABEL_SURGE = "gearshift.dev/surge"  # "true" on groups created above `replicas` during a rollout
LABEL_REVISION = "gearshift.dev/revision"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "gearshift-operator"
# Set by the StatefulSet controller on Kubernetes ≥ 1.28; the pod's node rank within its group.
LABEL_POD_INDEX = "apps.kubernetes.io/pod-index"

# The last desired state the operator applied to a child (for removing fields it no longer sets).
# Never on a Secret: it would copy the Secret's data into metadata (tokens.py writes Secrets).
ANNOTATION_APPLIED = "gearshift.dev/last-applied"
# On an InferenceDeployment: change its value (any string) to rotate the deployment's tokens.
ANNOTATION_TOKEN_EPOCH = "gearshift.dev/token-epoch"

# Ports inside pods. Every pod has its own network namespace, so fixed numbers cannot collide.
WORKER_GRPC_PORT = 50051  # Worker service + grpc.health.v1 (leader); health on every rank
WORKER_DIST_PORT = 29500  # torch.distributed rendezvous on the group leader
VLLM_HTTP_PORT = 8000
ROUTER_HTTP_PORT = 8000
ROUTER_GRPC_PORT = 50050  # Generation service
ROUTER_ADMIN_PORT = 50060  # Admin service, only behind the ClusterIP admin Service

CONFIG_DIR = "/etc/gearshift"
ENGINE_CONFIG = f"{CONFIG_DIR}/engine.json"
ROUTER_CONFIG = f"{CONFIG_DIR}/router.json"
PVC_MOUNT = "/mnt/model"
HF_MOUNT = "/mnt/hf"  # hf:// downloads (the init container writes, the server reads)
# The tokens (worker/server/auth.py): the key of each of the deployment's two Secrets, mounted
# as files. The control token (router → workers) in worker and router pods, the admin token
# (operator → router Admin) in router pods only.
CONTROL_TOKEN_KEY = "token"
CONTROL_TOKEN_DIR = "/etc/gearshift-control"
CONTROL_TOKEN_FILE = f"{CONTROL_TOKEN_DIR}/{CONTROL_TOKEN_KEY}"
ADMIN_TOKEN_DIR = "/etc/gearshift-admin"
ADMIN_TOKEN_FILE = f"{ADMIN_TOKEN_DIR}/{CONTROL_TOKEN_KEY}"
# Writable paths under a read-only root filesystem (emptyDirs).
TMP_DIR = "/tmp"
CACHE_DIR = "/var/cache/gearshift"  # compiled CPU kernels, Triton, Hugging Face
WORKER_UID = 1000  # the worker image's user (docker/worker.Dockerfile)
# vLLM's image runs as root by default; its pods run as this uid instead (any uid works: every
# path vLLM writes is an emptyDir named by env, see render_security.vllm_env).
VLLM_UID = 1000
ROUTER_UID = 65532  # the operator/router image's user (docker/operator.Dockerfile)
# Seconds a preStop hook waits after it stopped admission, so endpoints and the router's poll
# see the pod go unready before SIGTERM starts the drain.
PRESTOP_SECONDS = 5
# Beyond preStop + drain: for the servers to close and the last error events to be written.
GRACE_MARGIN_SECONDS = 15

WORKER_HEALTH_SERVICE = "gearshift.v1.Worker"

# Environment the operator sets on worker containers, which spec.group.env may not override:
# the group's identity and wiring, its tokens (an override could point the worker at a file
# anyone can write, or vLLM at no key), its configuration. Refused by the CRD and the operator.
RESERVED_ENV = (
    "GEARSHIFT_CONFIG",
    "GEARSHIFT_CONTROL_TOKEN_FILE",
    "GEARSHIFT_ADMIN_TOKEN_FILE",
    "GEARSHIFT_GROUP_NAME",
    "GEARSHIFT_GROUP_ADDR",
    "GEARSHIFT_GROUP_PORT",
    "GEARSHIFT_GROUP_SIZE",
    "GEARSHIFT_RANKS_PER_NODE",
    "GEARSHIFT_NODE_RANK",
    "GEARSHIFT_WORKER_PORT",
    "GEARSHIFT_REVISION",
    "GEARSHIFT_KERNEL_CACHE",
    "GEARSHIFT_API_KEY",
    "VLLM_API_KEY",
)


def config_map_name(name: str) -> str:
    return f"{name}-config"


def group_name(name: str, index: int) -> str:
    """The StatefulSet and headless Service of group `index`."""
    return f"{name}-g{index}"


def router_name(name: str) -> str:
    return f"{name}-router"


def router_admin_service(name: str) -> str:
    return f"{name}-router-admin"


def control_secret(name: str) -> str:
    """The Secret holding the deployment's control token (router → workers)."""
    return f"{name}-control-token"


def admin_secret(name: str) -> str:
    """The Secret holding the deployment's admin token (operator → router Admin)."""
    return f"{name}-admin-token"


def pdb_name(name: str) -> str:
    return f"{name}-workers"


def leader_host(name: str, index: int, namespace: str, cluster_domain: str) -> str:
    """DNS name of group `index`'s rank-0 pod through its headless Service."""
    group = group_name(name, index)
    return f"{group}-0.{group}.{namespace}.svc.{cluster_domain}"


def base_labels(name: str, component: str) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: name, LABEL_COMPONENT: component, LABEL_MANAGED_BY: MANAGED_BY}


def group_selector(name: str, index: int) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: name, LABEL_GROUP: group_name(name, index)}


def scale_selector(name: str) -> str:
    """Label selector of the scale subresource: the group leaders (one pod per group)."""
    return f"{LABEL_DEPLOYMENT}={name},{LABEL_COMPONENT}=worker,{LABEL_POD_INDEX}=0"
