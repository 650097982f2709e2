"""``policy: auto`` in the reconcile pass (issue 16, item 4): which GPU the group runs on, when to
plan again, and what the status says about the choice.

The plan (``sim/auto_policy.py``) takes seconds, so its result is kept in ``status.auto`` with a
digest of everything it was planned from: the auto fields, the resolved GPU, the group's shape,
the replica count and the context length. A pass whose digest matches reuses the stored choice;
any change of declared traffic, SLO, model shape, GPU or group shape plans again. The new choice
then flows through the normal pass: another layout changes the groups' revision and rolls them,
a change of live fields only is applied through Admin.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass, replace
from typing import Any

from google.protobuf import json_format

from gearshift.operator.reconcile import restarts
from gearshift.operator.reconcile.spec import DeploymentSpec, SpecError, parse_policy
from gearshift.operator.sim import auto_policy
from gearshift.v1 import policy_fields

# Set by NVIDIA's GPU feature discovery on every GPU node, e.g. "NVIDIA-H100-80GB-HBM3".
GPU_LABEL = "nvidia.com/gpu.product"
# Bump when the planner's rules change, so stored choices are planned again after an upgrade.
PLANNER_VERSION = 1


@dataclass(frozen=True)
class Resolved:
    spec: DeploymentSpec  # the spec with the chosen policy in place of auto
    status: dict[str, Any]  # status.auto
    planned: bool  # True when this pass planned (False: the stored choice was reused)


def is_auto(spec: DeploymentSpec) -> bool:
    return policy_fields.kind_of(spec.policy) == "auto"


def needs_nodes(spec: DeploymentSpec) -> bool:
    return is_auto(spec) and not spec.policy.auto.HasField("gpu")


def gpu_from_nodes(nodes: list[dict[str, Any]], selector: dict[str, str]) -> str:
    """The planner's device name for the nodes ``selector`` picks, from their product label."""
    field = f"{auto_policy.FIELD}.gpu"
    picked = [
        n
        for n in nodes
        if all(
            ((n.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in selector.items()
        )
    ]
    products = {
        ((n.get("metadata") or {}).get("labels") or {}).get(GPU_LABEL, "") for n in picked
    } - {""}
    if not products:
        where = f" matching spec.scheduling.nodeSelector {selector}" if selector else ""
        raise SpecError(
            f"{field}: not set, and no node{where} carries the {GPU_LABEL} label; set gpu",
            field,
        )
    devices = {_device(p) for p in products}
    if None in devices:
        unknown = sorted(p for p in products if _device(p) is None)
        raise SpecError(
            f"{field}: not set, and the nodes' {GPU_LABEL} {unknown} is not a device the planner "
            f"describes ({', '.join(sorted(auto_policy.hw_mod.PRESETS))}); set gpu",
            field,
        )
    if len(devices) > 1:
        raise SpecError(
            f"{field}: not set, and the selected nodes carry different GPUs {sorted(products)}; "
            "set gpu or narrow spec.scheduling.nodeSelector",
            field,
        )
    return str(devices.pop())


def _device(product: str) -> str | None:
    # "NVIDIA-H100-80GB-HBM3" -> H100, "NVIDIA-H100-NVL" -> H100NVL (hardware.py).
    return auto_policy.hw_mod.preset_of_product(product)


def _shape(spec: DeploymentSpec) -> auto_policy.GroupShape:
    return auto_policy.GroupShape(
        gpus=spec.group.ranks,
        gpus_per_node=spec.group.gpus_per_node,
        replicas=spec.replicas,
        max_model_len=spec.model.max_model_len,
    )


def digest(spec: DeploymentSpec, gpu: str) -> str:
    inputs = {
        "auto": json_format.MessageToDict(spec.policy.auto),
        "gpu": gpu.upper(),
        "shape": _shape(spec).__dict__,
        "planner": PLANNER_VERSION,
    }
    text = json.dumps(inputs, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def resolve(
    spec: DeploymentSpec,
    previous: dict[str, Any],
    nodes: list[dict[str, Any]] | None,
    now: dt.datetime,
) -> Resolved:
    """The spec with auto replaced by its choice; plans only when the inputs changed."""
    auto = spec.policy.auto
    gpu = (
        auto.gpu.strip().upper()
        if auto.HasField("gpu")
        else gpu_from_nodes(nodes or [], spec.scheduling.node_selector)
    )
    key = digest(spec, gpu)
    before = previous.get("auto") or {}
    if before.get("inputs") == key and isinstance(before.get("policy"), dict):
        return Resolved(replace(spec, policy=parse_policy(before["policy"])), before, False)
    try:
        choice = auto_policy.choose(auto, gpu, _shape(spec))
    except auto_policy.AutoError as exc:
        raise SpecError(str(exc), exc.field) from exc
    status = {
        "inputs": key,
        "gpu": gpu,
        "choice": choice.candidate,
        "policy": choice.policy,
        "reason": choice.reason,
        # Structural status has no nulls: a figure the plan lacks is left out.
        "predicted": _present(choice.predicted),
        "considered": [_present(line) for line in choice.considered],
        "plannedAt": restarts.format_time(now),
    }
    return Resolved(replace(spec, policy=parse_policy(choice.policy)), status, True)


def _present(figures: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in figures.items() if v is not None}


def event_message(status: dict[str, Any]) -> str:
    p = status.get("predicted") or {}
    figures = ", ".join(
        f"{label} {p[key]:.3g} s"
        for key, label in (("ttftP99Seconds", "p99 TTFT"), ("tpotP99Seconds", "p99 TPOT"))
        if p.get(key) is not None
    )
    return (
        f"auto chose {status['choice']} {json.dumps(status['policy'], sort_keys=True)} on "
        f"{status['gpu']}: {status['reason']}" + (f" (predicted {figures})" if figures else "")
    )
