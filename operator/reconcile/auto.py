"""``policy: auto`` in the reconcile pass (issue 16, item 4): which GPU the group runs on, when to
plan again, and what the status says about the choice.

The plan (``sim/auto_policy.py``) takes seconds, so its result is kept in ``status.auto`` with a
digest of everything it was planned from: the auto fields, the resolved GPU, the group's shape,
the replica count and the context length. A pass whose digest matches reuses the stored choice;
any change of declared traffic, SLO, model shape, GPU or group shape plans again (issue 30: the
operator plans in a child process, auto_planner.py, and never waits for it). A new plan is then
applied or held by ``auto_apply`` (apply, margin, cooldown); an applied one flows through the
normal pass: another layout rolls the groups (with surge, reconciler.py), a change of live fields
only is applied through Admin.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from dataclasses import dataclass, replace
from typing import Any

from google.protobuf import json_format

from gearshift.operator.reconcile import auto_apply, auto_traffic, restarts
from gearshift.operator.reconcile.auto_planner import Failed, PlanRequest, run_plan
from gearshift.operator.reconcile.spec import DeploymentSpec, SpecError, parse_policy
from gearshift.operator.sim import auto_policy
from gearshift.v1 import policy_fields, policy_pb2
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.policies import checks
from gearshift.worker.policies.support import check_supported

# Set by NVIDIA's GPU feature discovery on every GPU node, e.g. "NVIDIA-H100-80GB-HBM3".
GPU_LABEL = "nvidia.com/gpu.product"
# Bump when the planner's rules change, so stored choices are planned again after an upgrade.
# 2: priced from the scaled preset, as gearshift plan is (issue 30), not the datasheet one.
PLANNER_VERSION = 2


class Waiting(Exception):
    """Nothing runs yet and the first plan is not there: in flight, or stopped at the timeout
    (or its child died) and planned again after the back-off."""

    def __init__(
        self,
        status: dict[str, Any] | None,
        message: str,
        timed_out: bool,
        reason: str = "Planning",
        error_reason: str = "PlannerTimedOut",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.timed_out = status, message, timed_out
        self.reason = reason  # the conditions' reason: Planning, or Calibrating (calibrate)
        # With timed_out: PlannerTimedOut, or PlannerCrashed (the child died without answering).
        self.error_reason = error_reason


@dataclass(frozen=True)
class Event:
    reason: str  # PolicyPlanned (applied) or PolicyRecommended (held)
    message: str


@dataclass(frozen=True)
class Resolved:
    spec: DeploymentSpec  # the spec with the running policy in place of auto
    status: dict[str, Any]  # status.auto
    planned: bool  # True when this pass planned (False: the stored choice was reused)
    event: Event | None = None  # what to tell the user about this pass's plan
    # Why status["error"], when there: PlannerTimedOut or PlannerCrashed (the conditions' reason).
    error_reason: str = "PlannerTimedOut"


def is_auto(spec: DeploymentSpec) -> bool:
    return policy_fields.kind_of(spec.policy) == "auto"


def needs_nodes(spec: DeploymentSpec) -> bool:
    """The GPU comes from the nodes' label, or calibrate needs that label's value."""
    return is_auto(spec) and (not spec.policy.auto.HasField("gpu") or calibrates(spec))


def calibrates(spec: DeploymentSpec) -> bool:
    return is_auto(spec) and spec.policy.auto.calibrate


def gpu_of(spec: DeploymentSpec, nodes: list[dict[str, Any]] | None) -> str:
    auto = spec.policy.auto
    if auto.HasField("gpu"):
        return auto.gpu.strip().upper()
    return gpu_from_nodes(nodes or [], spec.scheduling.node_selector)


def with_profile(spec: DeploymentSpec, config_map: str) -> DeploymentSpec:
    """``spec`` planning from the profile in ``config_map`` (calibrate's measured one)."""
    policy = policy_pb2.Policy()
    policy.CopyFrom(spec.policy)
    policy.auto.ClearField("calibrate")
    policy.auto.profile = config_map
    return replace(spec, policy=policy)


def hold(spec: DeploymentSpec, before: dict[str, Any], message: str) -> Resolved:
    """While calibrating: the running choice keeps running, status.auto.calibrating says why no
    plan comes; with none running yet, or one that no longer runs on the group (resized with
    calibrate turned on), Waiting (nothing changes, reason Calibrating)."""
    if not isinstance(before.get("policy"), dict):
        raise Waiting(None, message, False, reason="Calibrating")
    kept = {k: v for k, v in before.items() if k not in TRANSIENT}
    status = {**kept, "calibrating": {"message": message}}
    if misfit(spec, before["policy"]):
        raise Waiting(status, message, False, reason="Calibrating")
    return Resolved(with_policy(spec, before["policy"]), status, False)


def misfit(spec: DeploymentSpec, policy: dict[str, Any]) -> str:
    """Why the stored choice ``policy`` cannot run on ``spec``'s group as it is now ("": it
    can): the group was resized since it was planned."""
    try:
        error = layout_error(with_policy(spec, policy), planned=True)
    except SpecError as exc:
        return str(exc)
    return str(error) if error is not None else ""


def layout_error(spec: DeploymentSpec, planned: bool) -> SpecError | None:
    """Why ``spec``'s policy (``planned``: auto's choice, checked against the group's size too)
    does not run on its group, naming the field; None if it does."""
    errors = checks.layout_errors(spec.policy, spec.group.ranks) if planned else []
    if errors:  # a stored choice from before a group change
        return SpecError("spec." + "; spec.".join(errors))
    if spec.engine == "gearshift":  # engine: vllm runs static pp/dp through vLLM itself
        try:
            check_supported(spec.full_policy, spec.group.ranks, nodes=spec.group.nodes)
        except InvalidRequestError as exc:
            return SpecError(exc.message, exc.field)
    return None


def precheck(spec: DeploymentSpec, gpu: str) -> None:
    """SpecError naming the field for what a plan would refuse, asked before anything costly
    (calibrate's Job) is started for it."""
    try:
        auto_policy.check_inputs(spec.policy.auto, gpu, _shape(spec))
    except auto_policy.AutoError as exc:
        raise SpecError(str(exc), exc.field) from None


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


# How a plan is applied, not what it is: changing these re-decides, it does not plan again.
_NOT_INPUTS = ("apply", "margin", "cooldownSeconds")


def digest(
    spec: DeploymentSpec,
    gpu: str,
    profile: str | None = None,
    traffic: auto_traffic.PlanTraffic | None = None,
) -> str:
    fields = json_format.MessageToDict(spec.policy.auto)
    inputs: dict[str, Any] = {
        "auto": {k: v for k, v in fields.items() if k not in _NOT_INPUTS},
        "gpu": gpu.upper(),
        "shape": _shape(spec).__dict__,
        "planner": PLANNER_VERSION,
    }
    if profile is not None:  # its content, not only its name: a rewritten ConfigMap replans
        inputs["profile"] = hashlib.sha256(profile.encode()).hexdigest()
    if auto_traffic.observes(spec.policy.auto):  # the quantised figures (None: the declared)
        inputs["observed"] = traffic.figures if traffic is not None else None
    text = json.dumps(inputs, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def inputs(
    spec: DeploymentSpec,
    nodes: list[dict[str, Any]] | None,
    profile: str | None = None,
    traffic: auto_traffic.PlanTraffic | None = None,
) -> tuple[str, str]:
    """The GPU the group runs on and the digest of everything a plan depends on; ``profile``:
    the text of ``auto.profile``'s ConfigMap (``profile_text``), checked here against the GPU,
    the model's shape and the dtype it runs in;
    ``traffic``: with ``traffic.source: Observed``, what auto_traffic chose."""
    auto = spec.policy.auto
    gpu = gpu_of(spec, nodes)
    if auto.HasField("profile"):
        if profile is None:
            raise SpecError(
                f"{PROFILE_FIELD}: ConfigMap {auto.profile} was not read", PROFILE_FIELD
            )
        try:  # refused here, before a plan is started: parsing is cheap and torch-free
            auto_policy.profile_of(auto, gpu, profile, spec.model.dtype)
        except auto_policy.AutoError as exc:
            raise SpecError(str(exc), exc.field) from None
    return gpu, digest(spec, gpu, profile, traffic)


PROFILE_FIELD = auto_policy.PROFILE_FIELD
# A ConfigMap's name: a DNS subdomain (checked before it goes into an API path).
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def profile_name(spec: DeploymentSpec) -> str | None:
    """The ConfigMap ``auto.profile`` names (None: unset); SpecError if not a valid name."""
    auto = spec.policy.auto
    if not is_auto(spec) or not auto.HasField("profile"):
        return None
    if not _NAME.match(auto.profile):
        raise SpecError(
            f"{PROFILE_FIELD}: {auto.profile!r} is not a ConfigMap name (a DNS subdomain)",
            PROFILE_FIELD,
        )
    return auto.profile


def profile_text(spec: DeploymentSpec, config_map: dict[str, Any] | None) -> str:
    """The profile in ``config_map`` (auto.profile's, None: not found); SpecError if absent."""
    where = f"{PROFILE_FIELD}: ConfigMap {spec.policy.auto.profile}"
    if config_map is None:
        raise SpecError(f"{where} not found in namespace {spec.namespace}", PROFILE_FIELD)
    text = (config_map.get("data") or {}).get(auto_policy.PROFILE_KEY)
    if not text:
        raise SpecError(
            f"{where} has no key {auto_policy.PROFILE_KEY} (write the file of "
            "gearshift profile --layouts under it)",
            PROFILE_FIELD,
        )
    return str(text)


def needs_plan(before: dict[str, Any], key: str) -> bool:
    """No stored plan (running or recommended) was made from ``key``."""
    running = isinstance(before.get("policy"), dict) and before.get("inputs") == key
    recommended = (before.get("recommendation") or {}).get("inputs") == key
    return not (running or recommended)


def request(
    spec: DeploymentSpec,
    gpu: str,
    profile: str | None = None,
    traffic: auto_traffic.PlanTraffic | None = None,
) -> PlanRequest:
    shape = _shape(spec)
    return PlanRequest(
        spec.policy.auto.SerializeToString(),
        gpu,
        shape.gpus,
        shape.gpus_per_node,
        shape.replicas,
        shape.max_model_len,
        profile,
        traffic.figures if traffic is not None else None,
        spec.model.dtype,
    )


def plan_now(
    spec: DeploymentSpec,
    gpu: str,
    profile: str | None = None,
    traffic: auto_traffic.PlanTraffic | None = None,
) -> dict[str, Any]:
    """Plan in this process (``runnable``; the operator plans in a child, auto_planner.py)."""
    answer = run_plan(request(spec, gpu, profile, traffic))
    if isinstance(answer, Failed):
        raise SpecError(answer.message, answer.field)
    return answer.plan


def resolve(
    spec: DeploymentSpec,
    before: dict[str, Any],
    gpu: str,
    key: str,
    now: dt.datetime,
    fresh: dict[str, Any] | None = None,
    traffic: auto_traffic.PlanTraffic | None = None,
) -> Resolved:
    """The spec running the policy ``auto_apply`` keeps or takes, and status.auto.

    ``before``: the last status.auto; ``fresh``: a plan just made from ``key`` (None: the
    stored plans are up to date, ``needs_plan`` is False); ``traffic``: what an Observed
    source planned from (auto_traffic), shown with the plan."""
    resolved = _resolve(spec, before, gpu, key, now, fresh, traffic)
    if traffic is not None and traffic.observing:
        status = {**resolved.status, "observing": {"message": traffic.observing}}
        return replace(resolved, status=status)
    return resolved


def _resolve(
    spec: DeploymentSpec,
    before: dict[str, Any],
    gpu: str,
    key: str,
    now: dt.datetime,
    fresh: dict[str, Any] | None,
    traffic: auto_traffic.PlanTraffic | None,
) -> Resolved:
    running = before if isinstance(before.get("policy"), dict) else None
    kept = {k: v for k, v in (running or {}).items() if k not in TRANSIENT}
    if fresh is not None:
        plan = {**fresh, "inputs": key, "gpu": gpu, "plannedAt": restarts.format_time(now)}
        if traffic is not None:
            plan["traffic"] = traffic.status
    else:
        plan = dict(before.get("recommendation") or {})
        if plan.get("inputs") != key:  # the running plan is the latest
            if running is None:
                raise ValueError("resolve: no plan for these inputs")
            return Resolved(with_policy(spec, kept["policy"]), kept, False)
        for k in ("held", "gain"):
            plan.pop(k, None)
    rules = auto_apply.Rules.of(spec.policy.auto)
    unfit = misfit(spec, running["policy"]) if running is not None else ""
    decision = auto_apply.decide(running, plan, rules, now, unfit)
    if decision.apply:
        changed = running is None or running.get("policy") != plan["policy"]
        applied_at = restarts.format_time(now) if changed else kept.get("appliedAt")
        status = {**plan, "appliedAt": applied_at or plan["plannedAt"]}
        status["applied"] = decision.reason
        event = Event("PolicyPlanned", event_message(status)) if fresh or changed else None
        return Resolved(with_policy(spec, plan["policy"]), status, fresh is not None, event)
    held = {**plan, "held": decision.reason}
    if decision.gain is not None:
        held["gain"] = decision.gain
    status = {**kept, "recommendation": held}
    event = Event("PolicyRecommended", recommend_message(held)) if fresh else None
    return Resolved(with_policy(spec, kept["policy"]), status, fresh is not None, event)


# Keys of status.auto that describe a later plan, not the running one.
TRANSIENT = ("recommendation", "planning", "error", "calibrating", "observing")


def with_policy(spec: DeploymentSpec, policy: dict[str, Any]) -> DeploymentSpec:
    return replace(spec, policy=parse_policy(policy))


def event_message(status: dict[str, Any]) -> str:
    return f"auto chose {_plan_text(status)}"


def recommend_message(held: dict[str, Any]) -> str:
    return f"auto recommends {_plan_text(held)}; not applied: {held['held']}"


def _plan_text(status: dict[str, Any]) -> str:
    p = status.get("predicted") or {}
    figures = ", ".join(
        f"{label} {p[key]:.3g} s"
        for key, label in (("ttftP99Seconds", "p99 TTFT"), ("tpotP99Seconds", "p99 TPOT"))
        if p.get(key) is not None
    )
    # The pricing names the profile's ConfigMap and describe() when a profile priced the plan.
    pricing = f"; priced from {status['pricing']}" if status.get("pricing") else ""
    return (
        f"{status['choice']} {json.dumps(status['policy'], sort_keys=True)} on "
        f"{status['gpu']}: {status['reason']}"
        + (f" (predicted {figures})" if figures else "")
        + pricing
    )
