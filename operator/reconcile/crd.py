"""The InferenceDeployment CustomResourceDefinition, generated.

`python -m gearshift.operator.reconcile.crd OUT...` (`make crd`) writes it to crds/ and to the
chart; tests fail when either copy differs from what this module builds. `spec.policy` comes from
the proto (crd_schema.py), the CEL rules for cross-field checks from crd_rules.py, the rest is
written here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from gearshift.operator.reconcile import crd_rules, crd_schema, names, spec
from gearshift.worker.model.source import MAX_REVISION_LENGTH, REVISION_PATTERN, REVISION_RULE


def _obj(props: dict[str, Any], description: str = "", **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props, **extra}
    if description:
        out["description"] = description
    return out


def _int(
    description: str, minimum: int | None = None, default: int | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "integer", "format": "int32", "description": description}
    if minimum is not None:
        out["minimum"] = minimum
    if default is not None:
        out["default"] = default
    return out


def _str(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def _env_var() -> dict[str, Any]:
    """A core/v1 EnvVar whose name is not one the operator sets (names.RESERVED_ENV)."""
    reserved = ", ".join(f"'{n}'" for n in names.RESERVED_ENV)
    return {
        "type": "object",
        "required": ["name"],
        "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 256}},
        "x-kubernetes-preserve-unknown-fields": True,
        "x-kubernetes-validations": [
            {
                "rule": f"!(self.name in [{reserved}])",
                "message": "group.env: names the operator sets (GEARSHIFT_CONTROL_TOKEN_FILE, "
                "GEARSHIFT_CONFIG, the group's wiring, VLLM_API_KEY) are reserved",
                "messageExpression": "'group.env: ' + self.name + ' is set by the operator "
                "and may not be overridden'",
            }
        ],
    }


_FREE = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
_INT_OR_STRING = {
    "x-kubernetes-int-or-string": True,
    "anyOf": [{"type": "integer"}, {"type": "string"}],
}


def spec_schema(policy: dict[str, Any]) -> dict[str, Any]:
    return _obj(
        {
            "model": _obj(
                {
                    "source": _str(
                        "Where the weights are: a path inside the worker image, "
                        "pvc://CLAIM/PATH (mounted read-only) or hf://ORG/NAME (downloaded).",
                        pattern=spec.MODEL_SOURCE_PATTERN,
                    ),
                    "name": _str("Served model name (API `model`). Default: metadata.name."),
                    "dtype": _str(
                        "Weight and activation dtype.", enum=list(spec.DTYPES), default="auto"
                    ),
                    "maxModelLen": _int("Context length limit. Default: the model's.", minimum=1),
                    "attentionBackend": _str(
                        "Attention kernels (`gearshift worker --attention-backend`): auto (Triton "
                        "on GPUs, the C++ kernels on CPUs), torch (the reference), cpu, or triton "
                        "(GPUs; on CPUs only with TRITON_INTERPRET=1 in group.env). Engine "
                        "gearshift only.",
                        enum=list(spec.ATTENTION_BACKENDS),
                        default="auto",
                    ),
                    "revision": _str(
                        "hf:// only: the commit sha, tag or branch to download; the operator "
                        "pins a tag or branch to its commit once (status.model.commit). "
                        f"Default: main. Must be {REVISION_RULE}.",
                        pattern=REVISION_PATTERN,
                        maxLength=MAX_REVISION_LENGTH,
                        **{
                            "x-kubernetes-validations": [
                                {
                                    "rule": "!self.contains('..')",
                                    "message": f"model.revision: must be {REVISION_RULE}",
                                }
                            ]
                        },
                    ),
                    "hfTokenSecret": _obj(
                        {
                            "name": _str("Secret name."),
                            "key": _str("Key in the Secret.", default="HF_TOKEN"),
                        },
                        "hf:// only: Secret with the token (HF_TOKEN) for private or gated repos.",
                        required=["name"],
                    ),
                    "egress": {
                        "type": "array",
                        "items": _FREE,
                        "description": "hf:// only: NetworkPolicy peers (ipBlock, "
                        "namespaceSelector, podSelector) the download may reach over HTTPS, "
                        "e.g. your Hub mirror's or proxy's address. Empty: any address on 443.",
                    },
                    "cache": _obj(
                        {"claimName": _str("PersistentVolumeClaim to download into.")},
                        "hf:// only: keep downloads in a PVC across pod restarts (by default each "
                        "pod downloads into an emptyDir). Per revision, so deployments can share.",
                        required=["claimName"],
                    ),
                },
                "The model to serve.",
                required=["source"],
                **{
                    "x-kubernetes-validations": [
                        {
                            "rule": "self.source.startsWith('hf://') || !has(self.egress)",
                            "message": "model.egress applies to hf:// sources only",
                        }
                    ]
                },
            ),
            "engine": _str(
                "gearshift, or vllm for stock `vllm serve` pods (static policy only).",
                enum=list(spec.ENGINES),
                default="gearshift",
            ),
            "images": _obj(
                {
                    "worker": _str("Worker image (CUDA + torch + gearshift)."),
                    "router": _str("Router image (the operator/router image)."),
                    "vllm": _str("vLLM image, for engine vllm."),
                    "pullPolicy": _str(
                        "Image pull policy.",
                        enum=["Always", "IfNotPresent", "Never"],
                        default="IfNotPresent",
                    ),
                    "pullSecrets": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": "Names of image pull Secrets.",
                    },
                },
                "Container images.",
                required=["router"],
            ),
            "replicas": _int("Worker groups (the scale subresource).", minimum=0, default=1),
            "group": _obj(
                {
                    "nodes": _int(
                        "Pods per group (one per node).", minimum=1, default=spec.DEFAULT_NODES
                    ),
                    "gpusPerNode": _int(
                        "Ranks (GPUs) per pod.", minimum=1, default=spec.DEFAULT_GPUS_PER_NODE
                    ),
                    "gpuResource": _str(
                        "Extended resource requested per rank; empty requests none (CPU).",
                        default=spec.DEFAULT_GPU_RESOURCE,
                    ),
                    "shmSize": {
                        **_INT_OR_STRING,
                        "description": "Size of /dev/shm (memory-backed; holds Seesaw's host KV "
                        "store).",
                        "default": spec.DEFAULT_SHM_SIZE,
                    },
                    "resources": {
                        **_FREE,
                        "description": "Worker container resources (core/v1 ResourceRequirements).",
                    },
                    "env": {
                        "type": "array",
                        "items": _env_var(),
                        "description": "Extra worker environment (core/v1 EnvVar). Names the "
                        f"operator sets are refused: {', '.join(names.RESERVED_ENV)}.",
                    },
                },
                "The shape of one worker group: nodes × gpusPerNode ranks run one engine.",
                default={},
            ),
            "policy": policy,
            "router": _obj(
                {
                    "replicas": _int("Router pods.", minimum=1, default=1),
                    "service": _obj(
                        {
                            "type": _str(
                                "Service type.", enum=list(spec.SERVICE_TYPES), default="ClusterIP"
                            ),
                            "port": _int(
                                "OpenAI HTTP port.", minimum=1, default=spec.DEFAULT_ROUTER_PORT
                            ),
                            "grpcPort": _int(
                                "gRPC Generation port.",
                                minimum=1,
                                default=spec.DEFAULT_ROUTER_GRPC_PORT,
                            ),
                        },
                        default={},
                    ),
                    "apiKeySecret": _obj(
                        {
                            "name": _str("Secret name."),
                            "key": _str("Key in the Secret.", default="api-key"),
                        },
                        "Secret holding the API key clients must send.",
                        required=["name"],
                    ),
                    "resources": {**_FREE, "description": "Router container resources."},
                    "allowedClients": {
                        "type": "array",
                        "items": _FREE,
                        "description": "NetworkPolicy peers (podSelector, namespaceSelector, "
                        "ipBlock) that may reach the client ports (HTTP, gRPC). Empty: everyone. "
                        "Worker and Admin ports are always closed to everything but the "
                        "deployment's own pods and the operator.",
                    },
                    "protectMetrics": {
                        "type": "boolean",
                        "default": False,
                        "description": "Require the API key on /metrics too (default: open, "
                        "as Prometheus expects). Needs apiKeySecret.",
                    },
                    "cacheSaltByApiKey": {
                        "type": "boolean",
                        "default": False,
                        "description": "Give each API key its own prefix cache: requests are "
                        "salted by their key (vLLM's cache_salt), so cached_tokens tells no "
                        "client about another's prompts. Needs apiKeySecret.",
                    },
                    "drainTimeoutSeconds": _int(
                        "On shutdown, seconds in-flight requests may finish; streams still "
                        "running then end with an error event. Pods get this plus a margin as "
                        "their termination grace period.",
                        minimum=0,
                        default=spec.DEFAULT_DRAIN_TIMEOUT_SECONDS,
                    ),
                    "maxBodyBytes": _int(
                        "Largest request body (HTTP) or message (gRPC) the router accepts, in "
                        "bytes; larger ones get 413. Unset: 4 MiB.",
                        minimum=1024,
                    ),
                },
                "The request router (OpenAI HTTP, gRPC, admin API).",
                default={},
                **{
                    "x-kubernetes-validations": [
                        {
                            "rule": "!self.cacheSaltByApiKey || has(self.apiKeySecret)",
                            "message": "router.cacheSaltByApiKey: needs router.apiKeySecret",
                        }
                    ]
                },
            ),
            "scheduling": _obj(
                {
                    "nodeSelector": {
                        "type": "object",
                        "additionalProperties": {"type": "string"},
                        "description": "Worker pod nodeSelector.",
                    },
                    "tolerations": {
                        "type": "array",
                        "items": _FREE,
                        "description": "Worker pod tolerations.",
                    },
                    "affinity": {**_FREE, "description": "Worker pod affinity."},
                    "priorityClassName": _str("PriorityClass of worker and router pods."),
                    "schedulerName": _str("Scheduler of worker pods."),
                    "gang": _obj(
                        {
                            "scheduler": _str(
                                "Schedule a group's pods all or none: volcano (PodGroup, "
                                "schedulerName volcano) or coscheduling (scheduler-plugins "
                                "PodGroup).",
                                enum=list(spec.GANG_SCHEDULERS),
                                default="none",
                            ),
                            "timeoutSeconds": _int(
                                "coscheduling scheduleTimeoutSeconds.", minimum=0
                            ),
                        },
                        "Gang scheduling of multi-node groups.",
                    ),
                },
                "Where worker pods run.",
            ),
            "rollout": _obj(
                {
                    "maxUnavailable": {
                        **_INT_OR_STRING,
                        "description": "Groups (or % of replicas) that may be unavailable "
                        "while rolling.",
                        "default": 1,
                    },
                    "maxSurge": {
                        **_INT_OR_STRING,
                        "description": "Extra groups (or % of replicas) created while rolling.",
                        "default": 0,
                    },
                },
                "How layout, model or image changes roll the groups.",
            ),
            "restartPolicy": _obj(
                {
                    "type": _str(
                        "RecreateGroupOnPodFailure replaces all of a group's pods when one fails.",
                        enum=list(spec.RESTART_POLICIES),
                        default="RecreateGroupOnPodFailure",
                    ),
                    "backoffSeconds": _int(
                        "Wait before the second restart; doubles after each.",
                        minimum=0,
                        default=spec.DEFAULT_BACKOFF_SECONDS,
                    ),
                    "maxBackoffSeconds": _int(
                        "Longest wait between restarts.",
                        minimum=0,
                        default=spec.DEFAULT_MAX_BACKOFF_SECONDS,
                    ),
                    "maxRestarts": _int(
                        "Restarts before giving up (Degraded).",
                        minimum=0,
                        default=spec.DEFAULT_MAX_RESTARTS,
                    ),
                },
                "What happens when a worker pod fails.",
                default={},
                **{
                    "x-kubernetes-validations": [
                        {
                            "rule": "self.maxBackoffSeconds >= self.backoffSeconds",
                            "message": "maxBackoffSeconds must be at least backoffSeconds",
                        }
                    ]
                },
            ),
        },
        "The desired deployment.",
        required=["model", "images", "policy"],
        **{"x-kubernetes-validations": crd_rules.layout_rules()},
    )


def status_schema() -> dict[str, Any]:
    condition = _obj(
        {
            "type": {"type": "string"},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"type": "string"},
            "message": {"type": "string"},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "observedGeneration": {"type": "integer", "format": "int64"},
        },
        required=["type", "status"],
    )
    group = _obj(
        {
            "name": {"type": "string"},
            "index": {"type": "integer"},
            "ready": {"type": "boolean"},
            "gear": {"type": "string"},
            "revision": {"type": "string"},
            "surge": {"type": "boolean"},
            "restarts": {"type": "integer"},
            "lastRestartTime": {"type": "string", "format": "date-time"},
            "message": {"type": "string"},
        }
    )
    return _obj(
        {
            "observedGeneration": {"type": "integer", "format": "int64"},
            "replicas": {
                "type": "integer",
                "description": "Groups that exist (surge groups excluded).",
            },
            "readyReplicas": {
                "type": "integer",
                "description": "Groups the router reports serving.",
            },
            "readyGroups": {"type": "string", "description": "serving/desired, for kubectl get."},
            "selector": {"type": "string", "description": "Label selector of the group leaders."},
            "policy": {"type": "string"},
            "gear": {"type": "string", "description": "Gear of the serving groups."},
            "endpoint": {"type": "string"},
            "model": _obj(
                {
                    "source": {"type": "string"},
                    "revision": {"type": "string", "description": "As the spec asks (main)."},
                    "commit": {
                        "type": "string",
                        "description": "The commit every pod downloads; resolved once.",
                    },
                },
                "hf:// sources: the pinned commit.",
            ),
            "groups": {"type": "array", "items": group, "x-kubernetes-list-type": "atomic"},
            "conditions": {
                "type": "array",
                "items": condition,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
            "auto": auto_status_schema(),
        }
    )


def auto_status_schema() -> dict[str, Any]:
    """status.auto: what policy: auto chose, why, and the simulated figures behind it."""
    figures = {
        "rate": {"type": "number", "description": "Requests per second per group."},
        "ttftP50Seconds": {"type": "number"},
        "ttftP99Seconds": {"type": "number"},
        "tpotP50Seconds": {"type": "number"},
        "tpotP99Seconds": {"type": "number"},
        "outputTokensPerSecond": {"type": "number"},
        "maxRateMeetingSlo": {"type": "number"},
    }
    line = _obj(
        {
            "name": {"type": "string"},
            "error": {"type": "string"},
            "meetsSlo": {"type": "boolean", "description": "At the declared rate."},
            **figures,
        }
    )
    plan: dict[str, Any] = {
        "inputs": {"type": "string", "description": "Digest of what the plan was made from."},
        "gpu": {"type": "string"},
        "choice": {"type": "string", "description": "The chosen layout, e.g. shift8."},
        "policy": {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "description": "The policy (spec.policy's form).",
        },
        "reason": {"type": "string"},
        "pricing": {"type": "string", "description": "What priced the steps: preset or profile."},
        "profile": _obj(
            {
                "configMap": {"type": "string", "description": "spec.policy.auto.profile."},
                "describe": {"type": "string", "description": "What the profile measured."},
            }
        ),
        "predicted": _obj({**figures, "kvTokens": {"type": "integer"}}),
        "considered": {"type": "array", "items": line, "x-kubernetes-list-type": "atomic"},
        "plannedAt": {"type": "string", "format": "date-time"},
        "traffic": _obj(
            {
                "source": {"type": "string", "description": "Declared or Observed."},
                "figures": {
                    "type": "object",
                    "x-kubernetes-preserve-unknown-fields": True,
                    "description": "The observed traffic planned from (rate for the whole "
                    "deployment, burstiness, prompt and output lengths), quantised.",
                },
                "requests": {"type": "integer", "description": "Requests in the window."},
                "windowSeconds": {"type": "number"},
                "message": {"type": "string"},
            },
            "traffic.source: Observed: the traffic this plan was made from.",
        ),
    }
    note = _obj({"inputs": {"type": "string"}, "message": {"type": "string"}})
    held = {
        **plan,
        "held": {"type": "string", "description": "Why it is not applied."},
        "gain": {"type": "number", "description": "Predicted gain over the running layout."},
    }
    return _obj(
        {
            **plan,
            "appliedAt": {
                "type": "string",
                "format": "date-time",
                "description": "When the running policy was applied (the cooldown's start).",
            },
            "applied": {"type": "string", "description": "Why the running plan was applied."},
            "recommendation": _obj(held, "The latest plan, when it is not applied."),
            "planning": _obj(note["properties"], "A plan in flight."),
            "error": _obj(
                note["properties"], "The planner ran past its timeout or died; retried later."
            ),
            "calibrating": _obj(
                {"message": {"type": "string"}},
                "auto.calibrate's profiling Job is running; the running choice is kept.",
            ),
            "observing": _obj(
                {"message": {"type": "string"}},
                "traffic.source: Observed could not read the router; the running choice is kept.",
            ),
        },
        "policy: auto's running choice (absent for other policies).",
    )


def build_crd(comments: dict[str, str] | None = None) -> dict[str, Any]:
    policy = crd_schema.policy_schema(comments)
    crd_rules.add_policy_rules(policy)
    policy["description"] = (
        "The parallel-layout policy: exactly one of static, shift, seesaw, sidp, tetris, auto "
        "(gearshift.v1.Policy in proto/gearshift/v1/policy.proto)."
    )
    schema = _obj(
        {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(policy),
            "status": status_schema(),
        },
        "A model served by groups of GPU workers whose parallel layout follows a policy.",
        required=["spec"],
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "size(self.metadata.name) <= 40",
                    "message": "metadata.name: at most 40 characters (child names derive from it)",
                }
            ]
        },
    )
    column = [
        {"name": "Policy", "type": "string", "jsonPath": ".status.policy"},
        {"name": "Gear", "type": "string", "jsonPath": ".status.gear"},
        {"name": "Ready", "type": "string", "jsonPath": ".status.readyGroups"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{names.PLURAL}.{names.GROUP}"},
        "spec": {
            "group": names.GROUP,
            "scope": "Namespaced",
            "names": {
                "plural": names.PLURAL,
                "singular": "inferencedeployment",
                "kind": names.KIND,
                "listKind": f"{names.KIND}List",
                "shortNames": ["infd"],
                "categories": ["gearshift"],
            },
            "versions": [
                {
                    "name": names.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": column,
                }
            ],
        },
    }


HEADER = (
    "# Generated by `make crd` (gearshift.operator.reconcile.crd) from proto/gearshift/v1.\n"
    "# Do not edit.\n"
)


def render(comments: dict[str, str] | None = None) -> str:
    return HEADER + yaml.safe_dump(
        build_crd(comments), sort_keys=False, width=100, allow_unicode=True
    )


def main(argv: list[str] | None = None) -> None:
    text = render()
    for out in argv if argv is not None else sys.argv[1:]:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)


if __name__ == "__main__":
    main()
