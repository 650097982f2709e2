"""The InferenceDeployment spec as typed, defaulted state.

The API server has already checked the spec against the CRD schema and its CEL rules; this module
reads it into frozen dataclasses (defaults as in the CRD, which imports them from here) and parses
`spec.policy` into the proto `Policy`, the one policy schema.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from gearshift.operator.reconcile import names
from gearshift.v1 import policy_fields, policy_pb2
from gearshift.worker.model.source import revision_error
from gearshift.worker.policies import checks, policy_json

DEFAULT_NODES = 1
DEFAULT_GPUS_PER_NODE = 1
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_SHM_SIZE = "8Gi"
DEFAULT_ROUTER_PORT = 8000
DEFAULT_ROUTER_GRPC_PORT = 50050
DEFAULT_DRAIN_TIMEOUT_SECONDS = 30
DEFAULT_BACKOFF_SECONDS = 10
DEFAULT_MAX_BACKOFF_SECONDS = 300
DEFAULT_MAX_RESTARTS = 10
ENGINES = ("gearshift", "vllm")
DTYPES = ("auto", "float32", "float16", "bfloat16")
# The worker's attention cores (gearshift.worker.config.ATTENTION_BACKENDS; a test keeps them
# equal without the operator importing torch).
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
GANG_SCHEDULERS = ("none", "volcano", "coscheduling")
RESTART_POLICIES = ("RecreateGroupOnPodFailure", "None")
MODEL_SOURCE_PATTERN = (
    r"^(hf://[A-Za-z0-9][\w.-]*/[\w.-]+|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/.*|/.+)$"
)


class SpecError(ValueError):
    """The spec cannot be rendered; the message names the field."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        head = message.split(":", 1)[0]
        # Every message starts with the field ("spec.model.source: ..."); "spec" when it lists many.
        self.field = field or (head if head.startswith("spec") and " " not in head else "spec")


@dataclass(frozen=True)
class ModelSource:
    """Where weights come from: a path in the image, a PVC path, or a Hugging Face repo id."""

    scheme: str  # "path" | "pvc" | "hf"
    claim: str = ""  # pvc only
    path: str = ""  # path in the container (path, pvc) or "org/name" (hf)

    @staticmethod
    def parse(uri: str) -> ModelSource:
        if not re.match(MODEL_SOURCE_PATTERN, uri):
            raise SpecError(
                f"spec.model.source: {uri!r} is not a path, pvc://claim/path or hf://org/name"
            )
        if uri.startswith("hf://"):
            return ModelSource("hf", path=uri.removeprefix("hf://"))
        if uri.startswith("pvc://"):
            claim, _, rest = uri.removeprefix("pvc://").partition("/")
            return ModelSource("pvc", claim=claim, path=rest)
        return ModelSource("path", path=uri)


@dataclass(frozen=True)
class ModelSpec:
    source: ModelSource
    uri: str
    served_name: str
    dtype: str = "auto"
    max_model_len: int | None = None
    attention_backend: str = "auto"
    # hf:// sources only: what to pin, who may read it, where downloads are kept.
    revision: str = ""
    token_secret: str = ""
    token_key: str = "HF_TOKEN"
    cache_claim: str = ""  # a PVC kept across restarts; "" = an emptyDir per pod
    # NetworkPolicy peers the download may reach (HTTPS); empty: any address.
    egress: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Images:
    worker: str
    router: str
    vllm: str = ""
    pull_policy: str = "IfNotPresent"
    pull_secrets: tuple[str, ...] = ()


@dataclass(frozen=True)
class GroupShape:
    nodes: int = DEFAULT_NODES
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    gpu_resource: str = DEFAULT_GPU_RESOURCE
    shm_size: str = DEFAULT_SHM_SIZE
    resources: dict[str, Any] = field(default_factory=dict)
    env: tuple[dict[str, Any], ...] = ()

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class RouterSpec:
    replicas: int = 1
    service_type: str = "ClusterIP"
    port: int = DEFAULT_ROUTER_PORT
    grpc_port: int = DEFAULT_ROUTER_GRPC_PORT
    api_key_secret: str = ""
    api_key_key: str = "api-key"
    resources: dict[str, Any] = field(default_factory=dict)
    # NetworkPolicy peers that may reach the client ports; empty: everyone.
    allowed_clients: tuple[dict[str, Any], ...] = ()
    protect_metrics: bool = False
    drain_timeout_seconds: int = DEFAULT_DRAIN_TIMEOUT_SECONDS
    # The router's request body cap (router.json maxBodyBytes); 0: the router's default.
    max_body_bytes: int = 0
    # Each API key its own prefix cache (operator/router/cache_salt.py).
    cache_salt_by_api_key: bool = False


@dataclass(frozen=True)
class Scheduling:
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    affinity: dict[str, Any] = field(default_factory=dict)
    priority_class_name: str = ""
    scheduler_name: str = ""
    gang: str = "none"
    gang_timeout_seconds: int = 0


@dataclass(frozen=True)
class Rollout:
    max_unavailable: int | str = 1
    max_surge: int | str = 0

    def resolve(self, replicas: int) -> tuple[int, int]:
        """(max_unavailable, max_surge) in groups; like a Deployment, never both zero."""
        unavailable = _scaled(self.max_unavailable, replicas, round_up=False)
        surge = _scaled(self.max_surge, replicas, round_up=True)
        if unavailable == 0 and surge == 0:
            unavailable = 1
        return unavailable, surge


@dataclass(frozen=True)
class RestartPolicy:
    type: str = "RecreateGroupOnPodFailure"
    backoff_seconds: int = DEFAULT_BACKOFF_SECONDS
    max_backoff_seconds: int = DEFAULT_MAX_BACKOFF_SECONDS
    max_restarts: int = DEFAULT_MAX_RESTARTS

    def backoff(self, restarts: int) -> float:
        """Seconds to wait before restart number `restarts + 1` (doubling, capped)."""
        return float(min(self.backoff_seconds * 2 ** max(restarts, 0), self.max_backoff_seconds))


@dataclass(frozen=True)
class DeploymentSpec:
    """Everything the renderers need, typed and defaulted."""

    name: str
    namespace: str
    uid: str
    generation: int
    model: ModelSpec
    engine: str
    images: Images
    replicas: int
    group: GroupShape
    policy: policy_pb2.Policy  # as written, without defaults
    router: RouterSpec
    scheduling: Scheduling
    rollout: Rollout
    restart: RestartPolicy
    # metadata.annotations["gearshift.dev/token-epoch"]: a new value rotates the tokens.
    token_epoch: str = ""

    @property
    def full_policy(self) -> policy_pb2.Policy:
        """The policy with every default filled in for this group size."""
        return checks.with_defaults(self.policy, self.group.ranks)


def _scaled(value: int | str, total: int, round_up: bool) -> int:
    if isinstance(value, int):
        return max(value, 0)
    pct = int(value.rstrip("%"))
    scaled = total * pct / 100
    return max(int(-(-scaled // 1) if round_up else scaled // 1), 0)


def parse_policy(raw: dict[str, Any]) -> policy_pb2.Policy:
    """spec.policy (``{"<kind>": {...}}``) into a Policy; unknown kinds and fields are errors."""
    if not isinstance(raw, dict):
        raise SpecError(f"spec.policy: must be an object, got {raw!r}")
    try:
        return policy_json.from_dict(raw)
    except ValueError as exc:
        raise SpecError(f"{_bad_field(raw, str(exc))}: {exc}") from exc


# protobuf's ParseError ends with where it stopped: "... at AutoPolicy.traffic.source."
_PARSE_AT = re.compile(r" at \w+\.([\w.]*\w)\.*$")


# Or, for a value out of its type's range, only the field's JSON name: "Failed to parse
# cooldownSeconds field: Value out of range: -5."
_PARSE_FIELD = re.compile(r"Failed to parse (\w+) field")


def _bad_field(raw: dict[str, Any], message: str) -> str:
    """The spec path of the value protobuf refused (e.g. spec.policy.auto.traffic.source)."""
    if len(raw) != 1:
        return "spec.policy"
    kind = str(next(iter(raw)))
    found = _PARSE_AT.search(message)
    if found is not None:
        camel = [re.sub(r"_([a-z])", lambda m: m.group(1).upper(), p) for p in found[1].split(".")]
        return ".".join(["spec.policy", kind, *camel])
    named = _PARSE_FIELD.search(message)
    path = _path_of_key(raw[kind], named[1]) if named is not None else None
    return ".".join(["spec.policy", kind, *path]) if path else "spec.policy"


def _path_of_key(value: Any, key: str) -> list[str] | None:
    """The path to the first ``key`` in ``value``'s objects (depth first), or None."""
    if not isinstance(value, dict):
        return None
    if key in value:
        return [key]
    for name, inner in value.items():
        below = _path_of_key(inner, key)
        if below is not None:
            return [str(name), *below]
    return None


def parse(body: dict[str, Any]) -> DeploymentSpec:
    """Read an InferenceDeployment object (as a dict) into a DeploymentSpec."""
    meta, spec = body.get("metadata", {}), body.get("spec", {})
    name = meta["name"]
    m = spec.get("model", {})
    img = spec.get("images", {})
    g = spec.get("group", {})
    r = spec.get("router", {})
    rs = r.get("service", {})
    key = r.get("apiKeySecret", {})
    s = spec.get("scheduling", {})
    gang = s.get("gang", {})
    ro = spec.get("rollout", {})
    rp = spec.get("restartPolicy", {})
    parsed = DeploymentSpec(
        name=name,
        namespace=meta.get("namespace", "default"),
        uid=meta.get("uid", ""),
        generation=int(meta.get("generation", 0)),
        model=ModelSpec(
            source=ModelSource.parse(m.get("source", "")),
            uri=m.get("source", ""),
            served_name=m.get("name") or name,
            dtype=m.get("dtype", "auto"),
            max_model_len=m.get("maxModelLen"),
            attention_backend=m.get("attentionBackend", "auto"),
            revision=m.get("revision", ""),
            token_secret=m.get("hfTokenSecret", {}).get("name", ""),
            token_key=m.get("hfTokenSecret", {}).get("key", "HF_TOKEN"),
            cache_claim=m.get("cache", {}).get("claimName", ""),
            egress=tuple(m.get("egress", [])),
        ),
        engine=spec.get("engine", "gearshift"),
        images=Images(
            worker=img.get("worker", ""),
            router=img.get("router", ""),
            vllm=img.get("vllm", ""),
            pull_policy=img.get("pullPolicy", "IfNotPresent"),
            pull_secrets=tuple(img.get("pullSecrets", [])),
        ),
        replicas=int(spec.get("replicas", 1)),
        group=GroupShape(
            nodes=int(g.get("nodes", DEFAULT_NODES)),
            gpus_per_node=int(g.get("gpusPerNode", DEFAULT_GPUS_PER_NODE)),
            gpu_resource=g.get("gpuResource", DEFAULT_GPU_RESOURCE),
            shm_size=str(g.get("shmSize", DEFAULT_SHM_SIZE)),
            resources=dict(g.get("resources", {})),
            env=tuple(g.get("env", [])),
        ),
        policy=parse_policy(spec.get("policy", {})),
        router=RouterSpec(
            replicas=int(r.get("replicas", 1)),
            service_type=rs.get("type", "ClusterIP"),
            port=int(rs.get("port", DEFAULT_ROUTER_PORT)),
            grpc_port=int(rs.get("grpcPort", DEFAULT_ROUTER_GRPC_PORT)),
            api_key_secret=key.get("name", ""),
            api_key_key=key.get("key", "api-key"),
            resources=dict(r.get("resources", {})),
            allowed_clients=tuple(r.get("allowedClients", [])),
            protect_metrics=bool(r.get("protectMetrics", False)),
            drain_timeout_seconds=int(r.get("drainTimeoutSeconds", DEFAULT_DRAIN_TIMEOUT_SECONDS)),
            max_body_bytes=int(r.get("maxBodyBytes", 0)),
            cache_salt_by_api_key=bool(r.get("cacheSaltByApiKey", False)),
        ),
        scheduling=Scheduling(
            node_selector=dict(s.get("nodeSelector", {})),
            tolerations=tuple(s.get("tolerations", [])),
            affinity=dict(s.get("affinity", {})),
            priority_class_name=s.get("priorityClassName", ""),
            scheduler_name=s.get("schedulerName", ""),
            gang=gang.get("scheduler", "none"),
            gang_timeout_seconds=int(gang.get("timeoutSeconds", 0)),
        ),
        rollout=Rollout(
            max_unavailable=ro.get("maxUnavailable", 1),
            max_surge=ro.get("maxSurge", 0),
        ),
        restart=RestartPolicy(
            type=rp.get("type", "RecreateGroupOnPodFailure"),
            backoff_seconds=int(rp.get("backoffSeconds", DEFAULT_BACKOFF_SECONDS)),
            max_backoff_seconds=int(rp.get("maxBackoffSeconds", DEFAULT_MAX_BACKOFF_SECONDS)),
            max_restarts=int(rp.get("maxRestarts", DEFAULT_MAX_RESTARTS)),
        ),
        token_epoch=str((meta.get("annotations") or {}).get(names.ANNOTATION_TOKEN_EPOCH, "")),
    )
    _check(parsed)
    return parsed


def _check(spec: DeploymentSpec) -> None:
    # The CRD's CEL rules say the same; checked again because a spec may predate a rule.
    if spec.engine not in ENGINES:
        raise SpecError(f"spec.engine: must be one of {', '.join(ENGINES)}")
    errors = checks.layout_errors(spec.policy, spec.group.ranks)
    if errors:
        raise SpecError("spec." + "; spec.".join(errors))
    if spec.model.attention_backend not in ATTENTION_BACKENDS:
        raise SpecError(
            f"spec.model.attentionBackend: must be one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if spec.engine == "vllm":
        if spec.model.attention_backend != "auto":
            raise SpecError("spec.model.attentionBackend: engine vllm picks its own (auto only)")
        if policy_fields.kind_of(spec.policy) != "static":
            raise SpecError("spec.policy: engine vllm runs only the static policy")
        if spec.group.nodes != 1 or spec.policy.static.sp > 1:
            raise SpecError("spec.group.nodes: engine vllm runs single-node groups without sp")
        if not spec.images.vllm:
            raise SpecError("spec.images.vllm: required for engine vllm")
    for i, var in enumerate(spec.group.env):
        name = var.get("name") if isinstance(var, dict) else None
        if not isinstance(name, str) or not name:
            raise SpecError(f"spec.group.env[{i}]: needs a name", "spec.group.env")
        if name in names.RESERVED_ENV:
            raise SpecError(
                f"spec.group.env: {name} is set by the operator and may not be overridden",
                "spec.group.env",
            )
    if spec.model.revision and (error := revision_error(spec.model.revision)):
        raise SpecError(f"spec.model.{error}", "spec.model.revision")
    hub_only = spec.model.revision or spec.model.token_secret or spec.model.cache_claim
    if hub_only and spec.model.source.scheme != "hf":
        raise SpecError("spec.model: revision, hfTokenSecret and cache apply to hf:// sources only")
    if spec.model.egress and spec.model.source.scheme != "hf":
        raise SpecError("spec.model.egress: applies to hf:// sources only", "spec.model.egress")
    if not spec.images.router or (spec.engine == "gearshift" and not spec.images.worker):
        raise SpecError("spec.images: worker and router images are required")
    if spec.router.cache_salt_by_api_key and not spec.router.api_key_secret:
        raise SpecError(
            "spec.router.cacheSaltByApiKey: salts by the API key, so spec.router.apiKeySecret "
            "is required",
            "spec.router.cacheSaltByApiKey",
        )
    if spec.router.protect_metrics and not spec.router.api_key_secret:
        raise SpecError(
            "spec.router.protectMetrics: /metrics is protected by the API key, so "
            "spec.router.apiKeySecret is required"
        )
